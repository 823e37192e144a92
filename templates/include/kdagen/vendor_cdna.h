// kdagen vendor layer, AMD CDNA (wave of 64, MFMA 16x16x16).
//
// Same interface as vendor_cuda.h. MFMA's accumulator layout is its B layout,
// not its A layout, so a logical D = A * B is issued as D^T = B^T * A^T: the
// hardware A operand is our B tile and the hardware B operand our A tile. Then a
// logical accumulator lane holds (row = l % 16, col = 4 * (l / 16) + j), which is
// exactly the logical A layout (row = l % 16, k = 4 * (l / 16) + j): `to_a` moves
// no data, on either vendor.
#pragma once

#include "numeric.h"

namespace kdagen {

constexpr int kWaveSize = 64;

// Occupancy hint: `threads` per block and at least `blocks` resident per CU. HIP's
// second argument counts waves per SIMD (4 SIMDs per CU).
#define KDAGEN_LAUNCH_BOUNDS(threads, blocks) \
  __launch_bounds__((threads), ((blocks) * (threads) / 64 + 3) / 4)

__device__ __forceinline__ int lane_id() { return threadIdx.x & 63; }
__device__ __forceinline__ int wave_id() { return threadIdx.x >> 6; }

// Sum over aligned groups of kWidth neighbouring lanes (kWidth a power of two <= the wave).
template <int kWidth> __device__ __forceinline__ float lane_group_sum(float x) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) x += __shfl_xor(x, o);
  return x;
}

__device__ __forceinline__ float wave_sum(float x) { return lane_group_sum<kWaveSize>(x); }

__device__ __forceinline__ float wave_max(float x) {
#pragma unroll
  for (int o = 32; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor(x, o));
  return x;
}

// 2^x in one instruction (v_exp_f32: 1 ulp); exp2f adds a range check and a rescale to
// keep subnormal results, which no kdagen factor needs (see vendor_cuda.h).
__device__ __forceinline__ float exp2_fast(float x) {
#if defined(KDAGEN_EMULATE)
  return kdagen_emu::exp2_ftz(x);
#else
  float y;
  asm("v_exp_f32 %0, %1" : "=v"(y) : "v"(x));
  return y;
#endif
}

// log2(x) in one instruction (v_log_f32), for arguments in [1, 2] (the softplus gate's).
__device__ __forceinline__ float log2_fast(float x) {
#if defined(KDAGEN_EMULATE)
  return kdagen_emu::log2_approx(x);
#else
  float y;
  asm("v_log_f32 %0, %1" : "=v"(y) : "v"(x));
  return y;
#endif
}

// Order this lane's LDS writes before the other lanes' reads that follow (a wave runs in
// lockstep; the fences keep the compiler from moving LDS accesses across).
__device__ __forceinline__ void wave_sync() {
#if defined(KDAGEN_EMULATE)
  kdagen_emu::wave_barrier();
#else
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#endif
}

// CDNA has no 16-byte asynchronous global -> LDS copy before gfx950: `copy16` is a
// plain load and store (the kernels pick one stage on these targets).
namespace async {
constexpr bool kHardware = false;
__device__ __forceinline__ void copy16(void* smem, const void* gmem, bool pred) {
  *reinterpret_cast<uint4*>(smem) = pred ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
}
__device__ __forceinline__ void commit() {}
template <int N> __device__ __forceinline__ void wait() {}
}  // namespace async

namespace mma {

typedef float f32x4 __attribute__((ext_vector_type(4)));
typedef short i16x4 __attribute__((ext_vector_type(4)));
typedef _Float16 f16x4 __attribute__((ext_vector_type(4)));

struct Acc { f32x4 v; };
struct Frag { i16x4 x; };

__device__ __forceinline__ void zero(Acc& c) { c.v = f32x4{0.0f, 0.0f, 0.0f, 0.0f}; }

__device__ __forceinline__ void add(Acc& d, const Acc& s) { d.v += s.v; }

template <class F> __device__ __forceinline__ void for_each(Acc& c, F&& f) {
  const int r = lane_id() & 15, q = lane_id() >> 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float x = c.v[j];
    f(r, 4 * q + j, x);
    c.v[j] = x;
  }
}

// kStateRows false: no store_rows_f32 / load_rows_f32 here (declared only, for the walks'
// `if constexpr` branch that uses them on NVIDIA); the walks move state planes element by
// element. A 16-byte form - a lane's four values are one row's four neighbouring columns -
// took 6 more VGPRs at c16 on gfx90a (pass two 126 -> 132, past the 128 that keeps two
// 8-wave blocks per CU), and an element-wise one beside the walk's own loop 2-6 more; untimed.
constexpr bool kStateRows = false;
__device__ void store_rows_f32(const Acc& c, float* p, int ld, float s);
__device__ void load_rows_f32(Acc& c, const float* p, int ld, float s);

template <DType T> __device__ __forceinline__ short pack1(float x) {
  static_assert(T != DType::kFP32, "matrix operands are 16-bit");
  return static_cast<short>(from_float<T>(x));
}

// A[row][k] with row = l % 16, k = 4 * (l / 16) + j.
template <DType T, class F> __device__ __forceinline__ Frag load_a(F&& f) {
  const int r = lane_id() & 15, q = lane_id() >> 4;
  Frag a;
#pragma unroll
  for (int j = 0; j < 4; ++j) a.x[j] = pack1<T>(f(r, 4 * q + j));
  return a;
}

// B[k][n] from f(n, k), with n = l % 16, k = 4 * (l / 16) + j (the hardware A layout).
template <DType T, class F> __device__ __forceinline__ Frag load_b(F&& f) {
  const int n = lane_id() & 15, q = lane_id() >> 4;
  Frag b;
#pragma unroll
  for (int j = 0; j < 4; ++j) b.x[j] = pack1<T>(f(n, 4 * q + j));
  return b;
}

// The same from f2(row or n, k) giving the pair (k, k + 1) for even k as a float2.
template <DType T, class F> __device__ __forceinline__ Frag load_a2(F&& f2) {
  const int r = lane_id() & 15, q = lane_id() >> 4;
  Frag a;
#pragma unroll
  for (int j = 0; j < 4; j += 2) {
    const float2 x = f2(r, 4 * q + j);
    a.x[j] = pack1<T>(x.x);
    a.x[j + 1] = pack1<T>(x.y);
  }
  return a;
}

template <DType T, class F> __device__ __forceinline__ Frag load_b2(F&& f2) { return load_a2<T>(f2); }

// Straight from 16-bit LDS: A[row][k] at at(row, k), B[k][n] at at(n, k); the four k of
// a lane are contiguous: one 64-bit load (8-byte aligned). The (p, ld) forms take rows
// ld apart (Rows, ld a multiple of 4); an accessor may place a row's 16-byte pieces
// anywhere (swizzled tiles), as long as each piece stays whole.
template <class At> __device__ __forceinline__ Frag load_a_smem_at(At at) {
  Frag a;
  a.x = *reinterpret_cast<const i16x4*>(at(lane_id() & 15, 4 * (lane_id() >> 4)));
  return a;
}
template <class At> __device__ __forceinline__ Frag load_b_smem_at(At at) { return load_a_smem_at(at); }

// B[k][n] at at(k, n) (n contiguous): the lane's four k are four rows.
template <class At> __device__ __forceinline__ Frag load_b_smem_kn_at(At at) {
  const int n = lane_id() & 15, q = lane_id() >> 4;
  Frag b;
#pragma unroll
  for (int j = 0; j < 4; ++j) b.x[j] = static_cast<short>(*at(4 * q + j, n));
  return b;
}

// A[row][k] at at(k, row) (stored transposed): the lane's four k are four rows.
template <class At> __device__ __forceinline__ Frag load_a_smem_t_at(At at) { return load_b_smem_kn_at(at); }

__device__ __forceinline__ Frag load_a_smem(const uint16_t* p, int ld) { return load_a_smem_at(Rows<const uint16_t>{p, ld}); }
__device__ __forceinline__ Frag load_b_smem(const uint16_t* p, int ld) { return load_b_smem_at(Rows<const uint16_t>{p, ld}); }
__device__ __forceinline__ Frag load_b_smem_kn(const uint16_t* p, int ld) {
  return load_b_smem_kn_at(Rows<const uint16_t>{p, ld});
}

// B operand element (k, n) times s[k] (fp32, one rounding): this lane's k are 4q .. 4q + 3.
template <DType T> __device__ __forceinline__ void scale_k(Frag& b, const float* s) {
  const float4 f = *reinterpret_cast<const float4*>(s + 4 * (lane_id() >> 4));
  const float fs[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
  for (int j = 0; j < 4; ++j)
    b.x[j] = pack1<T>(to_float<T>(static_cast<uint16_t>(b.x[j])) * fs[j]);
}

// The accumulator, rounded to T, into 16-bit LDS at p[row * ld + col]: a lane's four
// neighbouring columns as one 64-bit store (ld a multiple of 4).
template <DType T> __device__ __forceinline__ void store_tile(const Acc& c, uint16_t* p, int ld) {
  i16x4 x;
#pragma unroll
  for (int j = 0; j < 4; ++j) x[j] = pack1<T>(c.v[j]);
  *reinterpret_cast<i16x4*>(p + (lane_id() & 15) * ld + 4 * (lane_id() >> 4)) = x;
}

// The tile transposed, through 16-bit LDS at at(col, row): store_tile_t_at rounds the
// accumulator to T, load_tile_t_at widens it back (element by element here).
template <DType T, class At> __device__ __forceinline__ void store_tile_t_at(Acc& c, At at) {
  for_each(c, [&](int r, int col, float& x) { *at(col, r) = pack1<T>(x); });
}
template <DType T, class At> __device__ __forceinline__ void load_tile_t_at(Acc& c, At at) {
  for_each(c, [&](int r, int col, float& x) { x = to_float<T>(*at(col, r)); });
}

// -x for every element (16-bit floats: flip the sign bits; exact).
__device__ __forceinline__ Frag neg(Frag f) {
  f.x ^= static_cast<short>(0x8000);
  return f;
}

template <DType T> __device__ __forceinline__ Frag to_a(const Acc& c) {
  Frag a;
#pragma unroll
  for (int j = 0; j < 4; ++j) a.x[j] = pack1<T>(c.v[j]);
  return a;
}

template <DType T> __device__ __forceinline__ void mma(Acc& d, const Frag& a, const Frag& b) {
  if constexpr (T == DType::kBF16) {
    d.v = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(b.x, a.x, d.v, 0, 0, 0);
  } else {
    d.v = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(f16x4, b.x),
                                                  __builtin_bit_cast(f16x4, a.x), d.v, 0, 0, 0);
  }
}

}  // namespace mma

// No warpgroup products on CDNA: the chunk scan takes the per-wave matrix path. Declared
// only, so that the warpgroup branch of a kernel (discarded here) still names them.
namespace wg {
constexpr bool kHardware = false;
using Desc = uint64_t;
__device__ int tile_index(int n, int k, int K);
__device__ Desc desc(const uint16_t* tile, int K, int ks);
__device__ void fence();
__device__ void commit();
template <int N> __device__ void wait();
__device__ void fence_async_smem();
template <int N> __device__ void fence_operands(mma::Acc (&d)[N]);
__device__ void fence_operands(mma::Frag& a);
template <int N, DType T, bool kNegA = false> __device__ void mma(mma::Acc (&d)[N / 16], const mma::Frag& a, Desc b);
}  // namespace wg
}  // namespace kdagen
