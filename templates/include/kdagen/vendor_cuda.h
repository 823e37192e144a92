// kdagen vendor layer, NVIDIA (warp of 32, mma.sync m16n8k16).
//
// The kernels see one interface on every vendor: a 16x16 fp32 accumulator tile
// `Acc`, 16-bit operand tiles `Frag`, and
//   load_a(f)  A operand, f(row, k) gives A[row][k]
//   load_b(f)  B operand, f(n, k)   gives B[k][n]   (k runs along memory rows)
//   to_a(acc)  reuse an accumulator (row, col) as an A operand (row, k = col)
//   mma(d,a,b) d += a * b
//   for_each(acc, f) visits this lane's (row, col, value&)
//   load_a2(f2) / load_b2(f2)  the same, f2 giving two neighbouring k as a float2
//   load_a_smem / load_b_smem  the same operands read straight from 16-bit LDS
//   neg(frag)  the operand negated
// Here a 16x16 tile is two m16n8 halves; lane = 4 * g + t.
#pragma once

#include "numeric.h"

namespace kdagen {

constexpr int kWaveSize = 32;

// Occupancy hint: `threads` per block and at least `blocks` resident per SM.
#define KDAGEN_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__((threads), (blocks))

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int wave_id() { return threadIdx.x >> 5; }

__device__ __forceinline__ float wave_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ void wave_sync() { __syncwarp(); }

// Asynchronous 16-byte global -> shared copies (cp.async, Ampere and newer): `copy16`
// zero-fills when `pred` is false; `commit` closes a group, `wait<N>` blocks until at
// most N groups of this thread are still in flight.
namespace async {
constexpr bool kHardware = true;
#if defined(KDAGEN_EMULATE)
__device__ __forceinline__ void copy16(void* smem, const void* gmem, bool pred) {
  kdagen_emu::cp_async(smem, gmem, pred);
}
__device__ __forceinline__ void commit() { kdagen_emu::cp_commit(); }
template <int N> __device__ __forceinline__ void wait() { kdagen_emu::cp_wait(N); }
#else
__device__ __forceinline__ void copy16(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(pred ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif
}  // namespace async

namespace mma {

struct Acc { float v[8]; };
struct Frag { uint32_t r[4]; };

template <DType T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  static_assert(T != DType::kFP32, "matrix operands are 16-bit");
  if constexpr (T == DType::kBF16) {
    __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&p);
  } else {
    __half2 p = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&p);
  }
}

__device__ __forceinline__ void zero(Acc& c) {
#pragma unroll
  for (int i = 0; i < 8; ++i) c.v[i] = 0.0f;
}

// v[4h + e]: row g + 8 * (e >> 1), col 8h + 2t + (e & 1).
template <class F> __device__ __forceinline__ void for_each(Acc& c, F&& f) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
  for (int i = 0; i < 8; ++i) f(g + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * t + (i & 1), c.v[i]);
}

template <DType T, class F> __device__ __forceinline__ Frag load_a(F&& f) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  Frag a;
  a.r[0] = pack2<T>(f(g, 2 * t), f(g, 2 * t + 1));
  a.r[1] = pack2<T>(f(g + 8, 2 * t), f(g + 8, 2 * t + 1));
  a.r[2] = pack2<T>(f(g, 2 * t + 8), f(g, 2 * t + 9));
  a.r[3] = pack2<T>(f(g + 8, 2 * t + 8), f(g + 8, 2 * t + 9));
  return a;
}

// r[2h], r[2h+1]: n = 8h + g, k = 2t.. and 2t+8..
template <DType T, class F> __device__ __forceinline__ Frag load_b(F&& f) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  Frag b;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    b.r[2 * h] = pack2<T>(f(8 * h + g, 2 * t), f(8 * h + g, 2 * t + 1));
    b.r[2 * h + 1] = pack2<T>(f(8 * h + g, 2 * t + 8), f(8 * h + g, 2 * t + 9));
  }
  return b;
}

// The same from f2(row or n, k) giving the pair (k, k + 1) for even k as a float2:
// neighbouring k share one call (half the loads when f reads memory).
template <DType T, class F> __device__ __forceinline__ Frag load_a2(F&& f2) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  Frag a;
  float2 x;
  x = f2(g, 2 * t);         a.r[0] = pack2<T>(x.x, x.y);
  x = f2(g + 8, 2 * t);     a.r[1] = pack2<T>(x.x, x.y);
  x = f2(g, 2 * t + 8);     a.r[2] = pack2<T>(x.x, x.y);
  x = f2(g + 8, 2 * t + 8); a.r[3] = pack2<T>(x.x, x.y);
  return a;
}

template <DType T, class F> __device__ __forceinline__ Frag load_b2(F&& f2) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  Frag b;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float2 x = f2(8 * h + g, 2 * t);
    b.r[2 * h] = pack2<T>(x.x, x.y);
    x = f2(8 * h + g, 2 * t + 8);
    b.r[2 * h + 1] = pack2<T>(x.x, x.y);
  }
  return b;
}

// Straight from 16-bit shared memory: A[row][k] at p[row * ld + k], B[k][n] at
// p[n * ld + k] (k contiguous). ld must be even; each register is one 32-bit load.
__device__ __forceinline__ Frag load_a_smem(const uint16_t* p, int ld) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  Frag a;
  a.r[0] = *reinterpret_cast<const uint32_t*>(p + g * ld + 2 * t);
  a.r[1] = *reinterpret_cast<const uint32_t*>(p + (g + 8) * ld + 2 * t);
  a.r[2] = *reinterpret_cast<const uint32_t*>(p + g * ld + 2 * t + 8);
  a.r[3] = *reinterpret_cast<const uint32_t*>(p + (g + 8) * ld + 2 * t + 8);
  return a;
}

__device__ __forceinline__ Frag load_b_smem(const uint16_t* p, int ld) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  Frag b;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    b.r[2 * h] = *reinterpret_cast<const uint32_t*>(p + (8 * h + g) * ld + 2 * t);
    b.r[2 * h + 1] = *reinterpret_cast<const uint32_t*>(p + (8 * h + g) * ld + 2 * t + 8);
  }
  return b;
}

// -x for every element (16-bit floats: flip the sign bits; exact).
__device__ __forceinline__ Frag neg(Frag f) {
#pragma unroll
  for (int i = 0; i < 4; ++i) f.r[i] ^= 0x80008000u;
  return f;
}

// The accumulator layout of m16n8 is the A layout of m16n8k16: no data moves.
template <DType T> __device__ __forceinline__ Frag to_a(const Acc& c) {
  Frag a;
  a.r[0] = pack2<T>(c.v[0], c.v[1]);
  a.r[1] = pack2<T>(c.v[2], c.v[3]);
  a.r[2] = pack2<T>(c.v[4], c.v[5]);
  a.r[3] = pack2<T>(c.v[6], c.v[7]);
  return a;
}

template <DType T> __device__ __forceinline__ void mma(Acc& d, const Frag& a, const Frag& b) {
#if defined(KDAGEN_EMULATE)
  for (int h = 0; h < 2; ++h)
    kdagen_emu::mma16816(&d.v[4 * h], a.r, b.r[2 * h], b.r[2 * h + 1], T == DType::kBF16);
#else
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (T == DType::kBF16) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
          "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(d.v[4 * h]), "+f"(d.v[4 * h + 1]), "+f"(d.v[4 * h + 2]), "+f"(d.v[4 * h + 3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[2 * h]),
            "r"(b.r[2 * h + 1]));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
          "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(d.v[4 * h]), "+f"(d.v[4 * h + 1]), "+f"(d.v[4 * h + 2]), "+f"(d.v[4 * h + 3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[2 * h]),
            "r"(b.r[2 * h + 1]));
    }
  }
#endif
}

}  // namespace mma
}  // namespace kdagen
