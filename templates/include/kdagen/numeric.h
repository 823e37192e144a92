// kdagen: io element types, conversions and the scalar maths every kernel shares.
#pragma once

#include "platform.h"

namespace kdagen {

enum class DType { kBF16, kFP16, kFP32 };

template <DType T> struct IoType { using type = uint16_t; };
template <> struct IoType<DType::kFP32> { using type = float; };
template <DType T> using io_t = typename IoType<T>::type;

__device__ __forceinline__ float bf16_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// Round to nearest even; NaN stays NaN.
__device__ __forceinline__ uint16_t float_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

__device__ __forceinline__ float fp16_to_float(uint16_t h) {
#if KDAGEN_NVIDIA
  return __half2float(__ushort_as_half(h));
#else
  return static_cast<float>(__builtin_bit_cast(_Float16, h));
#endif
}

__device__ __forceinline__ uint16_t float_to_fp16(float f) {
#if KDAGEN_NVIDIA
  return __half_as_ushort(__float2half_rn(f));
#else
  return __builtin_bit_cast(uint16_t, static_cast<_Float16>(f));
#endif
}

template <DType T> __device__ __forceinline__ float to_float(io_t<T> x) {
  if constexpr (T == DType::kBF16) return bf16_to_float(x);
  else if constexpr (T == DType::kFP16) return fp16_to_float(x);
  else return x;
}

template <DType T> __device__ __forceinline__ io_t<T> from_float(float x) {
  if constexpr (T == DType::kBF16) return float_to_bf16(x);
  else if constexpr (T == DType::kFP16) return float_to_fp16(x);
  else return x;
}

// Two floats -> two 16-bit values in one 32-bit word (round to nearest even; one
// instruction on NVIDIA).
template <DType T> __device__ __forceinline__ uint32_t pack2_io(float lo, float hi) {
  static_assert(T != DType::kFP32, "16-bit values only");
#if KDAGEN_NVIDIA
  if constexpr (T == DType::kBF16) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&p);
  } else {
    const __half2 p = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&p);
  }
#else
  return static_cast<uint32_t>(from_float<T>(lo)) | (static_cast<uint32_t>(from_float<T>(hi)) << 16);
#endif
}

// Eight floats -> eight 16-bit values in one 16-byte word (for vector stores).
template <DType T> __device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
  return make_uint4(pack2_io<T>(v[0], v[1]), pack2_io<T>(v[2], v[3]), pack2_io<T>(v[4], v[5]),
                    pack2_io<T>(v[6], v[7]));
}

// One 16-byte store to global memory. nvcc splits a plain uint4 store of freshly packed
// values into four 32-bit stores (four times the L2 sectors of a warp's row pieces);
// __stwb keeps it one st.global.v4.
__device__ __forceinline__ void store16(void* p, uint4 v) {
#if KDAGEN_NVIDIA && !defined(KDAGEN_EMULATE)
  __stwb(reinterpret_cast<uint4*>(p), v);
#else
  *reinterpret_cast<uint4*>(p) = v;
#endif
}

// ... and back: eight 16-bit values of one 16-byte word as floats.
template <DType T> __device__ __forceinline__ void unpack8(uint4 w, float (&v)[8]) {
  static_assert(T != DType::kFP32, "16-bit values only");
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 8; ++j)
    v[j] = to_float<T>(static_cast<uint16_t>(j % 2 ? words[j / 2] >> 16 : words[j / 2] & 0xffffu));
}

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// softplus(x) = log(1 + e^x), and x itself past 20 (as in FLA and the DESIGN), as
// max(x, 0) + log(1 + e^-|x|) with the fast log: its absolute error (2^-21.4 on [1, 2])
// is what reaches the cumulative gate, a few 1e-7 per step; log1pf costs 3x the instructions.
__device__ __forceinline__ float softplus(float x) {
  return x > 20.0f ? x : fmaxf(x, 0.0f) + __logf(1.0f + __expf(-fabsf(x)));
}

// The per-channel gate in log2 units: g / ln 2, with x = raw_g + dt_bias.
//   softplus form:    g = -exp(A_log) * softplus(x)
//   lower-bound form: g = lower_bound * sigmoid(exp(A_log) * x)
template <bool kLowerBound>
__device__ __forceinline__ float gate_log2(float x, float a_exp, float lower_bound) {
  if constexpr (kLowerBound) return lower_bound * sigmoid(a_exp * x) * kLog2e;
  else return -a_exp * softplus(x) * kLog2e;
}

__device__ __forceinline__ float rnorm(float sum_sq) { return rsqrtf(sum_sq + 1e-6f); }

// Element (r, c) of a 16-bit LDS tile as the matrix loads and stores address it: rows ld
// elements apart from p (the vendor layers' (p, ld) forms).
template <class E> struct Rows {
  E* p;
  int ld;
  __device__ __forceinline__ E* operator()(int r, int c) const { return p + r * ld + c; }
};

// Index of element (r, c) of an unpadded 16-bit LDS tile W columns wide whose 16-byte
// pieces are swizzled by row: piece q of row r is stored as piece q ^ key(r), key running
// over the rows that share one 128-byte run of banks. The eight rows a matrix load or
// store reads at one piece, and a 128-byte run of 16-byte copies, then fall in the eight
// 16-byte bank groups, without padding the rows. A piece stays whole: any access inside
// one (16 bytes, 16-byte aligned) is unchanged by it.
template <int W> __host__ __device__ __forceinline__ constexpr int swizzled(int r, int c) {
  constexpr unsigned P = W / 8;  // pieces per row
  static_assert(W % 8 == 0 && P >= 2 && (P & (P - 1)) == 0, "swizzled rows are 2^n 16-byte pieces");
  constexpr unsigned RUN = P >= 8 ? 1 : 8 / P, KEYS = P >= 8 ? 8 : P;  // rows per 128 bytes, keys
  const unsigned key = (static_cast<unsigned>(r) / RUN) % KEYS;
  return r * W + static_cast<int>(((static_cast<unsigned>(c) >> 3) ^ key) << 3) + (c & 7);
}

// Index of element (r, c) of an LDS tile W columns wide: rows padded to LD, or (kSwz)
// unpadded with their 16-byte pieces swizzled.
template <int W, int LD, bool kSwz>
__device__ __forceinline__ int lds_index(int r, int c) {
  if constexpr (kSwz) return swizzled<W>(r, c);
  else return r * LD + c;
}

// Element (r, c) of the 16 x 16 block at (r0, c0) of such a tile at p: the accessor the
// vendor layer's *_at loads and stores take.
template <int W, int LD, bool kSwz, class E>
struct TileAt {
  E* p;
  int r0, c0;
  __device__ __forceinline__ E* operator()(int r, int c) const {
    if constexpr (kSwz) return p + swizzled<W>(r0 + r, c0 + c);
    else return Rows<E>{p + r0 * LD + c0, LD}(r, c);  // (the block's origin first, as before)
  }
};

}  // namespace kdagen
