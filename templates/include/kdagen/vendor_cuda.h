// kdagen vendor layer, NVIDIA (warp of 32, mma.sync m16n8k16).
//
// The kernels see one interface on every vendor: a 16x16 fp32 accumulator tile
// `Acc`, 16-bit operand tiles `Frag`, and
//   load_a(f)  A operand, f(row, k) gives A[row][k]
//   load_b(f)  B operand, f(n, k)   gives B[k][n]   (k runs along memory rows)
//   to_a(acc)  reuse an accumulator (row, col) as an A operand (row, k = col)
//   mma(d,a,b) d += a * b
//   add(d, s)  d += s (accumulators)
//   for_each(acc, f) visits this lane's (row, col, value&)
//   load_a2(f2) / load_b2(f2)  the same, f2 giving two neighbouring k as a float2
//   load_a_smem / load_b_smem  the same operands read straight from 16-bit LDS
//   load_b_smem_kn  B[k][n] from 16-bit LDS stored with n contiguous (k along rows)
//     (each also as *_at(at): at(r, c) addresses element (r, c) of the stored tile, for
//     tiles not laid out as rows ld apart: the chunk scan's swizzled ones)
//   load_a_smem_t_at(at)  A[row][k] from 16-bit LDS stored transposed, at(k, row)
//   store_tile_t_at / load_tile_t_at(acc, at)  the accumulator transposed through 16-bit
//              LDS, at(col, row)
//   scale_k(frag, s)  every element of a B operand times s[k] (fp32, one rounding)
//   store_tile(acc, p, ld)  the accumulator rounded to 16 bits into LDS, p[row * ld + col]
//   neg(frag)  the operand negated
//   store_rows_f32 / load_rows_f32(acc, p, ld, s)  the tile times s to / from fp32 rows in
//              global memory in whole sectors (p, ld 8-byte aligned; kStateRows: the walks use them)
// Here a 16x16 tile is two m16n8 halves; lane = 4 * g + t.
#pragma once

#include "numeric.h"

namespace kdagen {

constexpr int kWaveSize = 32;

// Occupancy hint: `threads` per block and at least `blocks` resident per SM.
#define KDAGEN_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__((threads), (blocks))

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int wave_id() { return threadIdx.x >> 5; }

// Sum over aligned groups of kWidth neighbouring lanes (kWidth a power of two <= the wave).
template <int kWidth> __device__ __forceinline__ float lane_group_sum(float x) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float wave_sum(float x) { return lane_group_sum<kWaveSize>(x); }

__device__ __forceinline__ float wave_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ void wave_sync() { __syncwarp(); }

// A barrier of kThreads threads (whole warps) of the block, on hardware barrier kId (1 to
// 15; 0 is __syncthreads'): the warps of one job in a block whose warps do different jobs
// (prologue_chunk on a group of a kernel's warps). Like __syncthreads it orders the
// participants' shared and global memory accesses.
template <int kId, int kThreads>
struct NamedBarrier {
  static_assert(kId > 0 && kId < 16, "bar.sync ids 1 to 15 (0 is __syncthreads')");
  static_assert(kThreads > 0 && kThreads % 32 == 0, "a named barrier counts whole warps");
  __device__ __forceinline__ void operator()() const {
#if defined(KDAGEN_EMULATE)
    kdagen_emu::named_barrier(kId, kThreads);
#else
    asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
#endif
  }
};

// 2^x in one instruction (ex2.approx.ftz: 2^-22 relative error, results below 2^-126
// flush to zero). exp2f adds a range check and two rescales to keep those subnormals;
// no kdagen factor needs them (they multiply values <= 1 and end in 16-bit operands).
__device__ __forceinline__ float exp2_fast(float x) {
#if defined(KDAGEN_EMULATE)
  return kdagen_emu::exp2_ftz(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// log2(x) in one instruction (lg2.approx: absolute error about 2^-22 on [1, 2]), for
// arguments in [1, 2] (the softplus gate's), where flushing subnormals changes nothing.
__device__ __forceinline__ float log2_fast(float x) {
#if defined(KDAGEN_EMULATE)
  return kdagen_emu::log2_approx(x);
#else
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

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
  return pack2_io<T>(lo, hi);
}

__device__ __forceinline__ void zero(Acc& c) {
#pragma unroll
  for (int i = 0; i < 8; ++i) c.v[i] = 0.0f;
}

// d += s, element by element.
__device__ __forceinline__ void add(Acc& d, const Acc& s) {
#pragma unroll
  for (int i = 0; i < 8; ++i) d.v[i] += s.v[i];
}

// v[4h + e]: row g + 8 * (e >> 1), col 8h + 2t + (e & 1).
template <class F> __device__ __forceinline__ void for_each(Acc& c, F&& f) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
  for (int i = 0; i < 8; ++i) f(g + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * t + (i & 1), c.v[i]);
}

// The tile times s to / from fp32 rows in global memory, p[row * ld + col] (p and ld
// keeping 8-byte alignment): for_each's pairs of neighbouring columns as 8-byte pieces,
// the four lanes of a row group one whole 32-byte sector - half the memory instructions
// of for_each, none of its half-sector accesses.
constexpr bool kStateRows = true;  // the walks move 16-byte aligned state planes with these
__device__ __forceinline__ void rows_aligned(const float* p) {
#if defined(KDAGEN_EMULATE)
  kdagen_emu::require_aligned(p, 8, "fp32 rows");
#else
  (void)p;
#endif
}
__device__ __forceinline__ void store_rows_f32(const Acc& c, float* p, int ld, float s) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  rows_aligned(p);
#pragma unroll
  for (int i = 0; i < 8; i += 2)
    *reinterpret_cast<float2*>(p + (g + 8 * ((i >> 1) & 1)) * ld + 8 * (i >> 2) + 2 * t) =
        make_float2(s * c.v[i], s * c.v[i + 1]);
}
__device__ __forceinline__ void load_rows_f32(Acc& c, const float* p, int ld, float s) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  rows_aligned(p);
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    const float2 x = *reinterpret_cast<const float2*>(p + (g + 8 * ((i >> 1) & 1)) * ld + 8 * (i >> 2) + 2 * t);
    c.v[i] = s * x.x, c.v[i + 1] = s * x.y;
  }
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

// Straight from 16-bit shared memory: A[row][k] at at(row, k), B[k][n] at at(n, k) (k
// contiguous), B[k][n] at at(k, n) for load_b_smem_kn; the (p, ld) forms take rows ld
// apart (Rows). One ldmatrix.x4 each (rows 16-byte aligned); lane l names row l % 8 of
// the 8x8 matrix l / 8, which lands in register l / 8. An accessor may place the 16-byte
// pieces of a row anywhere (swizzled tiles), as long as each piece stays whole.
template <bool kTrans> __device__ __forceinline__ Frag ldmatrix_x4(const uint16_t* row) {
  Frag f;
#if defined(KDAGEN_EMULATE)
  kdagen_emu::ldmatrix_x4(f.r, row, kTrans);
#else
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3]) : "r"(s) : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3]) : "r"(s) : "memory");
  }
#endif
  return f;
}
template <class At> __device__ __forceinline__ Frag load_a_smem_at(At at) {
  const int m = lane_id() >> 3, r = lane_id() & 7;  // matrices: rows 0-7 / 8-15 x k 0-7 / 8-15
  return ldmatrix_x4<false>(at(r + 8 * (m & 1), 8 * (m >> 1)));
}
template <class At> __device__ __forceinline__ Frag load_b_smem_at(At at) {
  const int m = lane_id() >> 3, r = lane_id() & 7;  // matrices: n 0-7 x k 0-7, k 8-15; n 8-15 ...
  return ldmatrix_x4<false>(at(r + 8 * (m >> 1), 8 * (m & 1)));
}
template <class At> __device__ __forceinline__ Frag load_b_smem_kn_at(At at) {
  const int m = lane_id() >> 3, r = lane_id() & 7;  // stored rows are k: transposed loads
  return ldmatrix_x4<true>(at(r + 8 * (m & 1), 8 * (m >> 1)));
}
__device__ __forceinline__ Frag load_a_smem(const uint16_t* p, int ld) { return load_a_smem_at(Rows<const uint16_t>{p, ld}); }
__device__ __forceinline__ Frag load_b_smem(const uint16_t* p, int ld) { return load_b_smem_at(Rows<const uint16_t>{p, ld}); }
__device__ __forceinline__ Frag load_b_smem_kn(const uint16_t* p, int ld) {
  return load_b_smem_kn_at(Rows<const uint16_t>{p, ld});
}

// B operand element (k, n) times s[k]: this lane's k are 2t, 2t + 1 (registers 0, 2) and
// 2t + 8, 2t + 9 (registers 1, 3).
template <DType T> __device__ __forceinline__ void scale_k(Frag& b, const float* s) {
  const int t = lane_id() & 3;
  const float2 lo = *reinterpret_cast<const float2*>(s + 2 * t);
  const float2 hi = *reinterpret_cast<const float2*>(s + 2 * t + 8);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = i & 1 ? hi : lo;
    const float x0 = to_float<T>(static_cast<uint16_t>(b.r[i] & 0xffffu));
    const float x1 = to_float<T>(static_cast<uint16_t>(b.r[i] >> 16));
    b.r[i] = pack2<T>(x0 * f.x, x1 * f.y);
  }
}

// The accumulator, rounded to T, into 16-bit LDS at p[row * ld + col]: neighbouring
// columns of a lane as one 32-bit store.
template <DType T> __device__ __forceinline__ void store_tile(const Acc& c, uint16_t* p, int ld) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    *reinterpret_cast<uint32_t*>(p + g * ld + 8 * h + 2 * t) = pack2<T>(c.v[4 * h], c.v[4 * h + 1]);
    *reinterpret_cast<uint32_t*>(p + (g + 8) * ld + 8 * h + 2 * t) = pack2<T>(c.v[4 * h + 2], c.v[4 * h + 3]);
  }
}

// The tile transposed, through 16-bit LDS at at(col, row) (rows 16-byte aligned):
// store_tile_t_at rounds the accumulator to T, load_tile_t_at widens it back. One
// stmatrix / ldmatrix .x4.trans: register i holds quadrant (rows 8 (i & 1), columns
// 8 (i >> 1)), whose transposed rows lanes 8i .. 8i + 7 address.
template <class At> __device__ __forceinline__ auto tile_t_row(At at) {
  const int i = lane_id() >> 3, j = lane_id() & 7;
  return at(8 * (i >> 1) + j, 8 * (i & 1));
}
template <DType T, class At> __device__ __forceinline__ void store_tile_t_at(Acc& c, At at) {
  const uint32_t r[4] = {pack2<T>(c.v[0], c.v[1]), pack2<T>(c.v[2], c.v[3]), pack2<T>(c.v[4], c.v[5]),
                         pack2<T>(c.v[6], c.v[7])};
#if defined(KDAGEN_EMULATE)
  kdagen_emu::stmatrix_x4_trans(tile_t_row(at), r);
#else
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(tile_t_row(at)));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n"
               ::"r"(s), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
#endif
}
// The A operand A[row][k] = at(k, row): the same transposed load, its registers already
// in the A layout (register i: rows 8 (i & 1), k 8 (i >> 1)).
template <class At> __device__ __forceinline__ Frag load_a_smem_t_at(At at) {
  return ldmatrix_x4<true>(tile_t_row(at));
}
template <DType T, class At> __device__ __forceinline__ void load_tile_t_at(Acc& c, At at) {
  const Frag f = ldmatrix_x4<true>(tile_t_row(at));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    c.v[2 * i] = to_float<T>(static_cast<uint16_t>(f.r[i] & 0xffffu));
    c.v[2 * i + 1] = to_float<T>(static_cast<uint16_t>(f.r[i] >> 16));
  }
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

// Warpgroup products (wgmma, sm_90a): the four warps of a warpgroup (warps 4 w .. 4 w + 3)
// multiply a 64-row A held in their registers (warp i: rows 16 i .. 16 i + 15, each in the
// mma.sync A layout: a `Frag`) by a B that the tensor cores read from shared memory. The
// accumulator of a warp's 16 rows is the mma.sync layout as well: N / 16 `Acc` tiles in
// column order. Issued asynchronously: `fence` before a product whose registers were just
// written, `commit` closes a group of products, `wait<N>` returns once at most N groups are
// in flight; `fence_operands` keeps the compiler from moving register accesses across them.
//
// B tiles in shared memory use the canonical K-major layout without swizzle (PTX ISA,
// "Shared Memory Matrix Layout"): B[k][n] of a tile with n rows and K columns is element
//   ((n / 8) (K / 8) + k / 8) 64 + (n % 8) 8 + k % 8,
// i.e. 8 x 8 core matrices of 128 contiguous bytes (a row of 8 k per 16 bytes), the K / 8
// core matrices of an 8-row group 128 bytes apart (the leading byte offset), the row
// groups 16 K bytes apart (the stride byte offset).
namespace wg {
using mma::Acc;
using mma::Frag;
constexpr bool kHardware = true;

__host__ __device__ constexpr int tile_index(int n, int k, int K) {
  return ((n >> 3) * (K >> 3) + (k >> 3)) * 64 + (n & 7) * 8 + (k & 7);
}

#if defined(KDAGEN_EMULATE)
struct Desc { const uint16_t* tile; int K, ks; };
// The 16-column slice ks of a K-major tile with K columns.
__device__ __forceinline__ Desc desc(const uint16_t* tile, int K, int ks) { return {tile, K, ks}; }
__device__ __forceinline__ void fence() {}
__device__ __forceinline__ void commit() { kdagen_emu::wg_commit(); }
template <int N> __device__ __forceinline__ void wait() { kdagen_emu::wg_wait(N); }
__device__ __forceinline__ void fence_async_smem() {}
template <int N> __device__ __forceinline__ void fence_operands(Acc (&)[N]) {}
__device__ __forceinline__ void fence_operands(Frag&) {}
// d (N / 16 tiles) += a * B, run at the wait that retires it: this warp's 16 rows as
// mma.sync products, B gathered from the tile through the layout above (so a wrong tile
// layout, slice, or a tile overwritten before the wait shows up here too).
template <int N, DType T, bool kNegA = false>
__device__ __forceinline__ void mma(Acc (&d)[N / 16], const Frag& a, Desc b) {
  const Frag x = kNegA ? mma::neg(a) : a;  // the hardware's scale-a of -1
  Acc* acc = d;
  kdagen_emu::wg_issue([acc, x, b] {
    const int g = lane_id() >> 2, t = lane_id() & 3;
    auto two = [&](int n, int k) {
      const uint16_t* p = b.tile + tile_index(n, 16 * b.ks + k, b.K);
      return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 16);
    };
    for (int j = 0; j < N / 8; ++j)
      kdagen_emu::mma16816(&acc[j / 2].v[4 * (j % 2)], x.r, two(8 * j + g, 2 * t), two(8 * j + g, 2 * t + 8),
                           T == DType::kBF16);
  }, &d[0].v[0], 8 * (N / 16));
}
#else
using Desc = uint64_t;
// The 16-column slice ks of a K-major tile with K columns: start address, leading byte
// offset 128, stride byte offset 16 K, no swizzle (each field in 16-byte units).
__device__ __forceinline__ Desc desc(const uint16_t* tile, int K, int ks) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(tile)) + 256u * ks;
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>((16 * K) >> 4) << 32);
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written by the threads (cp.async included) becomes visible to the tensor
// cores' reads (the async proxy): each writer fences, then the block synchronises.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void fence_operands(Acc (&d)[N]) {
#pragma unroll
  for (int t = 0; t < N; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) asm volatile("" : "+f"(d[t].v[e])::"memory");
}
__device__ __forceinline__ void fence_operands(Frag& a) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a.r[i])::"memory");
}
// Mma<N>::run<T, kNegA>: d (N / 16 tiles) += (kNegA ? -a : a) * B, N = 16, 32, 64, 128
// (the chunk and the head dimension); T picks the bf16 or f16 form of one instruction.
template <int N> struct Mma;
template <> struct Mma<16> {
  template <DType T, bool kNegA>
  static __device__ __forceinline__ void run(Acc (&d)[1], const Frag& a, uint64_t desc) {
#define KDAGEN_WGMMA(TY) \
  asm volatile( \
      "wgmma.mma_async.sync.aligned.m64n16k16.f32." TY "." TY " " \
      "{%0,%1,%2,%3,%4,%5,%6,%7}, " \
      "{%8,%9,%10,%11}, %12, 1, %13, 1, 0;\n" \
      : "+f"(d[0].v[0]), "+f"(d[0].v[1]), "+f"(d[0].v[2]), "+f"(d[0].v[3]), "+f"(d[0].v[4]), "+f"(d[0].v[5]), "+f"(d[0].v[6]), "+f"(d[0].v[7]) \
      : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(desc), "n"(kNegA ? -1 : 1) \
      : "memory")
    if constexpr (T == DType::kBF16) KDAGEN_WGMMA("bf16");
    else KDAGEN_WGMMA("f16");
#undef KDAGEN_WGMMA
  }
};
template <> struct Mma<32> {
  template <DType T, bool kNegA>
  static __device__ __forceinline__ void run(Acc (&d)[2], const Frag& a, uint64_t desc) {
#define KDAGEN_WGMMA(TY) \
  asm volatile( \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " " \
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, " \
      "{%16,%17,%18,%19}, %20, 1, %21, 1, 0;\n" \
      : "+f"(d[0].v[0]), "+f"(d[0].v[1]), "+f"(d[0].v[2]), "+f"(d[0].v[3]), "+f"(d[0].v[4]), "+f"(d[0].v[5]), "+f"(d[0].v[6]), "+f"(d[0].v[7]), \
        "+f"(d[1].v[0]), "+f"(d[1].v[1]), "+f"(d[1].v[2]), "+f"(d[1].v[3]), "+f"(d[1].v[4]), "+f"(d[1].v[5]), "+f"(d[1].v[6]), "+f"(d[1].v[7]) \
      : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(desc), "n"(kNegA ? -1 : 1) \
      : "memory")
    if constexpr (T == DType::kBF16) KDAGEN_WGMMA("bf16");
    else KDAGEN_WGMMA("f16");
#undef KDAGEN_WGMMA
  }
};
template <> struct Mma<64> {
  template <DType T, bool kNegA>
  static __device__ __forceinline__ void run(Acc (&d)[4], const Frag& a, uint64_t desc) {
#define KDAGEN_WGMMA(TY) \
  asm volatile( \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " \
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
      "{%32,%33,%34,%35}, %36, 1, %37, 1, 0;\n" \
      : "+f"(d[0].v[0]), "+f"(d[0].v[1]), "+f"(d[0].v[2]), "+f"(d[0].v[3]), "+f"(d[0].v[4]), "+f"(d[0].v[5]), "+f"(d[0].v[6]), "+f"(d[0].v[7]), \
        "+f"(d[1].v[0]), "+f"(d[1].v[1]), "+f"(d[1].v[2]), "+f"(d[1].v[3]), "+f"(d[1].v[4]), "+f"(d[1].v[5]), "+f"(d[1].v[6]), "+f"(d[1].v[7]), \
        "+f"(d[2].v[0]), "+f"(d[2].v[1]), "+f"(d[2].v[2]), "+f"(d[2].v[3]), "+f"(d[2].v[4]), "+f"(d[2].v[5]), "+f"(d[2].v[6]), "+f"(d[2].v[7]), \
        "+f"(d[3].v[0]), "+f"(d[3].v[1]), "+f"(d[3].v[2]), "+f"(d[3].v[3]), "+f"(d[3].v[4]), "+f"(d[3].v[5]), "+f"(d[3].v[6]), "+f"(d[3].v[7]) \
      : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(desc), "n"(kNegA ? -1 : 1) \
      : "memory")
    if constexpr (T == DType::kBF16) KDAGEN_WGMMA("bf16");
    else KDAGEN_WGMMA("f16");
#undef KDAGEN_WGMMA
  }
};
template <> struct Mma<128> {
  template <DType T, bool kNegA>
  static __device__ __forceinline__ void run(Acc (&d)[8], const Frag& a, uint64_t desc) {
#define KDAGEN_WGMMA(TY) \
  asm volatile( \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " \
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, " \
      "{%64,%65,%66,%67}, %68, 1, %69, 1, 0;\n" \
      : "+f"(d[0].v[0]), "+f"(d[0].v[1]), "+f"(d[0].v[2]), "+f"(d[0].v[3]), "+f"(d[0].v[4]), "+f"(d[0].v[5]), "+f"(d[0].v[6]), "+f"(d[0].v[7]), \
        "+f"(d[1].v[0]), "+f"(d[1].v[1]), "+f"(d[1].v[2]), "+f"(d[1].v[3]), "+f"(d[1].v[4]), "+f"(d[1].v[5]), "+f"(d[1].v[6]), "+f"(d[1].v[7]), \
        "+f"(d[2].v[0]), "+f"(d[2].v[1]), "+f"(d[2].v[2]), "+f"(d[2].v[3]), "+f"(d[2].v[4]), "+f"(d[2].v[5]), "+f"(d[2].v[6]), "+f"(d[2].v[7]), \
        "+f"(d[3].v[0]), "+f"(d[3].v[1]), "+f"(d[3].v[2]), "+f"(d[3].v[3]), "+f"(d[3].v[4]), "+f"(d[3].v[5]), "+f"(d[3].v[6]), "+f"(d[3].v[7]), \
        "+f"(d[4].v[0]), "+f"(d[4].v[1]), "+f"(d[4].v[2]), "+f"(d[4].v[3]), "+f"(d[4].v[4]), "+f"(d[4].v[5]), "+f"(d[4].v[6]), "+f"(d[4].v[7]), \
        "+f"(d[5].v[0]), "+f"(d[5].v[1]), "+f"(d[5].v[2]), "+f"(d[5].v[3]), "+f"(d[5].v[4]), "+f"(d[5].v[5]), "+f"(d[5].v[6]), "+f"(d[5].v[7]), \
        "+f"(d[6].v[0]), "+f"(d[6].v[1]), "+f"(d[6].v[2]), "+f"(d[6].v[3]), "+f"(d[6].v[4]), "+f"(d[6].v[5]), "+f"(d[6].v[6]), "+f"(d[6].v[7]), \
        "+f"(d[7].v[0]), "+f"(d[7].v[1]), "+f"(d[7].v[2]), "+f"(d[7].v[3]), "+f"(d[7].v[4]), "+f"(d[7].v[5]), "+f"(d[7].v[6]), "+f"(d[7].v[7]) \
      : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(desc), "n"(kNegA ? -1 : 1) \
      : "memory")
    if constexpr (T == DType::kBF16) KDAGEN_WGMMA("bf16");
    else KDAGEN_WGMMA("f16");
#undef KDAGEN_WGMMA
  }
};
template <int N, DType T, bool kNegA = false>
__device__ __forceinline__ void mma(Acc (&d)[N / 16], const Frag& a, Desc b) {
  Mma<N>::template run<T, kNegA>(d, a, b);
}
#endif
}  // namespace wg
}  // namespace kdagen
