// kdagen: the chunk scan. The recurrent state walks the chunks of each sequence in
// order and the output of each chunk is formed on the way:
//
//   v_new = u - w S;   o = scale * qg S + aqk v_new;   S <- Diag(decay) S + kg^T v_new
//
// A block owns kBlockV state rows (values v) of one (sequence, head): S^T[v][k] in
// fp32 registers, 16 rows per wave, as 16x16 accumulator tiles. Every product
// takes the state (or v_new) from registers as the A operand (`to_a` moves no
// data) and its other operand from LDS, so waves share only the chunk's tiles:
//   v_new^T = u^T - S^T w^T      o^T = scale S^T qg^T + v_new^T aqk^T
//   S^T     = S^T Diag(decay) + v_new^T kg
//
// Chunk groups (DESIGN 2): the walk is affine, S_{c+1} = M_c S_c + kg_c^T u_c.
//   pass one  (kMode 1): per group, the zero-start state B_g (rows < V) and the
//             transfer R_g = A_g^T (rows V..V+K, started from the identity, u = 0).
//   scan      (group_scan_kernel): S_start(g+1) = S_start(g) R_g + B_g, in fp32.
//   pass two  (kMode 2): each group walks again from its true start, with outputs.
// kMode 0 is the single walk. Workspace (fp32, planes of D*D per (group, n*H+h)):
//   bg [G][N*H][V][K] | rg [G][N*H][K][K] | sin [G][N*H][V][K]
#pragma once

#include "launch_args.h"

namespace kdagen {

template <class Cfg>
struct ChunkLayout {
  static constexpr int C = Cfg::kChunk, D = Cfg::kHeadDim, BV = Cfg::kBlockV;
  static constexpr int LDW = D + Cfg::kPad16;  // w, qg tiles [C][LDW]
  static constexpr int LDC = C + Cfg::kPad16;  // kg_t [D][LDC], aqk [C][LDC]
  static constexpr int kElems = 2 * C * LDW + D * LDC + C * LDC;
  static constexpr int kBytes = kElems * 2 + D * 4;
  static constexpr int kThreads = (BV / 16) * kWaveSize;
};

enum : int { kWalkSingle = 0, kWalkPassOne = 1, kWalkPassTwo = 2 };

// Rows of a token-major [rows][H][width] tensor -> an LDS tile [rows][ld], zero past `valid`.
template <int ROWS, int WIDTH, int LD, int NT>
__device__ __forceinline__ void stage_rows(uint16_t* dst, const uint16_t* src, int64_t row_stride,
                                           int valid) {
  constexpr int VEC = 8;  // 16 bytes
  for (int e = threadIdx.x; e < ROWS * WIDTH / VEC; e += NT) {
    const int r = e / (WIDTH / VEC), c = (e % (WIDTH / VEC)) * VEC;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (r < valid) x = *reinterpret_cast<const uint4*>(src + r * row_stride + c);
    *reinterpret_cast<uint4*>(dst + r * LD + c) = x;
  }
}

template <class Cfg>
__device__ __forceinline__ float* group_plane(const ChunkArgs& a, int which, int g, int nh) {
  constexpr int64_t P = static_cast<int64_t>(Cfg::kHeadDim) * Cfg::kHeadDim;
  const int64_t planes = static_cast<int64_t>(a.num_groups) * a.num_seqs * a.num_heads;
  return a.workspace + which * planes * P + (static_cast<int64_t>(g) * a.num_seqs * a.num_heads + nh) * P;
}

// The fp32 start state of (n, h): initial_state, the paged cache row, or zero.
__device__ __forceinline__ const float* initial_plane(const ChunkArgs& a, int n, int h, int D) {
  const int64_t P = static_cast<int64_t>(D) * D;
  if (a.state_cache != nullptr) {
    const bool has = a.has_initial_state == nullptr || a.has_initial_state[n];
    const int slot = a.state_indices[n];
    if (!has || slot < 0 || slot >= a.num_slots) return nullptr;
    return a.state_cache + (static_cast<int64_t>(slot) * a.num_heads + h) * P;
  }
  if (a.initial_state != nullptr) return a.initial_state + (static_cast<int64_t>(n) * a.num_heads + h) * P;
  return nullptr;
}

__device__ __forceinline__ float* final_plane(const ChunkArgs& a, int n, int h, int D) {
  const int64_t P = static_cast<int64_t>(D) * D;
  if (a.state_cache != nullptr) {
    const int slot = a.state_indices[n];
    if (slot < 0 || slot >= a.num_slots) return nullptr;
    return a.state_cache + (static_cast<int64_t>(slot) * a.num_heads + h) * P;
  }
  if (a.final_state != nullptr) return a.final_state + (static_cast<int64_t>(n) * a.num_heads + h) * P;
  return nullptr;
}

template <class Cfg, int kMode>
__global__ void __launch_bounds__(ChunkLayout<Cfg>::kThreads) chunk_kernel(ChunkArgs a) {
  constexpr DType Io = Cfg::kIo;
  using T = io_t<Io>;
  using Lay = ChunkLayout<Cfg>;
  constexpr int C = Lay::C, D = Lay::D, BV = Lay::BV, LDW = Lay::LDW, LDC = Lay::LDC;
  constexpr int NT = Lay::kThreads, KT = D / 16, CT = C / 16;
  static_assert(sizeof(T) == 2, "the chunk scan takes 16-bit operands");

  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* Ws = reinterpret_cast<uint16_t*>(smem);
  uint16_t* Qs = Ws + C * LDW;
  uint16_t* KGs = Qs + C * LDW;
  uint16_t* As = KGs + D * LDC;
  float* Ds = reinterpret_cast<float*>(As + C * LDC);

  const int H = a.num_heads, h = blockIdx.y;
  const int G = kMode == kWalkSingle ? 1 : a.num_groups;
  const int n = blockIdx.z / G, g = blockIdx.z % G;
  const int wave = wave_id();
  const int row0 = blockIdx.x * BV + 16 * wave;  // this wave's first row (of V, or V + K in pass one)
  const bool transfer = kMode == kWalkPassOne && blockIdx.x * BV >= D;
  const int bos = a.cu_seqlens[n], len = a.cu_seqlens[n + 1] - bos;
  const int cbase = a.chunk_offsets[n], nc = a.chunk_offsets[n + 1] - cbase;
  const int span = max(1, (nc + G - 1) / G);
  const int c0 = min(nc, g * span), c1 = min(nc, c0 + span);
  const int last_group = nc == 0 ? 0 : (nc - 1) / span;
  const int nh = n * H + h;

  // ---- start state ----------------------------------------------------------------------
  mma::Acc S[KT];
  const float* init = nullptr;
  if constexpr (kMode == kWalkSingle) init = initial_plane(a, n, h, D);
  if constexpr (kMode == kWalkPassTwo) init = group_plane<Cfg>(a, 2, g, nh);
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    mma::zero(S[kt]);
    mma::for_each(S[kt], [&](int r, int k, float& x) {
      if (transfer) x = (row0 + r - D == 16 * kt + k) ? 1.0f : 0.0f;
      else if (init != nullptr) x = init[static_cast<int64_t>(row0 + r) * D + 16 * kt + k];
    });
  }

  const int ck_tokens = (kMode != kWalkPassOne && a.checkpoint_offsets != nullptr) ? a.checkpoint_offsets[n] : 0;
  const int64_t row_hd = static_cast<int64_t>(H) * D, row_hc = static_cast<int64_t>(H) * C;
  const T* u = static_cast<const T*>(a.u);
  T* out = static_cast<T*>(a.out);

  for (int c = c0; c < c1; ++c) {
    const int chunk = cbase + c;
    const int t0 = bos + c * C;
    const int valid = min(C, len - c * C);

    // ---- stage this chunk's operands ------------------------------------------------------
    __syncthreads();  // the previous chunk's readers are done
    stage_rows<C, D, LDW, NT>(Ws, static_cast<const uint16_t*>(a.w) + t0 * row_hd + h * D, row_hd, valid);
    if constexpr (kMode != kWalkPassOne) {
      stage_rows<C, D, LDW, NT>(Qs, static_cast<const uint16_t*>(a.qg) + t0 * row_hd + h * D, row_hd, valid);
      stage_rows<C, C, LDC, NT>(As, static_cast<const uint16_t*>(a.aqk) + t0 * row_hc + h * C, row_hc, valid);
    }
    stage_rows<D, C, LDC, NT>(KGs, static_cast<const uint16_t*>(a.kg_t) + (static_cast<int64_t>(chunk) * H + h) * D * C,
                              C, D);
    for (int k = threadIdx.x; k < D; k += NT) Ds[k] = a.decay[(static_cast<int64_t>(chunk) * H + h) * D + k];
    __syncthreads();

    // ---- v_new^T = u^T - S^T w^T,  o^T = S^T qg^T ----------------------------------------
    mma::Acc vn[CT], o[CT];
#pragma unroll
    for (int ct = 0; ct < CT; ++ct) {
      mma::zero(vn[ct]);
      mma::zero(o[ct]);
      if (!transfer) {
        mma::for_each(vn[ct], [&](int r, int cc, float& x) {
          const int i = 16 * ct + cc;
          x = i < valid ? to_float<Io>(u[(t0 + i) * row_hd + h * D + row0 + r]) : 0.0f;
        });
      }
    }
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      const mma::Frag s = mma::to_a<Io>(S[kt]);
      const mma::Frag sneg = mma::neg(s);
#pragma unroll
      for (int ct = 0; ct < CT; ++ct) {
        mma::mma<Io>(vn[ct], sneg, mma::load_b_smem(Ws + (16 * ct) * LDW + 16 * kt, LDW));
        if constexpr (kMode != kWalkPassOne)
          mma::mma<Io>(o[ct], s, mma::load_b_smem(Qs + (16 * ct) * LDW + 16 * kt, LDW));
      }
    }
    mma::Frag va[CT];
#pragma unroll
    for (int ct = 0; ct < CT; ++ct) va[ct] = mma::to_a<Io>(vn[ct]);

    // ---- o^T = scale o^T + v_new^T aqk^T (aqk is lower triangular by blocks) ----------------
    if constexpr (kMode != kWalkPassOne) {
#pragma unroll
      for (int ci = 0; ci < CT; ++ci) {
        mma::for_each(o[ci], [&](int, int, float& x) { x *= a.scale; });
#pragma unroll
        for (int cj = 0; cj <= ci; ++cj)
          mma::mma<Io>(o[ci], va[cj], mma::load_b_smem(As + (16 * ci) * LDC + 16 * cj, LDC));
        mma::for_each(o[ci], [&](int r, int cc, float& x) {
          const int i = 16 * ci + cc;
          if (i < valid) out[(t0 + i) * row_hd + h * D + row0 + r] = from_float<Io>(x);
        });
      }
    }

    // ---- S^T = S^T Diag(decay) + v_new^T kg ----------------------------------------------
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      mma::for_each(S[kt], [&](int, int k, float& x) { x *= Ds[16 * kt + k]; });
#pragma unroll
      for (int ct = 0; ct < CT; ++ct)
        mma::mma<Io>(S[kt], va[ct], mma::load_b_smem(KGs + (16 * kt) * LDC + 16 * ct, LDC));
    }

    // ---- mid-prefill checkpoint: the state after the first ck_tokens tokens ----------------
    if (ck_tokens > 0 && (c + 1) * C == ck_tokens) {
      const int row = a.checkpoint_state_indices != nullptr ? a.checkpoint_state_indices[n] : n;
      if (row >= 0 && row < a.num_checkpoint_rows) {
        float* dst = a.checkpoint_state + (static_cast<int64_t>(row) * H + h) * D * D;
#pragma unroll
        for (int kt = 0; kt < KT; ++kt)
          mma::for_each(S[kt], [&](int r, int k, float& x) { dst[static_cast<int64_t>(row0 + r) * D + 16 * kt + k] = x; });
      }
    }
  }

  // ---- where the walk's end state goes ---------------------------------------------------
  float* dst = nullptr;
  int drow = row0;
  if constexpr (kMode == kWalkPassOne) {
    dst = group_plane<Cfg>(a, transfer ? 1 : 0, g, nh);
    if (transfer) drow = row0 - D;
  } else if (kMode == kWalkSingle || g == last_group) {
    dst = final_plane(a, n, h, D);
  }
  if (dst != nullptr) {
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
      mma::for_each(S[kt], [&](int r, int k, float& x) { dst[static_cast<int64_t>(drow + r) * D + 16 * kt + k] = x; });
  }
}

// S_start(0) = the initial state; S_start(g + 1) = S_start(g) R_g + B_g. Writes every
// group's start state into the sin planes. Block: kScanRows rows of one (n, h).
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kScanThreads) group_scan_kernel(ChunkArgs a) {
  constexpr int D = Cfg::kHeadDim, ROWS = Cfg::kScanRows, NT = Cfg::kScanThreads;
  constexpr int RPT = ROWS * D / NT;  // rows per thread, all in one column
  static_assert(NT % D == 0 && ROWS % (NT / D) == 0, "scan threads must tile the rows");
  __shared__ float Sx[ROWS][D];
  const int h = blockIdx.y, n = blockIdx.z, nh = n * a.num_heads + h;
  const int v0 = blockIdx.x * ROWS;
  const int k = threadIdx.x % D, rsub = threadIdx.x / D;
  const float* init = initial_plane(a, n, h, D);
  float acc[RPT];
#pragma unroll
  for (int m = 0; m < RPT; ++m) {
    const int r = rsub + m * (NT / D);
    acc[m] = init != nullptr ? init[static_cast<int64_t>(v0 + r) * D + k] : 0.0f;
  }
  for (int g = 0; g < a.num_groups; ++g) {
    float* sin = group_plane<Cfg>(a, 2, g, nh);
#pragma unroll
    for (int m = 0; m < RPT; ++m) {
      const int r = rsub + m * (NT / D);
      sin[static_cast<int64_t>(v0 + r) * D + k] = acc[m];
      Sx[r][k] = acc[m];
    }
    if (g + 1 == a.num_groups) break;
    __syncthreads();
    const float* R = group_plane<Cfg>(a, 1, g, nh);
    const float* B = group_plane<Cfg>(a, 0, g, nh);
#pragma unroll
    for (int m = 0; m < RPT; ++m) acc[m] = B[static_cast<int64_t>(v0 + rsub + m * (NT / D)) * D + k];
    for (int kp = 0; kp < D; ++kp) {
      const float rv = R[static_cast<int64_t>(kp) * D + k];
#pragma unroll
      for (int m = 0; m < RPT; ++m) acc[m] += Sx[rsub + m * (NT / D)][kp] * rv;
    }
    __syncthreads();
  }
}

}  // namespace kdagen
