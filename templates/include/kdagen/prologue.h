// kdagen: the chunk prologue. One block per (chunk, head) computes everything the
// chunk scan needs from the raw projections, in one launch:
//
//   q^, k^   L2 norms (applied as per-row factors rq, rk; the raw rows stay in LDS)
//   G        in-chunk cumulative gate, log2 units (exp2 everywhere below: exp2_fast, one
//            instruction that flushes results below 2^-126, except the fp32 decay output)
//   qg       q^ * 2^G                              [T, H, K]
//   kg_t     (k^ * 2^(G_last - G))^T                [chunks, H, K, C], zero past the end
//   decay    2^G_last                              [chunks, H, K] fp32
//   aqk      scale * q^_i . (k^_j * 2^(G_i - G_j)), j <= i    [T, H, C]
//   w, u     (I + L)^-1 (b k^ 2^G),  (I + L)^-1 (b v),
//            L_ij = b_i k^_i . (k^_j * 2^(G_i - G_j)), j < i
//   akk      (I + L)^-1 Diag(b)  [T, H, C], in place of u with kAkk (the chunk scan then
//            forms u = akk v from the raw v: v is not read here)
//
// exp2(G_i - G_j) is never formed as a ratio. Off-diagonal 16x16 blocks (rows of
// block bi, columns of block bj < bi) take the first row r of block bi as
// reference: the factors 2^(G_i - G_r) and 2^(G_r - G_j) are both <= 1, and their
// product goes through the matrix units. Diagonal blocks: with a lower-bounded gate
// (|bound| <= kDiagMmaMaxBound) the block's middle row is the reference, the factors
// stay below 2^92 and the block goes through the matrix units in bf16 (masked entries
// above the diagonal may overflow; they are selected away, never scaled). Otherwise
// (softplus gates, unbounded) a wave per row takes the exact difference per pair.
//
// Planar operands (kPlanar, where LDS allows: sm_90, gfx950): the operands of every L /
// aqk product are built once per element into 16-bit LDS planes, with the first row of
// each 16-row block as reference on the row side and its last row on the column side:
//   Ka_i = k^_i 2^(G_i - G_f(i)),  Qa_i = q^_i 2^(G_i - G_f(i)),  Kb_j = k^_j 2^(G_l(j) - G_j),
// and a block pair (bi, bj) multiplies Kb by the per-channel scale 2^(G_f(bi) - G_l(bj))
// inside its fragments (at chunk 16, one block, P4 writes Kb with the diagonal block's
// scale already in, k^_j 2^(G_f - G_j), where the span lets it use the matrix units). Every factor of an off-diagonal pair is <= 1; a diagonal block
// takes the matrix units when its span G_f - G_l stays within kDiagSpan (else the exact
// per-pair path below). w and u come from (I + L)^-1 in bf16 times b k^ 2^G and b v
// (ldmatrix-transposed operands), staged through LDS for 16-byte stores like aqk.
//
// Elsewhere (64 KB CDNA LDS): fragments built element by element from the k / G planes;
// the solve for w and u (kMmaSolve: where the G plane holds the bf16 inverse beside L, or
// the q plane takes it) on the matrix units, b v taken from the q plane, or staged into
// the k plane once the w products are done; else forward substitution in fp32, one
// thread per column.
//
// Loads: every global read of the chunk (k, q, the raw gate, beta) is issued in phase 1
// as 16-byte loads; the cumulative gate is a column scan in LDS.
//
// LDS plan (C x D): G fp32 [C][D + pad] (reused for L, and for (I + L)^-1 in bf16, once
// G is dead), k in the io dtype [C][D + pad] (overwritten in place by the solve's
// right-hand side), q where LDS allows (then v, for the matrix-unit solve), [the planar
// operand planes Ka, Kb (later the staged w, u)], three fp32 row vectors rk, rq, beta
// [, and the planar path's per-block vectors 2^G_f, pair scales, the kg_t factors
// 2^(G_last - G_l), diagonal choices]. The 16-bit planes' rows are padded by kPad16; on
// the planar path with Cfg::kPrologueSwizzle the k and q planes' rows (and what later
// takes their place) are unpadded instead, their 16-byte pieces swizzled by row
// (PrologueLayout::kidx, which each of their readers and writers goes through).
#pragma once

#include "launch_args.h"

namespace kdagen {

template <class Cfg>
struct PrologueLayout {
  static constexpr int C = Cfg::kChunk, D = Cfg::kHeadDim, NB = C / 16;
  static constexpr int LDG = D + Cfg::kPadFp32;  // G plane row stride (floats)
  static constexpr int LDL = C + Cfg::kPadFp32;  // L plane row stride (floats), inside G's space
  // The k and q planes (filled by 16-byte copies): rows padded by kPad16, or (kSwz, planar
  // only) unpadded with their 16-byte pieces swizzled by row (swizzled<D>); kidx places
  // element (i, d). The operand planes Ka, Kb keep padded rows (LDP) either way.
  static constexpr bool kSwz = Cfg::kPrologueSwizzle && Cfg::kPlanar;
  static constexpr int LDK = D + (kSwz ? 0 : Cfg::kPad16);  // k / q plane row stride (elements)
  static constexpr int LDP = D + Cfg::kPad16;               // Ka / Kb plane row stride
  static __device__ __forceinline__ int kidx(int i, int d) { return lds_index<D, LDK, kSwz>(i, d); }
  static constexpr int LDA = C + Cfg::kPad16;    // (I + L)^-1 in bf16 [C][LDA], after L
  static constexpr bool kPlanar = Cfg::kPlanar;
  static constexpr int kPairs = NB * (NB - 1) / 2;  // off-diagonal block pairs
  static constexpr int kScales = kPairs + NB;       // planar pair scales: off-diagonal, diagonal
  // 16-bit planes: k [, q] [, Ka, Kb], and their elements
  static constexpr int kPlanes = kPlanar ? 4 : (Cfg::kStageQ ? 2 : 1);
  static constexpr int kPlaneElems = kPlanar ? 2 * C * LDK + 2 * C * LDP : kPlanes * C * LDK;
  static constexpr int kVecBytes = 3 * C * 4 + (kPlanar ? 2 * NB * D * 4 + kScales * D * 4 + 16 : 0);
  static constexpr int kBytes =
      C * LDG * 4 + kPlaneElems * static_cast<int>(sizeof(io_t<Cfg::kIo>)) + kVecBytes;
  // The solve runs on the matrix units when (I + L)^-1 in bf16 has a place: beside L in
  // the G plane, else in the (dead) q plane. b v goes to the q plane when that is free,
  // else to the k plane once the w products are done. Otherwise a forward substitution
  // per column.
  static constexpr bool kInverseInG = C * LDL * 4 + C * LDA * 2 <= C * LDG * 4;
  static constexpr bool kInverseInQ =
      !kInverseInG && Cfg::kStageQ && C * LDA * 2 <= C * LDK * static_cast<int>(sizeof(io_t<Cfg::kIo>));
  static constexpr bool kMmaSolve = kInverseInG || kInverseInQ;
  static constexpr bool kVInQ = Cfg::kStageQ && kInverseInG;  // else v into the k plane
  static_assert(C * LDL <= C * LDG, "the L plane must fit in the G plane");
  static_assert(LDL % 4 == 0, "L rows are read as float4");
  static_assert(!kPlanar || (kInverseInG && NB <= Cfg::kPrologueThreads / kWaveSize),
                "the planar path solves on the matrix units, one wave per diagonal block check");
  static_assert(kBytes == Cfg::kPrologueBytes, "the LDS plan differs from kdagen/resources.py");
};

// Tag of the staging helper's asynchronous form.
template <bool B> struct AsyncTag { static constexpr bool value = B; };

// Planar path: the largest span G_f - G_l (log2 units) of a diagonal block that goes
// through the matrix units. Its column operand reaches 2^span (times |k^| <= 1) and the
// rounding floor of the stored Kb (bf16 subnormals: 2^-133) becomes 2^(span - 133) after
// the rescale: 110 keeps that below 2^-23 and covers a lower bound of -5 held for all 15
// steps of a block (span 108); fp16 (max 2^16, floor 2^-24) allows 8.
template <DType Mx> constexpr float kDiagSpan = Mx == DType::kBF16 ? 110.0f : 8.0f;

// softplus in log2 units: log2(1 + 2^y) = max(y, 0) + log2(1 + 2^-|y|), one exp2 and one
// log2 instruction (log2_fast's argument lies in [1, 2]). It equals softplus(x) log2(e) for
// y = x log2(e), FLA's threshold included: past x = 20, 1 + 2^-28.9 rounds to 1 in fp32,
// so the result is y itself.
__device__ __forceinline__ float softplus_log2(float y) {
  return fmaxf(y, 0.0f) + log2_fast(1.0f + exp2_fast(-fabsf(y)));
}

// Largest |lower_bound| for which the diagonal blocks use the matrix units: their
// factors stay below 2^(8 * 8 / ln 2) = 2^92 and multiply normalised rows (|x| <= 1),
// far inside bf16's range.
constexpr float kDiagMmaMaxBound = 8.0f;

// The prologue's barrier in prologue_kernel: the whole block.
struct BlockBarrier {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};

// The prologue of chunk `chunk` of head `h`, by the Cfg::kPrologueThreads threads of the
// block from thread kFirstThread on (whole waves), in the block's dynamic LDS from byte
// kLdsOffset on (PrologueLayout<Cfg>::kBytes; a compile-time offset, so that addresses
// fold as in a kernel of its own), with `barrier` as their barrier. prologue_kernel runs
// it once per block on all its threads; a kernel whose other waves do other work can run
// it on a group of its waves behind a barrier of their own (the first step to the walks
// with producer waves, docs/NOTES.md session 28). A chunk past a.num_chunks returns at
// once: with that check in the caller, or the LDS passed as a pointer, nvcc scheduled the
// kernel differently; as it is, prologue_kernel's SASS is that of the kernel before the
// split (hipcc's code for CDNA differs slightly: 0-3% fewer instructions).
template <class Cfg, bool kAkk, int kFirstThread, int kLdsOffset, class GroupBarrier>
__device__ __forceinline__ void prologue_chunk(const PrologueArgs& a, const int h, const int chunk,
                                               const GroupBarrier barrier) {
  static_assert(kFirstThread % kWaveSize == 0, "the prologue's threads are whole waves");
  static_assert(kLdsOffset % 16 == 0, "the prologue's LDS is 16-byte aligned");
  constexpr DType Io = Cfg::kIo;
  using T = io_t<Io>;
  using Lay = PrologueLayout<Cfg>;
  constexpr int C = Lay::C, D = Lay::D, LDG = Lay::LDG, LDL = Lay::LDL, LDK = Lay::LDK, LDP = Lay::LDP;
  constexpr int NT = Cfg::kPrologueThreads, NW = NT / kWaveSize;
  constexpr int NB = Lay::NB;                        // 16-row blocks per chunk
  constexpr int PAIRS = Lay::kPairs;                 // off-diagonal block pairs
  // With a lower-bounded gate the diagonal blocks go through the matrix units too
  // (pairs PAIRS.. PAIRS + NB - 1), when the bound keeps the factors in range.
  constexpr int MMA_PAIRS = PAIRS + (Cfg::kLowerBound ? NB : 0);
  constexpr int PAIRS_PER_WAVE = (MMA_PAIRS + NW - 1) / NW;
  // Operand type of the L / aqk products: bf16 when the diagonal factors (up to
  // 2^(8 |bound| / ln 2)) need its exponent range, else the io dtype.
  constexpr DType Mx = Cfg::kLowerBound ? DType::kBF16 : Io;
  constexpr int ROWS_PER_WAVE = C / NW;
  constexpr int PER = (D + kWaveSize - 1) / kWaveSize;
  static_assert(C % NW == 0, "chunk rows must spread evenly over the waves");

  KDAGEN_DYNAMIC_SHARED(smem);
  float* Gs = reinterpret_cast<float*>(smem + kLdsOffset);
  float* Ls = Gs;
  T* Ks = reinterpret_cast<T*>(Gs + C * LDG);
  T* Qs = Ks + C * LDK;  // only with kStageQ
  float* rk = reinterpret_cast<float*>(Ks + Lay::kPlaneElems);
  float* rq = rk + C;
  float* bt = rq + C;
  // planar path: operand planes Ka, Kb, and the per-block vectors after beta
  uint16_t* KA = reinterpret_cast<uint16_t*>(Qs + C * LDK);
  uint16_t* KB = KA + C * LDP;
  float* Pv = bt + C;                           // 2^G of each block's first row [NB][D]
  float* Sv = Pv + NB * D;                      // pair scales [kScales][D]
  float* Lv = Sv + Lay::kScales * D;            // 2^(G_last - G_l(b)) of each block [NB][D]
  int* dmma = reinterpret_cast<int*>(Lv + NB * D);  // diagonal block b on the matrix units

  const int H = a.num_heads;
  if (chunk >= a.num_chunks) return;
  const int tid = static_cast<int>(threadIdx.x) - kFirstThread, lane = lane_id();
  const int wave = wave_id() - kFirstThread / kWaveSize;
  // A thread's 16-byte pieces of a [C][D] plane of 16-bit values: columns c8 .. c8 + 7 of
  // rows r8 + m RSTEP8, m < ITERS8 (whole rows per pass); block8(m) is that row's 16-row block.
  constexpr int PIECES8 = D / 8, RSTEP8 = NT / PIECES8, ITERS8 = C / RSTEP8;
  static_assert(NT % PIECES8 == 0 && C % RSTEP8 == 0, "whole rows per pass");
  const int r8 = static_cast<int>(static_cast<unsigned>(tid) / PIECES8);
  const int c8 = static_cast<int>(static_cast<unsigned>(tid) % PIECES8) * 8;
  // The gate's per-head constants need neither the chunk's sequence nor its rows: loaded
  // first, their latency under the index chain below (chunk -> sequence -> first token).
  const float a_log_h = a.a_log[h];
  const float4 bias_lo = *reinterpret_cast<const float4*>(a.dt_bias + h * D + c8);
  const float4 bias_hi = *reinterpret_cast<const float4*>(a.dt_bias + h * D + c8 + 4);
  const int n = a.chunk_indices[2 * chunk], lc = a.chunk_indices[2 * chunk + 1];
  const int bos = a.cu_seqlens[n], eos = a.cu_seqlens[n + 1];
  const int t0 = bos + lc * C;
  const int valid = min(C, eos - t0);
  const int last = valid - 1;
  float* const decay_out = a.decay + (static_cast<int64_t>(chunk) * H + h) * D;  // [chunks][H][D]
  // threads per column of the gate's cumulative sum (each sums a run of rows)
  constexpr int kCumsumRuns = NT >= D ? NT / D : 1;
  auto block8 = [&](int m) { return (m * RSTEP8) / 16 + (RSTEP8 > 16 ? r8 / 16 : 0); };

  // ---- inputs: raw rows, or the causal depthwise conv + SiLU of them ------------------
  auto raw = [&](const Strided& s, int t, int d) -> float {
    return to_float<Io>(static_cast<const T*>(s.ptr)[static_cast<int64_t>(t) * s.token +
                                                     static_cast<int64_t>(h) * s.head + d]);
  };
  auto input = [&](int band, int i, int d) -> float {  // band 0 q, 1 k, 2 v; row i < valid
    const Strided& s = band == 0 ? a.q : (band == 1 ? a.k : a.v);
    if constexpr (Cfg::kConvWidth == 0) {
      return raw(s, t0 + i, d);
    } else {
      if (a.conv_weight == nullptr) return raw(s, t0 + i, d);
      constexpr int W = Cfg::kConvWidth;
      const int ch = (band * H + h) * D + d;
      const int idx = a.conv_state_indices != nullptr ? a.conv_state_indices[n] : -1;
      // history only where conv_has_initial_state says so (none given: none, as vLLM's conv)
      const bool hist = idx >= 0 && idx < a.num_conv_slots &&
                        a.conv_has_initial_state != nullptr && a.conv_has_initial_state[n];
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const int p = t0 + i - (W - 1) + j;  // absolute token of this tap
        float x = 0.0f;
        if (p >= bos) x = raw(s, p, d);
        else if (hist)
          x = a.conv_state[(static_cast<int64_t>(idx) * 3 * H * D + ch) * (W - 1) + (W - 1) + (p - bos)];
        acc += a.conv_weight[ch * W + j] * x;
      }
      return acc * sigmoid(acc);
    }
  };

  // The chunk's first row of this head in a strided input, and whether its rows can be
  // read as 16-byte pieces (aligned, a chunk's row offsets inside 32 bits; for q / k / v
  // also no conv to apply).
  auto chunk_rows = [&](const Strided& s) -> const T* {
    return static_cast<const T*>(s.ptr) + static_cast<int64_t>(t0) * s.token + static_cast<int64_t>(h) * s.head;
  };
  auto aligned_rows = [&](const Strided& s, const T* base) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && s.token % (16 / static_cast<int>(sizeof(T))) == 0 &&
           s.token < (int64_t{1} << 31) / C;
  };
  // Whether this thread's row m of a [C][D] pass lies inside the chunk.
  auto row_in = [&](int m) { return r8 + m * RSTEP8 < valid; };
  auto plain_band = [&](const Strided& s, const T* base) {
    return (Cfg::kConvWidth == 0 || a.conv_weight == nullptr) && aligned_rows(s, base);
  };

  // Stage a band's chunk rows into an LDS plane: 16-byte loads, all in flight at once,
  // when the rows are plain and aligned; element by element through input() otherwise.
  // With kAsync and asynchronous copies on the target the plain rows go straight to LDS
  // (cp.async, no registers): the caller commits, waits and synchronises.
  auto stage = [&](T* dst, int band, auto async_tag) {
    constexpr bool kAsync = decltype(async_tag)::value && async::kHardware;
    const Strided& s = band == 0 ? a.q : (band == 1 ? a.k : a.v);
    const T* base = chunk_rows(s);
    const bool plain = plain_band(s, base);
    if (plain) {
      // this thread's pieces (r8 + m RSTEP8, c8): 32-bit offsets from the chunk's row
      static_assert(sizeof(T) == 2, "16-bit planes");
      const int tok = static_cast<int>(s.token), off = r8 * tok + c8;
      // piece m's place (kidx): swizzled rows RSTEP8 apart share their key (r mod 8, from
      // eight pieces a row on) when RSTEP8 is a multiple of 8, so one offset serves
      static_assert(!Lay::kSwz || D >= 64, "swizzled<D> keys rows by r mod 8 from 8 pieces a row on");
      auto d0 = [&](int m) -> T* {
        if constexpr (!Lay::kSwz) return dst + r8 * LDK + c8 + m * RSTEP8 * LDK;
        else if constexpr (RSTEP8 % 8 == 0) return dst + Lay::kidx(r8, c8) + m * RSTEP8 * LDK;
        else return dst + Lay::kidx(r8 + m * RSTEP8, c8);
      };
      if constexpr (kAsync) {
#pragma unroll
        for (int m = 0; m < ITERS8; ++m)  // zero-filled past the end, from a valid address
          async::copy16(d0(m), base + (row_in(m) ? off + m * RSTEP8 * tok : 0), row_in(m));
      } else {
        uint4 buf[ITERS8];
#pragma unroll
        for (int m = 0; m < ITERS8; ++m) {
          buf[m] = make_uint4(0, 0, 0, 0);
          if (row_in(m)) buf[m] = *reinterpret_cast<const uint4*>(base + off + m * RSTEP8 * tok);
        }
#pragma unroll
        for (int m = 0; m < ITERS8; ++m) *reinterpret_cast<uint4*>(d0(m)) = buf[m];
      }
    } else {
      for (int e = tid; e < C * D; e += NT) {
        const int i = e / D, d = e % D;
        dst[Lay::kidx(i, d)] = from_float<Io>(i < valid ? input(band, i, d) : 0.0f);
      }
    }
  };
  using Sync = AsyncTag<false>;
  using Async = AsyncTag<true>;
  // q (conv applied) from the LDS plane where it is staged, else from global memory.
  auto qval = [&](int i, int d) -> float {
    if constexpr (Cfg::kStageQ) return to_float<Io>(Qs[Lay::kidx(i, d)]);
    else return input(0, i, d);
  };
  // Neighbouring pairs (d even): one 32-bit read of a 16-bit plane, one 64-bit read of G.
  auto pair16 = [&](const T* plane, int i, int d) -> float2 {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(plane + Lay::kidx(i, d));
    return make_float2(to_float<Io>(static_cast<T>(w & 0xffffu)), to_float<Io>(static_cast<T>(w >> 16)));
  };
  auto k2 = [&](int i, int d) { return pair16(Ks, i, d); };
  auto q2 = [&](int i, int d) -> float2 {
    if constexpr (Cfg::kStageQ) return pair16(Qs, i, d);
    else return make_float2(input(0, i, d), input(0, i, d + 1));
  };
  // G plane column of channel d. Planar path: in pieces 4..7 of every 8 (8 floats each) the
  // two float4 halves swap places, d -> d ^ (bit 5 of d moved to bit 2), so that the 8 lanes
  // of a quarter warp reading 8 neighbouring pieces one half at a time hit 8 different
  // 16-byte bank groups (unswizzled: two lanes each). A permutation within aligned groups
  // of 8 columns: column-wise readers stay conflict-free. Identity elsewhere. Pv (2^G of a
  // block's first row) is laid out the same way.
  auto gcol = [](int d) { return Lay::kPlanar ? d ^ ((d >> 3) & 4) : d; };
  auto g2 = [&](int i, int d) { return *reinterpret_cast<const float2*>(Gs + i * LDG + gcol(d)); };

  // ---- phase 1: k (and q) rows, beta, the gate; then norms and the cumulative gate -----
  // Every global load of the chunk is issued here, before anything waits on one (k and q
  // as asynchronous copies where the target has them, landing while the gate is computed).
  stage(Ks, 1, Async{});
  if constexpr (Cfg::kStageQ) stage(Qs, 0, Async{});
  async::commit();
  // beta: a thread per row, loaded here and used after the gate's loads are out (its
  // sigmoid at once would hold wave 0 a memory round trip before them).
  static_assert(C <= NT, "a thread per row of beta");
  T beta_raw = from_float<Io>(0.0f);
  if (tid < valid)
    beta_raw = static_cast<const T*>(a.beta.ptr)[static_cast<int64_t>(t0 + tid) * a.beta.token +
                                                  static_cast<int64_t>(h) * a.beta.head];
  {
    // The per-step gate (log2 units) into the G plane, zero past the end, from 16-byte
    // loads of the raw gate where its rows are aligned. A thread keeps its pieces' column
    // (its dt_bias and gate constants) for all of its rows.
    constexpr int VEC = 8;
    const float a_exp = __expf(a_log_h);
    const T* base = chunk_rows(a.g);
    uint4 buf[ITERS8];
    if (aligned_rows(a.g, base)) {  // 32-bit offsets from the chunk's row
      const int tok = static_cast<int>(a.g.token), off = r8 * tok + c8;
#pragma unroll
      for (int m = 0; m < ITERS8; ++m) {
        buf[m] = make_uint4(0, 0, 0, 0);
        if (row_in(m)) buf[m] = *reinterpret_cast<const uint4*>(base + off + m * RSTEP8 * tok);
      }
    } else {  // an unaligned view: element by element into the same words
#pragma unroll
      for (int m = 0; m < ITERS8; ++m) {
        const int i = r8 + m * RSTEP8;
        buf[m] = make_uint4(0, 0, 0, 0);
        if (i < valid) {
          uint32_t w[4];
#pragma unroll
          for (int j = 0; j < 4; ++j)
            w[j] = static_cast<uint32_t>(from_float<Io>(raw(a.g, t0 + i, c8 + 2 * j))) |
                   (static_cast<uint32_t>(from_float<Io>(raw(a.g, t0 + i, c8 + 2 * j + 1))) << 16);
          buf[m] = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
    }
    // lower bound: lb log2(e) sigmoid(a_exp (x + bias)) = lb2 / (1 + 2^(x na + bias na)),
    // na = -a_exp log2(e); softplus: -a_exp softplus_log2((x + bias) log2(e))
    const float na = -a_exp * kLog2e, lb2 = a.lower_bound * kLog2e;
    float bs[VEC] = {bias_lo.x, bias_lo.y, bias_lo.z, bias_lo.w, bias_hi.x, bias_hi.y, bias_hi.z, bias_hi.w};
#pragma unroll
    for (int j = 0; j < VEC; ++j) bs[j] *= Cfg::kLowerBound ? na : kLog2e;
#pragma unroll
    for (int m = 0; m < ITERS8; ++m) {
      const int i = r8 + m * RSTEP8;
      float raw8[VEC];
      unpack8<Io>(buf[m], raw8);
      const bool in = i < valid;
      const float lbi = in ? lb2 : 0.0f;
      float gv[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        if constexpr (Cfg::kLowerBound) {
          gv[j] = __fdividef(lbi, 1.0f + exp2_fast(fmaf(raw8[j], na, bs[j])));
        } else {  // see softplus_log2
          gv[j] = in ? -a_exp * softplus_log2(fmaf(raw8[j], kLog2e, bs[j])) : 0.0f;
        }
      }
      float* row = Gs + i * LDG;
      *reinterpret_cast<float4*>(row + gcol(c8)) = make_float4(gv[0], gv[1], gv[2], gv[3]);
      *reinterpret_cast<float4*>(row + gcol(c8 + 4)) = make_float4(gv[4], gv[5], gv[6], gv[7]);
    }
  }
  if (tid < C) bt[tid] = tid < valid ? sigmoid(to_float<Io>(beta_raw)) : 0.0f;
  async::wait<0>();  // this thread's k / q copies have landed; the barrier publishes them
  barrier();
  {
    // Cumulative sum down each column, SEG threads per column: each sums its run of
    // rows in place, then adds the totals of the runs above it.
    constexpr int SEG = kCumsumRuns, RUN = C / SEG;
    static_assert(C % SEG == 0, "the cumsum runs must tile the chunk");
    for (int e = tid; e < D * SEG; e += NT) {
      const int d = gcol(e % D), r0 = (e / D) * RUN;
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < RUN; ++i) {
        acc += Gs[(r0 + i) * LDG + d];
        Gs[(r0 + i) * LDG + d] = acc;
      }
      // one run per column: acc is G_last (the gate is zero past the end)
      if constexpr (SEG == 1) decay_out[e] = exp2f(acc);
    }
    barrier();
    if constexpr (SEG > 1) {
      static_assert(D * SEG == NT, "one (column, run) per thread");
      const int d = gcol(tid % D), sg = tid / D;
      float off = 0.0f;
      for (int p = 0; p < sg; ++p) off += Gs[((p + 1) * RUN - 1) * LDG + d];
      barrier();  // every run total is read before any is changed
      if (sg > 0) {
#pragma unroll
        for (int i = 0; i < RUN; ++i) Gs[(sg * RUN + i) * LDG + d] += off;
      }
      barrier();
    }
  }
  if constexpr (Cfg::kStageQ) {
    // Row norms of k and q from the planes: a thread per 16-byte piece, summed over the
    // D / 8 neighbouring lanes of its row.
    constexpr int PER_ROW = D / 8, PIECES = C * PER_ROW, ITERS = (PIECES + NT - 1) / NT;
    static_assert(PER_ROW <= kWaveSize && NT % PER_ROW == 0, "a row's pieces share one wave");
#pragma unroll
    for (int m = 0; m < ITERS; ++m) {
      const int e = tid + m * NT, i = e / PER_ROW, c = (e % PER_ROW) * 8;
      float sk = 0.0f, sq = 0.0f;
      if (e < PIECES) {
        float k8[8], q8[8];
        unpack8<Io>(*reinterpret_cast<const uint4*>(Ks + Lay::kidx(i, c)), k8);
        unpack8<Io>(*reinterpret_cast<const uint4*>(Qs + Lay::kidx(i, c)), q8);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          sk += k8[j] * k8[j];
          sq += q8[j] * q8[j];
        }
      }
      sk = lane_group_sum<PER_ROW>(sk);
      sq = lane_group_sum<PER_ROW>(sq);
      if (e < PIECES && e % PER_ROW == 0) {
        rk[i] = i < valid ? rnorm(sk) : 0.0f;
        rq[i] = i < valid ? rnorm(sq) : 0.0f;
      }
    }
  } else {
    // Row norms of k and q: a wave per row, its rows' reductions interleaved.
    float kk[ROWS_PER_WAVE], qq[ROWS_PER_WAVE];
#pragma unroll
    for (int m = 0; m < ROWS_PER_WAVE; ++m) {
      const int i = wave + m * NW;
      kk[m] = qq[m] = 0.0f;
      if (i < valid) {
        for (int d = lane; d < D; d += kWaveSize) {
          const float kx = to_float<Io>(Ks[Lay::kidx(i, d)]), qx = qval(i, d);
          kk[m] += kx * kx;
          qq[m] += qx * qx;
        }
      }
    }
#pragma unroll
    for (int m = 0; m < ROWS_PER_WAVE; ++m) {
      kk[m] = wave_sum(kk[m]);
      qq[m] = wave_sum(qq[m]);
    }
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < ROWS_PER_WAVE; ++m) {
        const int i = wave + m * NW;
        rk[i] = i < valid ? rnorm(kk[m]) : 0.0f;
        rq[i] = i < valid ? rnorm(qq[m]) : 0.0f;
      }
    }
  }
  barrier();

  // The outputs from this chunk's first row of head h; rows i apart are i * ld_hd (or
  // ld_hc) elements apart, 32-bit offsets inside a chunk.
  const int ld_hd = H * D, ld_hc = H * C;
  const int64_t row_hd = static_cast<int64_t>(H) * D, row_hc = static_cast<int64_t>(H) * C;
  T* const aqk = static_cast<T*>(a.aqk) + t0 * row_hc + h * C;  // [T][H][C]
  T* const wout = static_cast<T*>(a.w) + t0 * row_hd + h * D;   // [T][H][D]
  T* const uout = static_cast<T*>(a.u) + t0 * row_hd + h * D;  // not with kAkk
  T* const akk = kAkk ? static_cast<T*>(a.akk) + t0 * row_hc + h * C : nullptr;  // [T][H][C]
  T* const qg = static_cast<T*>(a.qg) + t0 * row_hd + h * D;
  T* const kg_t = static_cast<T*>(a.kg_t) + (static_cast<int64_t>(chunk) * H + h) * D * C;  // [chunks][H][D][C]
  // decay = 2^G_last in fp32 (exp2f: the fp32 output keeps its subnormals); with one
  // cumsum run per column, stored by the cumsum itself
  auto store_decay = [&]() {
    if constexpr (kCumsumRuns > 1)
      for (int d = tid; d < D; d += NT) decay_out[d] = exp2f(Gs[last * LDG + gcol(d)]);
  };

  // Diagonal-block rows by exact exponent differences, for the rows use_simt(i) picks: a
  // wave per row, lanes over D. diagL[m] keeps lane j's L entry of row wave + m NW; the
  // row's aqk diagonal block is stored (with zero_tail, the zeros after it too).
  float diagL[ROWS_PER_WAVE];
  auto diag_rows = [&](auto use_simt, bool zero_tail) {
#pragma unroll
  for (int m = 0; m < ROWS_PER_WAVE; ++m) {
    const int i = wave + m * NW;
    diagL[m] = 0.0f;
    if (i >= valid || !use_simt(i)) continue;
    const int b0 = 16 * (i / 16);
    float qi[PER], ki[PER], gi[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      const int d = lane + e * kWaveSize;
      const bool in = d < D;
      qi[e] = in ? qval(i, d) : 0.0f;
      ki[e] = in ? to_float<Io>(Ks[Lay::kidx(i, d)]) : 0.0f;
      gi[e] = in ? Gs[i * LDG + gcol(d)] : 0.0f;
    }
    float myQ = 0.0f;
    for (int j = b0; j <= i; ++j) {
      float sk = 0.0f, sq = 0.0f;
#pragma unroll
      for (int e = 0; e < PER; ++e) {
        const int d = lane + e * kWaveSize;
        if (d < D) {
          const float kj = to_float<Io>(Ks[Lay::kidx(j, d)]) * exp2_fast(gi[e] - Gs[j * LDG + gcol(d)]);
          sk += ki[e] * kj;
          sq += qi[e] * kj;
        }
      }
      sk = wave_sum(sk);
      sq = wave_sum(sq);
      if (lane == j - b0) {
        diagL[m] = sk;
        myQ = sq;
      }
    }
    T* arow = aqk + i * ld_hc;
    if (lane < 16) {
      const int j = b0 + lane;
      arow[j] = from_float<Io>(j <= i ? a.scale * rq[i] * rk[j] * myQ : 0.0f);
    }
    if (zero_tail)
      for (int j = b0 + 16 + lane; j < C; j += kWaveSize) arow[j] = from_float<Io>(0.0f);
  }
  };


  // (I + L)^-1 in place of L (fp32, unit lower triangular, by 16-row blocks): the
  // diagonal blocks' inverses by forward substitution, then block row by block row
  //   Ainv_ij = -Inv_ii * sum_{k=j}^{i-1} L_ik Ainv_kj.
  // A thread owns entry (r, c) of a block; the 16 entries of its row of L_ik (the same
  // for the 16 threads of that row: broadcast) are read as four 16-byte pieces.
  auto row16 = [&](int row, int col0, float (&x)[16]) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 v = *reinterpret_cast<const float4*>(Ls + row * LDL + col0 + 4 * q);
      x[4 * q] = v.x, x[4 * q + 1] = v.y, x[4 * q + 2] = v.z, x[4 * q + 3] = v.w;
    }
  };
  static_assert(LDL % 4 == 0, "L rows must keep 16-byte pieces aligned");
  auto invert_unit_lower = [&]() {
    {
      float x[16];
      const int b = tid / 16, c = tid % 16;
      if (tid < NB * 16) {
#pragma unroll
        for (int r = 0; r < 16; ++r) {
          float l[16];
          row16(16 * b + r, 16 * b, l);
          float v = r == c ? 1.0f : 0.0f;
#pragma unroll
          for (int j = 0; j < r; ++j) v -= l[j] * x[j];
          x[r] = v;
        }
      }
      barrier();
      if (tid < NB * 16) {
#pragma unroll
        for (int r = 0; r < 16; ++r) Ls[(16 * b + r) * LDL + 16 * b + c] = x[r];
      }
      barrier();
    }
    {
      const int r = tid / 16 % 16, c = tid % 16;  // this thread's entry of a 16 x 16 block
      static_assert(NB == 1 || NT >= 256, "one thread per entry of a 16 x 16 block");
      const bool act = tid < 256;
#pragma unroll
      for (int i = 1; i < NB; ++i) {
        float t[NB];
#pragma unroll
        for (int j = 0; j < NB; ++j) t[j] = 0.0f;
        if (act) {
#pragma unroll
          for (int k = 0; k < i; ++k) {  // T_ij = sum_{k >= j} L_ik Ainv_kj, j <= k < i
            float l[16];
            row16(16 * i + r, 16 * k, l);
#pragma unroll
            for (int j = 0; j <= k; ++j) {
#pragma unroll
              for (int m = 0; m < 16; ++m) t[j] += l[m] * Ls[(16 * k + m) * LDL + 16 * j + c];
            }
          }
        }
        barrier();  // row block i of L is read; its place takes T, then Ainv
#pragma unroll
        for (int j = 0; j < NB; ++j)
          if (act && j < i) Ls[(16 * i + r) * LDL + 16 * j + c] = t[j];
        barrier();
        if (act) {
          float inv[16];  // row r of Inv_ii
          row16(16 * i + r, 16 * i, inv);
#pragma unroll
          for (int j = 0; j < NB; ++j) {
            if (j < i) {
              float v = 0.0f;
#pragma unroll
              for (int m = 0; m < 16; ++m) v -= inv[m] * Ls[(16 * i + m) * LDL + 16 * j + c];
              t[j] = v;
            }
          }
        }
        barrier();
#pragma unroll
        for (int j = 0; j < NB; ++j)
          if (act && j < i) Ls[(16 * i + r) * LDL + 16 * j + c] = t[j];
        barrier();
      }
    }
  };

  // Block pair p: the off-diagonal pairs (bi > bj) first, p = bi (bi - 1) / 2 + bj, then
  // the diagonal blocks.
  auto pair_blocks = [&](int p, int& bi, int& bj) {
    if (p < PAIRS) {
      bi = 1, bj = p;
      while (bj >= bi) { bj -= bi; ++bi; }
    } else {
      bi = bj = p - PAIRS;
    }
  };

  // kg_t [D][C] (zero past the end; a thread takes 8 consecutive rows of one column d)
  // and decay, from the raw k plane and G.
  auto store_kg_t_and_decay = [&]() {
    constexpr int VEC = 8, PIECES = D * (C / VEC), ITERS = (PIECES + NT - 1) / NT;
#pragma unroll
    for (int m = 0; m < ITERS; ++m) {
      const int e = tid + m * NT, d = e % D, i0 = (e / D) * VEC;
      if (PIECES % NT != 0 && e >= PIECES) break;
      const float glast = Gs[last * LDG + gcol(d)];
      float out8[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const int i = i0 + j;
        out8[j] = i < valid ? to_float<Io>(Ks[Lay::kidx(i, d)]) * rk[i] * exp2_fast(glast - Gs[i * LDG + gcol(d)]) : 0.0f;
      }
      store16(kg_t + d * C + i0, pack8<Io>(out8));
    }
    store_decay();
  };

  if constexpr (Lay::kPlanar) {
    constexpr int kScales = Lay::kScales, LDA = Lay::LDA;
    // The 16 x 16 tile at (r0, c0) of the k or q plane, as the matrix loads address it
    // (the plane's row placement, kidx).
    using KqTile = TileAt<D, LDK, Lay::kSwz, const uint16_t>;
    auto load8f = [](const float* p, float (&v)[8]) {
      const float4 x = *reinterpret_cast<const float4*>(p), y = *reinterpret_cast<const float4*>(p + 4);
      v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
    };
    // columns c .. c + 7 (c a multiple of 8) of a G-swizzled row
    auto load8g = [&](const float* row, int c, float (&v)[8]) {
      const float4 x = *reinterpret_cast<const float4*>(row + gcol(c));
      const float4 y = *reinterpret_cast<const float4*>(row + gcol(c + 4));
      v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
    };

    // ---- P2: per-block vectors, the diagonal choice, decay -------------------------------
    for (int e = tid; e < NB * D; e += NT) {
      const int b = e / D, d = e % D;
      const int gd = gcol(d);
      Pv[b * D + gd] = exp2_fast(Gs[16 * b * LDG + gd]);
      Lv[e] = exp2_fast(Gs[last * LDG + gd] - Gs[(16 * b + 15) * LDG + gd]);  // <= 1 (rows past the end keep G_last)
    }
    for (int e = tid; e < kScales * D; e += NT) {
      const int p = e / D, d = e % D;
      int bi, bj;
      pair_blocks(p, bi, bj);
      Sv[e] = exp2_fast(Gs[16 * bi * LDG + gcol(d)] - Gs[(16 * bj + 15) * LDG + gcol(d)]);
    }
    if (wave < NB) {  // wave b: the span of diagonal block b, the largest over the channels
      float span = 0.0f;
      for (int d = lane; d < D; d += kWaveSize)
        span = fmaxf(span, Gs[16 * wave * LDG + gcol(d)] - Gs[(16 * wave + 15) * LDG + gcol(d)]);
      span = wave_max(span);
      if (lane == 0) dmma[wave] = span <= kDiagSpan<Mx> ? 1 : 0;
    }
    store_decay();
    barrier();

    // ---- P3: diagonal blocks whose span is too wide: exact per pair ---------------------
    bool any_simt = false;
#pragma unroll
    for (int b = 0; b < NB; ++b) any_simt |= dmma[b] == 0;
    if (any_simt) {  // block-uniform
      diag_rows([&](int i) { return dmma[i / 16] == 0; }, false);
      barrier();  // the raw k, q rows are read before P4 replaces them
    }

    // ---- P4: the operand planes, and qg; k plane <- b k^ 2^G (bf16), q plane <- Qa ------
    {
      uint16_t* Km = reinterpret_cast<uint16_t*>(Ks);
      uint16_t* Qm = reinterpret_cast<uint16_t*>(Qs);
      // The block's first / last row of G, for this thread's columns: read once where the
      // chunk is one block (chunk 16), else per row (the block may change).
      float gf[8], gl[8];
      auto block_rows = [&](int b) {
        load8g(Gs + 16 * b * LDG, c8, gf);
        load8g(Gs + (16 * b + 15) * LDG, c8, gl);
      };
      // One block (chunk 16): the only product on the matrix units is the diagonal block's,
      // so Kb takes its column scale there and then (Kb_j = k^_j 2^(G_f - G_j), one rounding,
      // no scale_k in P5) where the block's span lets it (dmma); the kg_t pass divides it out.
      if constexpr (NB == 1) {
        block_rows(0);
        const bool kb_diag = dmma[0] != 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) gl[j] = kb_diag ? gf[j] : gl[j];  // Kb's reference row
      }
#pragma unroll 2
      for (int m = 0; m < ITERS8; ++m) {
        const int i = r8 + m * RSTEP8, c = c8;
        float k8[8], q8[8], g[8], pf[8];
        if constexpr (NB > 1) block_rows(block8(m));
        load8g(Pv + block8(m) * D, c, pf);
        unpack8<Io>(*reinterpret_cast<const uint4*>(Ks + Lay::kidx(i, c)), k8);
        unpack8<Io>(*reinterpret_cast<const uint4*>(Qs + Lay::kidx(i, c)), q8);
        load8g(Gs + i * LDG, c, g);
        const float ri = rk[i], qi = rq[i], bi = bt[i];
        float ka[8], qa[8], kb[8], w8[8], qo[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float up = exp2_fast(g[j] - gf[j]);  // <= 1
          const float down = exp2_fast(gl[j] - g[j]);  // <= 1 (<= 2^kDiagSpan from G_f)
          const float kn = ri * k8[j];
          ka[j] = kn * up;
          qa[j] = qi * q8[j] * up;
          kb[j] = kn * down;
          w8[j] = bi * ka[j] * pf[j];  // b k^ 2^G
          qo[j] = qa[j] * pf[j];  // q^ 2^G
        }
        *reinterpret_cast<uint4*>(KA + i * LDP + c) = pack8<Mx>(ka);
        *reinterpret_cast<uint4*>(KB + i * LDP + c) = pack8<Mx>(kb);
        *reinterpret_cast<uint4*>(Qm + Lay::kidx(i, c)) = pack8<Mx>(qa);
        *reinterpret_cast<uint4*>(Km + Lay::kidx(i, c)) = pack8<DType::kBF16>(w8);
        if (i < valid) store16(qg + i * ld_hd + c, pack8<Io>(qo));
      }
    }
    barrier();

    // kg_t [D][C] from the Kb plane: k^_j 2^(G_last - G_j) = Kb_j 2^(G_last - G_l(j)) (over
    // 2^(G_f - G_l) where P4 scaled the chunk's one block), a thread per 8 consecutive rows
    // of one column (one block, one factor); rows past the end are zero in Kb (rk = 0).
    // Nothing after reads it here: no barrier before P5.
    {
      constexpr int VEC = 8, PIECES = D * (C / VEC), ITERS = PIECES / NT;
      static_assert(PIECES % NT == 0, "the kg_t pieces spread evenly");
#pragma unroll
      for (int m = 0; m < ITERS; ++m) {
        const int e = tid + m * NT, d = e % D, i0 = (e / D) * VEC;
        float f = Lv[(i0 / 16) * D + d];
        if constexpr (NB == 1) {
          if (dmma[0] != 0) f = __fdividef(f, Sv[PAIRS * D + d]);  // Kb took 2^(G_f - G_l) in P4
        }
        float out8[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) out8[j] = to_float<Mx>(KB[(i0 + j) * LDP + d]) * f;
        store16(kg_t + d * C + i0, pack8<Io>(out8));
      }
    }

    // v's rows, loaded now so that they land during the products (used in P6; not with akk)
    constexpr int VPER_ROW = D / 8, VITERS = C * VPER_ROW / NT;
    static_assert(C * VPER_ROW % NT == 0, "the chunk's 16-byte pieces spread evenly");
    const T* vbase = chunk_rows(a.v);
    const bool vplain = !kAkk && plain_band(a.v, vbase);
    uint4 vb[VITERS];
    if (vplain) {
#pragma unroll
      for (int m = 0; m < VITERS; ++m) {
        const int e = tid + m * NT, i = e / VPER_ROW, c = (e % VPER_ROW) * 8;
        vb[m] = make_uint4(0, 0, 0, 0);
        if (i < valid) vb[m] = *reinterpret_cast<const uint4*>(vbase + static_cast<int64_t>(i) * a.v.token + c);
      }
    }

    // ---- P5: L and aqk block pairs on the matrix units (G is dead: L takes its place) ---
    uint16_t* Ab = reinterpret_cast<uint16_t*>(Ls + C * LDL);  // aqk staging, then (I + L)^-1 b
    {
      const uint16_t* Qm = reinterpret_cast<const uint16_t*>(Qs);
      constexpr int PER_WAVE = (kScales + NW - 1) / NW;
#pragma unroll
      for (int pp = 0; pp < PER_WAVE; ++pp) {
        const int p = wave + pp * NW;
        if (p >= kScales) break;
        int bi, bj;
        pair_blocks(p, bi, bj);
        const bool diag = bi == bj;
        if (diag && dmma[bi] == 0) continue;
        mma::Acc accL, accQ;
        mma::zero(accL);
        mma::zero(accQ);
#pragma unroll 4
        for (int kt = 0; kt < D / 16; ++kt) {
          const mma::Frag ak = mma::load_a_smem(KA + 16 * bi * LDP + 16 * kt, LDP);
          const mma::Frag aq = mma::load_a_smem_at(KqTile{Qm, 16 * bi, 16 * kt});
          mma::Frag b = mma::load_b_smem(KB + 16 * bj * LDP + 16 * kt, LDP);
          if constexpr (NB > 1) mma::scale_k<Mx>(b, Sv + p * D + 16 * kt);  // else scaled in P4
          mma::mma<Mx>(accL, ak, b);
          mma::mma<Mx>(accQ, aq, b);
        }
        // (masked entries of a diagonal block may be huge: selected away, never scaled)
        mma::for_each(accQ, [&](int r, int c, float& x) { x = diag && c > r ? 0.0f : a.scale * x; });
        mma::store_tile<Io>(accQ, Ab + 16 * bi * LDA + 16 * bj, LDA);
        mma::for_each(accL, [&](int r, int c, float& x) {
          const int i = 16 * bi + r, j = 16 * bj + c;
          Ls[i * LDL + j] = diag && j >= i ? 0.0f : bt[i] * x;
        });
      }
      if (any_simt) {
#pragma unroll
        for (int m = 0; m < ROWS_PER_WAVE; ++m) {
          const int i = wave + m * NW, j = 16 * (i / 16) + lane;
          if (dmma[i / 16] == 0 && lane < 16 && j < i)
            Ls[i * LDL + j] = i < valid ? bt[i] * rk[i] * rk[j] * diagL[m] : 0.0f;
        }
      }
    }
    barrier();

    // ---- P6: b v into the q plane (bf16); aqk out (16-byte stores); (I + L)^-1 ---------
    {
      constexpr int VEC = 8, PER_ROW = VPER_ROW, ITERS = VITERS;
      uint16_t* Vm = reinterpret_cast<uint16_t*>(Qs);
      {
        constexpr int AV = 8;
        for (int e = tid; e < valid * (C / AV); e += NT) {
          const int i = e / (C / AV), j = (e % (C / AV)) * AV, ib = i / 16, jb = j / 16;
          if (jb == ib && dmma[ib] == 0) continue;  // stored by the exact path
          const uint4 x = jb > ib ? make_uint4(0, 0, 0, 0) : *reinterpret_cast<const uint4*>(Ab + i * LDA + j);
          store16(aqk + i * ld_hc + j, x);
        }
      }
#pragma unroll
      for (int m = 0; m < (kAkk ? 0 : ITERS); ++m) {
        const int e = tid + m * NT, i = e / PER_ROW, c = (e % PER_ROW) * VEC;
        float v8[VEC];
        if (vplain) {
          unpack8<Io>(vb[m], v8);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) v8[j] = i < valid ? input(2, i, c + j) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) v8[j] *= bt[i];
        *reinterpret_cast<uint4*>(Vm + Lay::kidx(i, c)) = pack8<DType::kBF16>(v8);
      }
    }
    invert_unit_lower();
    for (int e = tid; e < C * C / 8; e += NT) {  // (I + L)^-1 in bf16, zero above the diagonal blocks
      const int i = e / (C / 8), j = (e % (C / 8)) * 8;
      float x[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      if (j / 16 <= i / 16) load8f(Ls + i * LDL + j, x);
      *reinterpret_cast<uint4*>(Ab + i * LDA + j) = pack8<DType::kBF16>(x);
      if constexpr (kAkk) {  // akk = (I + L)^-1 Diag(b), rounded once
        if (i < valid) {
          float y[8];
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) y[jj] = x[jj] * bt[j + jj];
          store16(akk + i * ld_hc + j, pack8<Io>(y));
        }
      }
    }
    barrier();

    // ---- P7: w = (I + L)^-1 (b k^ 2^G), u = (I + L)^-1 (b v) ------------------------------
    // A wave per 16-column slice of w or u (w alone with akk): block rows bi take the
    // k-blocks kb <= bi (unrolled); staged in the Ka / Kb planes (dead), then 16-byte stores.
    {
      const uint16_t* Wm = reinterpret_cast<const uint16_t*>(Ks);
      const uint16_t* Vm = reinterpret_cast<const uint16_t*>(Qs);
      constexpr int SLICES = (kAkk ? 1 : 2) * (D / 16);
#pragma unroll
      for (int m = 0; m < (SLICES + NW - 1) / NW; ++m) {
        const int sl = wave + m * NW;
        if (SLICES % NW != 0 && sl >= SLICES) break;
        const bool is_w = sl < D / 16;
        const int dt = is_w ? sl : sl - D / 16;
        const uint16_t* rhs = is_w ? Wm : Vm;
        uint16_t* dst = (is_w ? KA : KB) + 16 * dt;
#pragma unroll
        for (int bi = 0; bi < NB; ++bi) {
          mma::Acc acc;
          mma::zero(acc);
#pragma unroll
          for (int kb = 0; kb <= bi; ++kb) {
            const mma::Frag fa = mma::load_a_smem(Ab + 16 * bi * LDA + 16 * kb, LDA);
            const mma::Frag fb = mma::load_b_smem_kn_at(KqTile{rhs, 16 * kb, 16 * dt});
            mma::mma<DType::kBF16>(acc, fa, fb);
          }
          mma::store_tile<Io>(acc, dst + 16 * bi * LDP, LDP);
        }
      }
    }
    barrier();
#pragma unroll
    for (int m = 0; m < ITERS8; ++m) {  // this thread's pieces of w and u
      const int i = r8 + m * RSTEP8;
      if (i < valid) {
        store16(wout + i * ld_hd + c8, *reinterpret_cast<const uint4*>(KA + i * LDP + c8));
        if constexpr (!kAkk) store16(uout + i * ld_hd + c8, *reinterpret_cast<const uint4*>(KB + i * LDP + c8));
      }
    }
  } else {
  // ---- phase 2: elementwise outputs qg, kg_t, decay (16-byte stores) --------------------
  {
    constexpr int VEC = 8;
    for (int e = tid; e < valid * (D / VEC); e += NT) {
      const int i = e / (D / VEC), c = (e % (D / VEC)) * VEC;
      float out8[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) out8[j] = qval(i, c + j) * rq[i] * exp2_fast(Gs[i * LDG + gcol(c + j)]);
      store16(qg + i * ld_hd + c, pack8<Io>(out8));
    }
  }
  store_kg_t_and_decay();

  // ---- phase 3: L and aqk --------------------------------------------------------------

  // The diagonal blocks take the matrix-unit path when the gate's bound keeps
  // 2^(G_i - G_r), r the block's middle row, within 2^(8 * kDiagMmaMaxBound / ln 2):
  // a block-uniform choice by value, both paths exact to rounding.
  const bool diag_mma = Cfg::kLowerBound && a.lower_bound >= -kDiagMmaMaxBound;
  const int live_pairs = diag_mma ? MMA_PAIRS : PAIRS;

  // Block pairs on the matrix units; L stays in registers until G is dead.
  mma::Acc accL[PAIRS_PER_WAVE > 0 ? PAIRS_PER_WAVE : 1];
  int pair_bi[PAIRS_PER_WAVE > 0 ? PAIRS_PER_WAVE : 1], pair_bj[PAIRS_PER_WAVE > 0 ? PAIRS_PER_WAVE : 1];
#pragma unroll
  for (int pp = 0; pp < PAIRS_PER_WAVE; ++pp) {
    const int p = wave + pp * NW;
    int bi, bj;
    pair_blocks(p, bi, bj);
    pair_bi[pp] = bi;
    pair_bj[pp] = bj;
    mma::zero(accL[pp]);
    if (p >= live_pairs) continue;
    const bool diag = bi == bj;
    mma::Acc accQ;
    mma::zero(accQ);
    // Off-diagonal: the block's first row, both factors <= 1. Diagonal: its middle row.
    const int ref = diag ? 16 * bi + 8 : 16 * bi;
#pragma unroll 2
    for (int kt = 0; kt < D / 16; ++kt) {
      const float* gref = Gs + ref * LDG + 16 * kt;
      // Operands of the normalised rows (rk, rq folded in before the 16-bit rounding, so
      // that the diagonal blocks' factors multiply values of at most 1).
      const mma::Frag ak = mma::load_a2<Mx>([&](int r, int c) {
        const int i = 16 * bi + r, d = 16 * kt + c;
        const float2 k = k2(i, d), g = g2(i, d), gr = *reinterpret_cast<const float2*>(gref + c);
        return make_float2(rk[i] * k.x * exp2_fast(g.x - gr.x), rk[i] * k.y * exp2_fast(g.y - gr.y));
      });
      const mma::Frag aq = mma::load_a2<Mx>([&](int r, int c) {
        const int i = 16 * bi + r, d = 16 * kt + c;
        if (i >= valid) return make_float2(0.0f, 0.0f);
        const float2 q = q2(i, d), g = g2(i, d), gr = *reinterpret_cast<const float2*>(gref + c);
        return make_float2(rq[i] * q.x * exp2_fast(g.x - gr.x), rq[i] * q.y * exp2_fast(g.y - gr.y));
      });
      const mma::Frag b = mma::load_b2<Mx>([&](int nn, int c) {
        const int j = 16 * bj + nn, d = 16 * kt + c;
        const float2 k = k2(j, d), g = g2(j, d), gr = *reinterpret_cast<const float2*>(gref + c);
        return make_float2(rk[j] * k.x * exp2_fast(gr.x - g.x), rk[j] * k.y * exp2_fast(gr.y - g.y));
      });
      mma::mma<Mx>(accL[pp], ak, b);
      mma::mma<Mx>(accQ, aq, b);
    }
    mma::for_each(accQ, [&](int r, int c, float& x) {
      const int i = 16 * bi + r, j = 16 * bj + c;
      // (masked entries of a diagonal block may be huge or inf: selected away, never scaled)
      const float v = diag && j > i ? 0.0f : a.scale * x;
      if (i < valid) aqk[i * ld_hc + j] = from_float<Io>(v);
    });
  }
  if (diag_mma) {
    // aqk above the diagonal blocks is zero: 16-byte stores of row i's columns >= 16 (i/16 + 1)
    constexpr int VEC = 8;
    for (int e = tid; e < valid * (C / VEC); e += NT) {
      const int i = e / (C / VEC), j = (e % (C / VEC)) * VEC;
      if (j >= 16 * (i / 16 + 1))
        store16(aqk + i * ld_hc + j, make_uint4(0, 0, 0, 0));
    }
  }

  diag_rows([&](int) { return !diag_mma; }, true);
  barrier();

  // ---- phase 4: k plane <- b k^ 2^G, the right-hand side of w (and v into the q plane) --
  if constexpr (Lay::kMmaSolve && Lay::kVInQ && !kAkk) stage(Qs, 2, Sync{});
  for (int e = tid; e < C * (D / 8); e += NT) {  // 8 elements: 16-byte k, two float4 of G
    const int i = e / (D / 8), d = (e % (D / 8)) * 8;
    float k8[8];
    unpack8<Io>(*reinterpret_cast<const uint4*>(Ks + Lay::kidx(i, d)), k8);
    const float4 g0 = *reinterpret_cast<const float4*>(Gs + i * LDG + gcol(d));
    const float4 g1 = *reinterpret_cast<const float4*>(Gs + i * LDG + gcol(d + 4));
    const float gs[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    const float f = bt[i] * rk[i];
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[j] = f * k8[j] * exp2_fast(gs[j]);
    }
    *reinterpret_cast<uint4*>(Ks + Lay::kidx(i, d)) = pack8<Io>(v);
  }
  barrier();

  // ---- phase 5: L into the (now dead) G plane -------------------------------------------
#pragma unroll
  for (int pp = 0; pp < PAIRS_PER_WAVE; ++pp) {
    if (wave + pp * NW >= live_pairs) continue;
    const int bi = pair_bi[pp], bj = pair_bj[pp];
    mma::for_each(accL[pp], [&](int r, int c, float& x) {
      const int i = 16 * bi + r, j = 16 * bj + c;
      Ls[i * LDL + j] = bi == bj && j >= i ? 0.0f : bt[i] * x;
    });
  }
  if (!diag_mma) {
#pragma unroll
    for (int m = 0; m < ROWS_PER_WAVE; ++m) {
      const int i = wave + m * NW;
      const int j = 16 * (i / 16) + lane;
      if (lane < 16 && j < i) Ls[i * LDL + j] = i < valid ? bt[i] * rk[i] * rk[j] * diagL[m] : 0.0f;
    }
  }
  barrier();

  if constexpr (Lay::kMmaSolve) {
    // ---- phase 6: w = (I + L)^-1 (b k^ 2^G), u = (I + L)^-1 (b v) on the matrix units ---
    // (I + L)^-1 by 16-row blocks, in fp32 and in place of L: the diagonal blocks'
    // inverses by forward substitution, then block row by block row
    //   Ainv_ij = -Inv_ii * sum_{k=j}^{i-1} L_ik Ainv_kj,
    // then rounded to bf16 for the two products with the right-hand sides.
    uint16_t* Ab = Lay::kInverseInG ? reinterpret_cast<uint16_t*>(Ls + C * Lay::LDL)
                                     : reinterpret_cast<uint16_t*>(Qs);  // q is dead
    invert_unit_lower();
    for (int e = tid; e < C * C; e += NT) {  // bf16 copy, zero above the diagonal blocks
      const int i = e / C, j = e % C;
      const float x = j / 16 <= i / 16 ? Ls[i * LDL + j] : 0.0f;
      Ab[i * Lay::LDA + j] = from_float<DType::kBF16>(x);
      if constexpr (kAkk) {  // akk = (I + L)^-1 Diag(b)
        if (i < valid) akk[i * ld_hc + j] = from_float<Io>(x * bt[j]);
      }
    }
    barrier();
    // 2 x (C / 16) x (D / 16) output tiles over the waves: w from the k plane, u from
    // b * v in the q plane; block row bi takes the k-blocks kb <= bi. Where the q plane
    // is not free for v, the w tiles go first, then v replaces k in the k plane.
    constexpr int WTILES = NB * (D / 16), TILES = 2 * WTILES;
    auto solve_tiles = [&](int first, int last_tile) {
      for (int tile = first + wave; tile < last_tile; tile += NW) {
        const bool is_w = tile < WTILES;
        const int tt = is_w ? tile : tile - WTILES;
        const int bi = tt / (D / 16), dt = tt % (D / 16);
        const T* rhs = is_w || !Lay::kVInQ ? Ks : Qs;
        mma::Acc acc;
        mma::zero(acc);
        for (int kb = 0; kb <= bi; ++kb) {
          const mma::Frag fa = mma::load_a_smem(Ab + 16 * bi * Lay::LDA + 16 * kb, Lay::LDA);
          const mma::Frag fb = mma::load_b2<DType::kBF16>([&](int nn, int k) {
            const int j = 16 * kb + k, d = 16 * dt + nn;
            const float s0 = is_w ? 1.0f : bt[j], s1 = is_w ? 1.0f : bt[j + 1];
            return make_float2(s0 * to_float<Io>(rhs[Lay::kidx(j, d)]), s1 * to_float<Io>(rhs[Lay::kidx(j + 1, d)]));
          });
          mma::mma<DType::kBF16>(acc, fa, fb);
        }
        T* dst = (is_w ? wout : uout) + 16 * dt;
        mma::for_each(acc, [&](int r, int c, float& x) {
          const int i = 16 * bi + r;
          if (i < valid) dst[i * ld_hd + c] = from_float<Io>(x);
        });
      }
    };
    if constexpr (kAkk) {
      solve_tiles(0, WTILES);  // u is the chunk scan's (akk v)
    } else if constexpr (Lay::kVInQ) {
      solve_tiles(0, TILES);
    } else {
      solve_tiles(0, WTILES);
      barrier();  // every w product has read the k plane
      stage(Ks, 2, Sync{});
      barrier();
      solve_tiles(WTILES, TILES);
    }
  } else {
  // ---- phase 6 (otherwise): forward substitution, one thread per output column ----------
  // By 16-row blocks: the rows of a block first take every earlier block's terms as 16
  // independent accumulations (float4 reads of L), then solve inside the block. With akk
  // the right-hand sides past w are b_d e_d: the columns of (I + L)^-1 Diag(b).
  for (int col = tid; col < D + (kAkk ? C : D); col += NT) {
    const bool is_w = col < D;
    const int d = is_w ? col : col - D;
    float y[C];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      float acc[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const int i = 16 * b + r;
        acc[r] = 0.0f;
        if (i < valid) {
          if (is_w) acc[r] = to_float<Io>(Ks[Lay::kidx(i, d)]);
          else if constexpr (kAkk) acc[r] = i == d ? bt[i] : 0.0f;
          else acc[r] = bt[i] * input(2, i, d);
        }
      }
#pragma unroll
      for (int j = 0; j < 16 * b; j += 4) {
#pragma unroll
        for (int r = 0; r < 16; ++r) {
          const float4 l = *reinterpret_cast<const float4*>(Ls + (16 * b + r) * LDL + j);
          acc[r] -= l.x * y[j] + l.y * y[j + 1] + l.z * y[j + 2] + l.w * y[j + 3];
        }
      }
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const float* lrow = Ls + (16 * b + r) * LDL + 16 * b;
        float x = acc[r];
#pragma unroll
        for (int j = 0; j < r; ++j) x -= lrow[j] * y[16 * b + j];
        y[16 * b + r] = x;
      }
    }
    T* dst = is_w ? wout : (kAkk ? akk : uout);
    const int ld = is_w || !kAkk ? ld_hd : ld_hc;
#pragma unroll
    for (int i = 0; i < C; ++i)
      if (i < valid) dst[i * ld + d] = from_float<Io>(y[i]);
  }
  }  // kMmaSolve
  }  // kPlanar
}

template <class Cfg, bool kAkk = false>
__global__ void KDAGEN_LAUNCH_BOUNDS(Cfg::kPrologueThreads, Cfg::kPrologueMinBlocks) prologue_kernel(PrologueArgs a) {
  // grid (H, chunks in rows of at most 65535, rows): heads fastest, no division
  const int chunk = static_cast<int>(blockIdx.z * gridDim.y + blockIdx.y);
  prologue_chunk<Cfg, kAkk, 0, 0>(a, static_cast<int>(blockIdx.x), chunk, BlockBarrier{});
}

// After the prologue has read every sequence's conv history: store each
// sequence's last W - 1 raw inputs as its new history (oldest first).
template <class Cfg>
__global__ void __launch_bounds__(256) conv_state_update_kernel(PrologueArgs a) {
  constexpr int W = Cfg::kConvWidth > 0 ? Cfg::kConvWidth : 1;
  constexpr int D = Cfg::kHeadDim;
  using T = io_t<Cfg::kIo>;
  const int n = blockIdx.y, H = a.num_heads;
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= 3 * H * D || W < 2) return;
  const int idx = a.conv_state_indices[n];
  if (idx < 0 || idx >= a.num_conv_slots) return;
  const bool hist = a.conv_has_initial_state != nullptr && a.conv_has_initial_state[n];
  const int bos = a.cu_seqlens[n], len = a.cu_seqlens[n + 1] - bos;
  const int band = ch / (H * D), h = (ch / D) % H, d = ch % D;
  const Strided& s = band == 0 ? a.q : (band == 1 ? a.k : a.v);
  float* row = a.conv_state + (static_cast<int64_t>(idx) * 3 * H * D + ch) * (W - 1);
  float next[W];
#pragma unroll
  for (int m = 0; m < W - 1; ++m) {
    const int p = len - (W - 1) + m;  // position relative to the sequence start
    if (p >= 0)
      next[m] = to_float<Cfg::kIo>(static_cast<const T*>(s.ptr)[
          static_cast<int64_t>(bos + p) * s.token + static_cast<int64_t>(h) * s.head + d]);
    else
      next[m] = hist ? row[(W - 1) + p] : 0.0f;
  }
#pragma unroll
  for (int m = 0; m < W - 1; ++m) row[m] = next[m];
}

}  // namespace kdagen
