// kdagen: the chunk scan. The recurrent state walks the chunks of each sequence in
// order and the output of each chunk is formed on the way:
//
//   v_new = u - w S;   o = scale * qg S + aqk v_new;   S <- Diag(decay) S + kg^T v_new
//
// A block owns kBlockV state rows (values v) of one (sequence, head): S^T[v][k] in
// fp32 registers, 16 rows per wave, as 16x16 accumulator tiles. Every product
// takes the state (or v_new) from registers as the A operand (`to_a` moves no
// data) and its other operand from LDS, so waves share only the chunk's tiles (rows
// padded so that ldmatrix meets no bank conflicts, or with Cfg::kChunkSwizzle unpadded,
// their 16-byte pieces swizzled by row: swizzled<W>, lds_index, TileAt):
//   v_new^T = u^T - S^T w^T      o^T = scale S^T qg^T + v_new^T aqk^T
//   S^T     = S^T Diag(decay) + v_new^T kg
// With warpgroup products (Cfg::kChunkWgmma, sm_90a) four waves issue each product
// together over their 64 rows and the tensor cores read the LDS operand themselves: the
// w, qg, kg_t and aqk tiles are stored in the K-major core-matrix layout
// (wg::tile_index) and read once per warpgroup, not once per wave through ldmatrix.
//
// Chunk groups (DESIGN 2): the walk is affine, S_{c+1} = M_c S_c + kg_c^T u_c. Pass two
// cuts a sequence into G groups; pass one walks the chunks before the last group's start
// in P segments (num_segments, 1 <= P <= G - 1, kdagen/groups.py): one per group, or fewer
// that fill the compute units once and end between group starts (PassOneSegments).
//   pass one  (kMode 1, one per group; kMode 3, segments): per segment, from its start,
//             the zero-start state B (rows < V) and the transfer R = A^T (rows V..V+K,
//             started from the identity, u = 0), stored at every group start inside the
//             segment and at the segment's end. Segment 0 with Cfg::kPassOneLead (the
//             lead): from the true start X_0, state rows only, its B the true state.
//   scan      (group_scan_kernel): with X_s the true state at segment s's start,
//             S_start(g) = X_s R + B for the group starts in segment s, and
//             X_{s+1} = X_s R + B at its end; in fp32.
//   pass two  (kMode 2): each group walks again from its true start, with outputs.
// kMode 0 is the single walk. Workspace (fp32, planes of D*D per (slot, n*H+h), Q slots):
//   bg [Q][N*H][V][K] | rg [Q][N*H][K][K] | sin [Q][N*H][V][K]
// bg / rg slot g - 1 holds group g's start (g = 1 .. G - 1), slot G - 1 + s segment s's
// end where no group starts there; sin slot g group g's true start. Q = G + P - 2 (G for
// P = 1 and for P = G - 1, one segment per group: kWalkPassOne): workspace_slots.
//
// u from v (kAkk): the prologue may leave u = (I + L)^-1 Diag(b) v unformed and store
// akk = (I + L)^-1 Diag(b) (C x C per chunk) instead; the walk then reads the raw v rows
// in u's place and forms u^T = v^T akk^T on the matrix units (akk is lower triangular by
// 16-row blocks). Per token x head that moves C x 2 bytes of akk twice instead of u
// (V x 2 bytes) out of the prologue and back, and the prologue does not read v.
#pragma once

#include "launch_args.h"

namespace kdagen {

// kOutputs: the tiles of o (qg, aqk) are staged too; pass one walks without them.
// kAkk: the akk tile too (u from v), where u / o go through LDS.
// kTwoTiles: each wave walks two 16-row tiles (Cfg::kWalkPaired): half the waves.
template <class Cfg, bool kOutputs = true, bool kAkk = false, bool kTwoTiles = false>
struct ChunkLayout {
  static constexpr int C = Cfg::kChunk, D = Cfg::kHeadDim, BV = Cfg::kBlockV;
  static constexpr bool kWg = Cfg::kChunkWgmma;  // K-major core-matrix tiles (no padding)
  // Cfg::kChunkSwizzle: the per-wave walk's 16-bit tiles unpadded, their 16-byte pieces
  // swizzled by row (swizzled<W>) instead of rows padded by kPad16 (lds_index); pass one's
  // (no outputs) with Cfg::kChunkSwizzlePassOne
  static constexpr bool kSwz = (kOutputs ? Cfg::kChunkSwizzle : Cfg::kChunkSwizzlePassOne) && !kWg;
  static constexpr int kPad = kWg || kSwz ? 0 : Cfg::kPad16;
  static constexpr int LDW = D + kPad;  // w, qg tiles [C][LDW]
  static constexpr int LDC = C + kPad;  // kg_t [D][LDC], aqk [C][LDC]
  static constexpr int LDU = BV + (kSwz ? 0 : Cfg::kPad16);  // u in, o out [C][LDU] (kStageUO)
  // > 1: kStages - 1 chunks load ahead of this one (pass one, without outputs, its own count)
  static constexpr int kStages = kOutputs ? Cfg::kChunkStages : Cfg::kChunkStagesPassOne;
  static constexpr bool kAkkTile = kAkk && Cfg::kStageUO;
  static constexpr int kElems = (kOutputs ? 2 : 1) * C * LDW + D * LDC + (kOutputs ? C * LDC : 0) +
                                (kAkkTile ? C * LDC : 0) + (Cfg::kStageUO ? C * LDU : 0);
  static constexpr int kStageBytes = kElems * 2 + D * 4;
  static constexpr int kBytes = kStages * kStageBytes;
  static constexpr int kThreads = (BV / (kTwoTiles ? 32 : 16)) * kWaveSize;
  static_assert(kStageBytes % 16 == 0, "stages must stay 16-byte aligned");
  static_assert(!kTwoTiles || BV % 32 == 0, "paired rows take blocks of whole 32-row pairs");
  static_assert(!kWg || (BV % 64 == 0 && Cfg::kStageUO && kStages > 1),
                "warpgroup products take 64-row warpgroups, u / o through LDS and async copies");
  static_assert(!kWg || LDW == D, "warpgroup products read the w and qg tiles as one 2C-row tile");
};

// kWalkPassOneSegments: pass one in segments that end between group starts (num_segments
// < num_groups - 1); kWalkPassOne: one segment per group, each block one group's walk.
enum : int { kWalkSingle = 0, kWalkPassOne = 1, kWalkPassTwo = 2, kWalkPassOneSegments = 3 };
template <int kMode>
constexpr bool kIsPassOne = kMode == kWalkPassOne || kMode == kWalkPassOneSegments;

// Rows of a token-major [rows][H][width] tensor -> an LDS tile [rows][ld] (or swizzled,
// kSwz), zero past `valid`, as 16-byte copies (asynchronous where the hardware has them).
// The offsets inside one chunk's rows fit 32 bits (rows * row_stride < 2^31); only `src`
// is 64-bit.
template <int ROWS, int WIDTH, int LD, int NT, bool kSwz = false>
__device__ __forceinline__ void copy_rows(uint16_t* dst, const uint16_t* src, int row_stride,
                                          int valid) {
  constexpr int VEC = 8;  // 16 bytes
  constexpr int N = ROWS * WIDTH / VEC, ITERS = (N + NT - 1) / NT;
#pragma unroll
  for (int m = 0; m < ITERS; ++m) {
    const int e = threadIdx.x + m * NT;
    if (N % NT == 0 || e < N) {
      const int r = e / (WIDTH / VEC), c = (e % (WIDTH / VEC)) * VEC;
      const bool in = r < valid;  // else zero-filled, from row 0
      async::copy16(dst + lds_index<WIDTH, LD, kSwz>(r, c), src + ((in ? r : 0) * row_stride + c), in);
    }
  }
}

// The same into a K-major tile of ROWS rows and K columns (wg::tile_index): piece q of row
// r goes to core matrix (r / 8, q), row r % 8. Thread e takes piece e of the tile's
// order, so eight neighbouring threads fill one 128-byte core matrix (conflict-free) and
// read 16 bytes of eight rows each.
template <int ROWS, int K, int NT>
__device__ __forceinline__ void copy_tile(uint16_t* dst, const uint16_t* src, int row_stride, int valid) {
  constexpr int KP = K / 8, N = ROWS * KP, ITERS = (N + NT - 1) / NT;
#pragma unroll
  for (int m = 0; m < ITERS; ++m) {
    const int e = threadIdx.x + m * NT;
    if (N % NT == 0 || e < N) {
      const int r = (e / (8 * KP)) * 8 + (e & 7), q = (e >> 3) % KP;
      const bool in = r < valid;
      async::copy16(dst + 8 * e, in ? src + r * row_stride + 8 * q : src, in);
    }
  }
}

// An operand of the products: a K-major tile for the warpgroup products (kTile), else
// rows padded to LD for ldmatrix, or swizzled (kSwz).
template <bool kTile, int ROWS, int WIDTH, int LD, int NT, bool kSwz>
__device__ __forceinline__ void copy_operand(uint16_t* dst, const uint16_t* src, int row_stride, int valid) {
  if constexpr (kTile) copy_tile<ROWS, WIDTH, NT>(dst, src, row_stride, valid);
  else copy_rows<ROWS, WIDTH, LD, NT, kSwz>(dst, src, row_stride, valid);
}

// Workspace slots per (which, n*H+h): group starts G - 1 and segment ends P - 1 of bg / rg,
// at least G for sin (chunk groups above).
__device__ __forceinline__ int workspace_slots(int groups, int segments) {
  return segments > 1 && segments < groups - 1 ? groups + segments - 2 : groups;
}

template <class Cfg>
__device__ __forceinline__ float* group_plane(const ChunkArgs& a, int which, int slot, int nh) {
  constexpr int64_t P = static_cast<int64_t>(Cfg::kHeadDim) * Cfg::kHeadDim;
  const int64_t planes = static_cast<int64_t>(workspace_slots(a.num_groups, a.num_segments)) * a.num_seqs * a.num_heads;
  return a.workspace + which * planes * P + (static_cast<int64_t>(slot) * a.num_seqs * a.num_heads + nh) * P;
}

// Where the groups of a sequence of nc chunks start and where pass one's segments run:
// group g starts at chunk start_of_group(g) (g < G: spans of ceil(nc / G) chunks); pass one
// covers the chunks before the last group's start, `cover`, in P segments: segment 0 of
// `lead` chunks, then segments of `pspan`, segment s from seg_start(s) to seg_end(s). A group
// start p > 0 belongs to the segment it ends. With a lead weight (Cfg::kPassOneLead, in
// eighths of a segment; 0: none) segment 0 walks from the true start and is that much
// longer: lead = ceil(cover x w / (w + 8 (P - 1))); without, lead = pspan. from_x0: there
// is a lead (w > 0), whatever its length.
struct PassOneSegments {
  int nc, G, P, span, cover, lead, pspan;
  bool from_x0;
  __device__ __forceinline__ PassOneSegments(int nc_, int G_, int P_, int w = 0)
      : nc(nc_), G(G_), P(P_), from_x0(w > 0) {
    span = max(1, (nc + G - 1) / G);
    cover = min(nc, (G - 1) * span);
    if (w > 0 && P > 1) {
      const int64_t den = w + 8 * (P - 1);
      lead = static_cast<int>((static_cast<int64_t>(cover) * w + den - 1) / den);
      pspan = max(1, (cover - lead + P - 2) / (P - 1));
    } else {
      pspan = max(1, (cover + P - 1) / P);
      lead = min(cover, pspan);
    }
  }
  __device__ __forceinline__ int start_of_group(int g) const { return min(nc, g * span); }
  __device__ __forceinline__ int seg_start(int s) const { return s == 0 ? 0 : min(cover, lead + (s - 1) * pspan); }
  __device__ __forceinline__ int seg_end(int s) const { return s == 0 ? lead : min(cover, lead + s * pspan); }
  __device__ __forceinline__ int segment_of(int p) const { return p <= lead ? 0 : 1 + (p - lead - 1) / pspan; }
};

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

// Cfg::kPassOnePaired: a pass-one block walks V state rows and K transfer rows at once,
// each wave 16 of each (two 16-row tiles, S and S1): the w and kg_t fragments and the
// decay are read once for both, and each chunk is copied once per pair. The block holds
// twice the state registers (128 per lane on wave32) and runs alone on its compute unit
// (launch bound 1): the same state rows per unit as two unpaired blocks.
template <class Cfg, int kMode>
constexpr bool kPairedWalk = kIsPassOne<kMode> && Cfg::kPassOnePaired;

// Cfg::kWalkPaired: the walks with outputs (single, pass two) give each wave two 16-row
// tiles of V, rows row0 .. row0 + 31 (S and S1): the w, qg, kg_t, aqk and akk fragments
// and the decay are read once for both, in blocks of half the waves (the two tiles' state
// takes 128 registers a lane on wave32).
template <class Cfg, int kMode>
constexpr bool kPairedRows = !kIsPassOne<kMode> && Cfg::kWalkPaired;

// The walk of one block. kLead: pass one's lead segment (Cfg::kPassOneLead), which starts
// at chunk 0: it walks the state rows from the true start X_0 (the initial state) and no
// transfer rows, so its B is the true state (the scan takes it without a product).
template <class Cfg, int kMode, bool kAkk, bool kLead>
__device__ __forceinline__ void chunk_walk(const ChunkArgs& a) {
  constexpr DType Io = Cfg::kIo;
  using T = io_t<Io>;
  constexpr bool kPassOne = kIsPassOne<kMode>, kSegments = kMode == kWalkPassOneSegments;
  constexpr bool kOutputs = !kPassOne;
  constexpr bool kPairV = kPairedRows<Cfg, kMode>;  // two tiles of V rows per wave
  using Lay = ChunkLayout<Cfg, kOutputs, kAkk, kPairV>;
  constexpr int C = Lay::C, D = Lay::D, BV = Lay::BV, LDW = Lay::LDW, LDC = Lay::LDC;
  constexpr int NT = Lay::kThreads, KT = D / 16, CT = C / 16;
  constexpr bool kWg = Lay::kWg, kSwz = Lay::kSwz;
  // Cfg::kChunkWgUpdate: the per-wave walk's state update as warpgroup products (wgmma,
  // m64 x D x 16 per tile of four waves' rows, the accumulators the state in its mma.sync
  // layout, the kg tile K-major in core matrices), the v_new / o products per wave as
  // before; for blocks of whole warpgroups; in the walks with outputs only with
  // Cfg::kChunkWgUpdateOutputs.
  constexpr bool kWgU = Cfg::kChunkWgUpdate && (kPassOne || Cfg::kChunkWgUpdateOutputs) && !kWg &&
                        (NT / kWaveSize) % 4 == 0;
  static_assert(!kWgU || !kSwz, "the warpgroup state update reads a core-matrix kg tile");
  // Cfg::kPassOneWgVnew: pass one's v_new^T = (-S^T) w^T per warpgroup too (m64 x C x 16 per
  // k-slice, -S^T from registers, the w tile K-major in core matrices), beside that update.
  constexpr bool kWgV = kWgU && kPassOne && Cfg::kPassOneWgVnew;
  constexpr bool kPaired = kPairedWalk<Cfg, kMode> && !kLead;
  constexpr bool kTwo = kPaired || kPairV;  // a second tile, S1
  constexpr int RW = kPairV ? 32 : 16;      // state rows per wave
  static_assert(!kTwo || !kWg, "paired rows take the per-wave products");
  static_assert(sizeof(T) == 2, "the chunk scan takes 16-bit operands");

  KDAGEN_DYNAMIC_SHARED(smem);
  // One stage: w | [qg] | kg_t | [aqk] | [akk] | [u or v, then o] | decay (qg, aqk with
  // outputs, akk with u from v). Stage b of chunk c is b = c % kStages.
  struct Stage { uint16_t *Ws, *Qs, *KGs, *As, *Ak, *Us; float* Ds; };
  auto stage_at = [&](int b) {
    Stage st;
    st.Ws = reinterpret_cast<uint16_t*>(smem + b * Lay::kStageBytes);
    st.Qs = st.Ws + C * LDW;  // with outputs only
    st.KGs = st.Ws + (kOutputs ? 2 : 1) * C * LDW;
    st.As = st.KGs + D * LDC;  // with outputs only
    st.Ak = st.As + (kOutputs ? C * LDC : 0);  // with u from v only
    st.Us = st.Ak + (Lay::kAkkTile ? C * LDC : 0);
    st.Ds = reinterpret_cast<float*>(st.Us + (Cfg::kStageUO ? C * Lay::LDU : 0));
    return st;
  };
  // The 16 x 16 blocks of the per-wave products' tiles, as the vendor layer reads them.
  using WBlock = TileAt<D, LDW, kSwz, const uint16_t>;        // w, qg: C x D
  using CBlock = TileAt<C, LDC, kSwz, const uint16_t>;        // kg_t: D x C; aqk, akk: C x C
  using UBlock = TileAt<BV, Lay::LDU, kSwz, uint16_t>;        // u or v in, o out: C x BV

  const int H = a.num_heads, h = blockIdx.y;
  // Pass one walks its P segments, which cover the chunks before the last group's start
  // (the last group's end state and transfer are never used).
  const int G = kMode == kWalkSingle ? 1 : a.num_groups;
  const int GZ = kPassOne ? a.num_segments : G;  // groups (pass one: segments) in the grid's z
  const int n = blockIdx.z / GZ, g = blockIdx.z % GZ;         // (pass one: g is the segment)
  const int wave = wave_id();
  const int row0 = blockIdx.x * BV + RW * wave;  // this wave's first row (of V, or V + K in pass one)
  const int colw = RW * wave;  // ... its first column of the u / o tile
  const bool transfer = kPassOne && !kLead && blockIdx.x * BV >= D;
  const int bos = a.cu_seqlens[n], len = a.cu_seqlens[n + 1] - bos;
  const int cbase = a.chunk_offsets[n], nc = a.chunk_offsets[n + 1] - cbase;
  const PassOneSegments seg(nc, G, a.num_segments, Cfg::kPassOneLead);
  const int span = seg.span;
  const int c0 = kSegments ? seg.seg_start(g) : min(nc, g * span);
  const int c1 = kSegments ? seg.seg_end(g) : min(nc, c0 + span);
  const int last_group = nc == 0 ? 0 : (nc - 1) / span;
  const int nh = n * H + h;

  // ---- start state ----------------------------------------------------------------------
  // S holds the state negated, -S^T: then v_new^T = u^T + (-S^T) w^T needs no negated
  // copy of the state's fragments each chunk, only of v_new's (C / 16 of them) for the
  // update, and every load and store of a state plane flips the sign once.
  mma::Acc S[KT];
  // kPaired: the transfer rows row0 .. row0 + 15 of R, -R^T; kPairV: V rows row0 + 16 .. row0 + 31
  mma::Acc S1[kTwo ? KT : 1];
  const float* init = nullptr;
  if constexpr (kMode == kWalkSingle || kLead) init = initial_plane(a, n, h, D);
  if constexpr (kMode == kWalkPassTwo) init = group_plane<Cfg>(a, 2, g, nh);
  // (8-byte pieces where the vendor layer has them, mma::kStateRows, and the plane is 16-byte
  // aligned: the caller's initial_state may be 4-byte aligned only)
  const bool init16 = init != nullptr && reinterpret_cast<uintptr_t>(init) % 16 == 0;
  // Rows rowb .. rowb + 15 of the start state into St (or the identity rows of the
  // transfer, pass one's blocks past V).
  auto start_state = [&](mma::Acc (&St)[KT], int rowb) {
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      mma::zero(St[kt]);
      if constexpr (mma::kStateRows) {
        if (init16) {
          mma::load_rows_f32(St[kt], init + static_cast<int64_t>(rowb) * D + 16 * kt, D, -1.0f);
          continue;
        }
      }
      mma::for_each(St[kt], [&](int r, int k, float& x) {
        if (transfer) x = (rowb + r - D == 16 * kt + k) ? -1.0f : 0.0f;
        else if (init != nullptr) x = -init[static_cast<int64_t>(rowb + r) * D + 16 * kt + k];
      });
    }
  };
  start_state(S, row0);
  if constexpr (kPaired) {
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
      mma::for_each(S1[kt], [&](int r, int k, float& x) { x = (row0 + r == 16 * kt + k) ? -1.0f : 0.0f; });
  }
  if constexpr (kPairV) start_state(S1, row0 + 16);  // (never a transfer block)

  // The state (negated back) into a plane's rows from `row`: 8-byte pieces where the vendor
  // layer has them and the plane allows (a paged cache may be a 4-byte aligned view).
  auto store_state = [&](mma::Acc (&St)[KT], float* plane, int row) {
    if constexpr (mma::kStateRows) {
      if (reinterpret_cast<uintptr_t>(plane) % 16 == 0) {
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) mma::store_rows_f32(St[kt], plane + static_cast<int64_t>(row) * D + 16 * kt, D, -1.0f);
        return;
      }
    }
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
      mma::for_each(St[kt], [&](int r, int k, float& x) { plane[static_cast<int64_t>(row + r) * D + 16 * kt + k] = -x; });
  };

  // Pass one: the first group start inside the segment (a group start p > 0 belongs to the
  // segment it ends, PassOneSegments). The walk stops at each one before c1 and stores B and
  // R there (slot g' - 1); those at c1 are stored after it.
  int next_start = G;
  if constexpr (kSegments) {
    next_start = 1;
    while (next_start < G && seg.segment_of(seg.start_of_group(next_start)) < g) ++next_start;
  }
  // The state (B, and R: the transfer rows) so far into bg / rg slot `slot`.
  auto store_point = [&](int slot) {
    if constexpr (kWg) {
      wg::wait<0>();
      wg::fence_operands(S);
    }
    store_state(S, group_plane<Cfg>(a, transfer ? 1 : 0, slot, nh), transfer ? row0 - D : row0);  // (transfer: unpaired)
    if constexpr (kPaired) store_state(S1, group_plane<Cfg>(a, 1, slot, nh), row0);
  };

  const int ck_tokens = (!kPassOne && a.checkpoint_offsets != nullptr) ? a.checkpoint_offsets[n] : 0;
  const int64_t row_hd = static_cast<int64_t>(H) * D, row_hc = static_cast<int64_t>(H) * C;
  const int ld_hd = H * D, ld_hc = H * C;  // the same row strides, for offsets inside a chunk
  // u, or the raw v with akk: its own token / head strides (a view of a fused projection)
  const T* u = static_cast<const T*>(a.u.ptr);
  const int64_t u_row = a.u.token, u_head = a.u.head;
  const int ld_u = static_cast<int>(u_row);  // inside a chunk (checked on the host)
  const T* akk = static_cast<const T*>(a.akk);
  T* out = static_cast<T*>(a.out);

  const int col0 = blockIdx.x * BV;  // this block's first column of u / o
  // The copies take the chunks in order from c0: element offsets of the next chunk to
  // load, advanced by one chunk after each (no index products in the walk).
  int64_t next_hd = (bos + static_cast<int64_t>(c0) * C) * row_hd + h * D;  // [T][H][D] tensors
  int64_t next_hc = (bos + static_cast<int64_t>(c0) * C) * row_hc + h * C;  // aqk [T][H][C]
  int64_t next_ch = (static_cast<int64_t>(cbase + c0) * H + h) * D;         // decay [chunk][H][D]
  int64_t next_u = (bos + static_cast<int64_t>(c0) * C) * u_row + h * u_head + col0;  // u or v
  int next_rows = len - c0 * C;                                             // tokens from its first row
  // One 16-byte piece per thread of each w / qg / u and kg_t tile (and of aqk, decay for
  // the first threads): the piece's offsets are fixed for the walk, only the chunk's
  // 64-bit base moves.
  constexpr bool kOnePiece = !kWg && C * D / 8 == NT && C * BV / 8 == NT && D * C / 8 == NT &&
                             C * C / 8 <= NT && D / 4 <= NT;
  const int tid = threadIdx.x;
  const int pr = tid / (D / 8), pc = (tid % (D / 8)) * 8;  // w / qg / u piece: row, column
  const int p_off = pr * ld_hd + pc, p_dst = lds_index<D, LDW, kSwz>(pr, pc);
  // (kWgV: w's piece tid of the core-matrix order, copy_tile's: row wr, column wc)
  const int wr = (tid / D) * 8 + (tid & 7), wc = 8 * ((tid >> 3) % (D / 8));
  const int w_off = wr * ld_hd + wc, w_dst = 8 * tid;
  const int p_udst = lds_index<BV, Lay::LDU, kSwz>(pr, pc), pu_off = pr * ld_u + pc;
  const int ar = tid / (C / 8), ac = (tid % (C / 8)) * 8;  // aqk piece (tid < C * C / 8)
  const int a_off = ar * ld_hc + ac, a_dst = lds_index<C, LDC, kSwz>(ar, ac);
  const int k_dst = lds_index<C, LDC, kSwz>(tid / (C / 8), (tid % (C / 8)) * 8);  // kg_t piece tid of D * C
  // (kWgU: piece tid of the core-matrix order, copy_tile's: row r, piece q of the [D][C] source)
  const int k_src = kWgU ? ((tid / C) * 8 + (tid & 7)) * C + 8 * ((tid >> 3) % (C / 8)) : 8 * tid;
  // Issue the copies of the next chunk's operands into stage `st`.
  auto load_next = [&](const Stage& st) {
    const int valid = min(C, next_rows);
    if constexpr (kOnePiece) {
      const bool in = pr < valid;
      const int64_t o = next_hd + (in ? p_off : pc);  // zero-filled from row 0
      if constexpr (kWgV) {
        const bool w_in = wr < valid;
        async::copy16(st.Ws + w_dst, static_cast<const uint16_t*>(a.w) + next_hd + (w_in ? w_off : wc), w_in);
      } else {
        async::copy16(st.Ws + p_dst, static_cast<const uint16_t*>(a.w) + o, in);
      }
      if constexpr (!kPassOne) {
        async::copy16(st.Qs + p_dst, static_cast<const uint16_t*>(a.qg) + o, in);
        if (tid < C * C / 8) {
          const bool ain = ar < valid;
          async::copy16(st.As + a_dst, static_cast<const uint16_t*>(a.aqk) + next_hc + (ain ? a_off : ac), ain);
        }
      }
      async::copy16(st.KGs + (kWgU ? 8 * tid : k_dst), static_cast<const uint16_t*>(a.kg_t) + next_ch * C + k_src, true);
      if constexpr (Cfg::kStageUO) {
        if (!transfer) async::copy16(st.Us + p_udst, u + next_u + (in ? pu_off : pc), in);
      }
      if constexpr (Lay::kAkkTile) {
        if (!transfer && tid < C * C / 8) {
          const bool ain = ar < valid;
          async::copy16(st.Ak + a_dst, akk + next_hc + (ain ? a_off : ac), ain);
        }
      }
      if (tid < D / 4) async::copy16(st.Ds + 4 * tid, a.decay + next_ch + 4 * tid, true);
      async::commit();
      next_hd += C * row_hd;
      next_hc += C * row_hc;
      next_ch += static_cast<int64_t>(H) * D;
      next_u += C * u_row;
      next_rows -= C;
      return;
    }
    const uint16_t* kg_src = static_cast<const uint16_t*>(a.kg_t) + next_ch * C;  // kg_t [chunk][H][D][C]
    copy_operand<kWg || kWgV, C, D, LDW, NT, kSwz>(st.Ws, static_cast<const uint16_t*>(a.w) + next_hd, ld_hd, valid);
    if constexpr (!kPassOne) {
      copy_operand<kWg, C, D, LDW, NT, kSwz>(st.Qs, static_cast<const uint16_t*>(a.qg) + next_hd, ld_hd, valid);
      copy_operand<kWg, C, C, LDC, NT, kSwz>(st.As, static_cast<const uint16_t*>(a.aqk) + next_hc, ld_hc, valid);
    }
    copy_operand<kWg || kWgU, D, C, LDC, NT, kSwz>(st.KGs, kg_src, C, D);
    if constexpr (Cfg::kStageUO) {
      if (!transfer)
        copy_rows<C, BV, Lay::LDU, NT, kSwz>(st.Us, reinterpret_cast<const uint16_t*>(u) + next_u, ld_u, valid);
    }
    if constexpr (Lay::kAkkTile) {
      if (!transfer)
        copy_rows<C, C, LDC, NT, kSwz>(st.Ak, reinterpret_cast<const uint16_t*>(akk) + next_hc, ld_hc, valid);
    }
    copy_rows<1, D * 2, D * 2, NT>(reinterpret_cast<uint16_t*>(st.Ds),
                                   reinterpret_cast<const uint16_t*>(a.decay + next_ch), 0, 1);
    async::commit();
    next_hd += C * row_hd;
    next_hc += C * row_hc;
    next_ch += static_cast<int64_t>(H) * D;
    next_u += C * u_row;
    next_rows -= C;
  };
  // The first kStages - 1 chunks go in flight before the walk (a commit group per
  // chunk, empty past the end, so that every step waits on the same count).
  // With warpgroup products the state update of chunk c is still in flight at chunk c + 1's
  // barrier (it is waited for after it): the refill then takes the stage of chunk c - 2,
  // not c - 1, so AHEAD = kStages - 1 - LAG chunks load ahead.
  constexpr int SG = Lay::kStages, LAG = kWg ? 1 : 0, AHEAD = SG - 1 - LAG;
  static_assert(SG == 1 || AHEAD >= 1, "the warpgroup walk takes three stages or more");
  if constexpr (SG > 1) {
#pragma unroll
    for (int p = 0; p < AHEAD; ++p) {
      if (c0 + p < c1) load_next(stage_at(p));
      else async::commit();
    }
  }

  int c = c0;
  for (;;) {
  // (pass one stops at each group start inside its segment: positions next_start x span)
  const int stop = kSegments ? min(c1, next_start * span) : c1;
  for (; c < stop; ++c) {
    const int t0 = bos + c * C;
    const int valid = min(C, len - c * C);
    const Stage st = stage_at(SG > 1 ? (c - c0) % SG : 0);
    uint16_t *const Ws = st.Ws, *const Qs = st.Qs, *const KGs = st.KGs, *const As = st.As, *const Us = st.Us;
    const uint16_t* const Ak = st.Ak;
    const float* Ds = st.Ds;

    // ---- this chunk's operands in LDS (the next AHEAD chunks' copies in flight) -----------
    if constexpr (SG > 1) {
      async::wait<AHEAD - 1>();  // this thread's copies of chunk c have landed
      if constexpr (kWg || kWgU) wg::fence_async_smem();  // ... visible to the tensor cores' reads
      __syncthreads();  // everyone's have, and every reader of chunk c - 1 - LAG is done
      // refill chunk c - 1 - LAG's stage with chunk c + AHEAD
      if (c + AHEAD < c1) load_next(stage_at((c + AHEAD - c0) % SG));
      else async::commit();
    } else {
      __syncthreads();  // every reader of the stage about to be refilled is done
      load_next(st);
      async::wait<0>();
      __syncthreads();
    }

    // ---- v_new^T = u^T + (-S^T) w^T,  o^T = -(-S^T) qg^T ---------------------------------
    // (tile t of the wave: rows row0 + 16 t, columns colw + 16 t of the u / o tile; t = 1
    // only with kPairV)
    auto load_u_t = [&](mma::Acc& acc, int ct, int t) {
      if constexpr (Cfg::kStageUO) {
        mma::load_tile_t_at<Io>(acc, UBlock{Us, 16 * ct, colw + 16 * t});  // u -> u^T
      } else {
        mma::for_each(acc, [&](int r, int cc, float& x) {
          const int i = 16 * ct + cc;
          x = i < valid ? to_float<Io>(u[(t0 + i) * u_row + h * u_head + row0 + 16 * t + r]) : 0.0f;
        });
      }
    };
    mma::Acc vn[CT], o[CT];
    mma::Acc vn1[kTwo ? CT : 1], o1[kPairV ? CT : 1];  // S1's (kPaired: the transfer rows', u = 0)
#pragma unroll
    for (int ct = 0; ct < CT; ++ct) {
      mma::zero(vn[ct]);
      mma::zero(o[ct]);
      if constexpr (kPairV) {
        mma::zero(vn1[ct]);
        mma::zero(o1[ct]);
      }
      if (!transfer && !kAkk) {
        load_u_t(vn[ct], ct, 0);
        if constexpr (kPairV) load_u_t(vn1[ct], ct, 1);
      }
    }
    // u^T = v^T akk^T (kAkk): A = v^T (this wave's 16 rows of v, transposed out of the v
    // tile), B = akk^T, lower triangular by blocks (cj <= ct), accumulated into acc (and
    // with kPairV tile 1's into acc1, from the same B).
    auto v_t = [&](int cj, int t) {
      if constexpr (Cfg::kStageUO) {
        return mma::load_a_smem_t_at(UBlock{Us, 16 * cj, colw + 16 * t});
      } else {
        return mma::load_a<Io>([&](int r, int k) {
          const int i = 16 * cj + k;
          return i < valid ? to_float<Io>(u[(t0 + i) * u_row + h * u_head + row0 + 16 * t + r]) : 0.0f;
        });
      }
    };
    auto u_from_v = [&](mma::Acc (&acc)[CT], mma::Acc (&acc1)[kPairV ? CT : 1]) {
#pragma unroll
      for (int cj = 0; cj < CT; ++cj) {
        const mma::Frag vt = v_t(cj, 0);
        [[maybe_unused]] mma::Frag vt1;
        if constexpr (kPairV) vt1 = v_t(cj, 1);
#pragma unroll
        for (int ct = cj; ct < CT; ++ct) {
          mma::Frag b;
          if constexpr (Lay::kAkkTile) {
            b = mma::load_b_smem_at(CBlock{Ak, 16 * ct, 16 * cj});
          } else {
            b = mma::load_b<Io>([&](int nn, int k) {
              const int i = 16 * ct + nn;
              return i < valid ? to_float<Io>(akk[(t0 + i) * row_hc + h * C + 16 * cj + k]) : 0.0f;
            });
          }
          mma::mma<Io>(acc[ct], vt, b);
          if constexpr (kPairV) mma::mma<Io>(acc1[kPairV ? ct : 0], vt1, b);
        }
      }
    };
    // -S^T's k-slice kt (and S1's) times the chunk's decay: Diag(decay) of the update
    auto decay_slice = [&](int kt) {
      mma::for_each(S[kt], [&](int, int k, float& x) { x *= Ds[16 * kt + k]; });
      if constexpr (kTwo) mma::for_each(S1[kTwo ? kt : 0], [&](int, int k, float& x) { x *= Ds[16 * kt + k]; });
    };
    // Cfg::kChunkUApart: u^T in accumulators of its own, a chain beside the (-S^T) w^T
    // one, added at the end; else (and in the warpgroup walk) v_new^T starts from it.
    constexpr bool kApart = kAkk && !kWg && Cfg::kChunkUApart;
    mma::Acc ua[kApart ? CT : 1], ua1[kApart && kPairV ? CT : 1];
    if constexpr (kApart) {
#pragma unroll
      for (int ct = 0; ct < CT; ++ct) {
        mma::zero(ua[ct]);
        if constexpr (kPairV) mma::zero(ua1[ct]);
      }
      if (!transfer) u_from_v(ua, ua1);
    } else if constexpr (kAkk) {
      if (!transfer) u_from_v(vn, ua1);  // (ua1 unused: paired V rows take u apart)
    }
    static_assert(!kPairV || !kAkk || kApart, "paired V rows form u in accumulators of their own");
    // o's column tile ci of tile t into the wave's columns of the u / o tile (after every
    // lane of the wave has read its u there), then the wave's columns of o out, 32-byte row
    // segments per token and tile as two 16-byte stores each.
    auto stage_o = [&](int ci, mma::Acc& oc, int t) {
      if (ci == 0) wave_sync();
      mma::store_tile_t_at<Io>(oc, UBlock{Us, 16 * ci, colw + 16 * t});  // o^T -> o
    };
    // (a fixed count of pieces per lane, unrolled: as a loop from lane_id() nvcc built a
    // remainder loop and a four-way unrolled one around the one or two pieces a lane has)
    auto store_o = [&]() {
      wave_sync();
#pragma unroll
      for (int t = 0; t < (kPairV ? 2 : 1); ++t) {
        T* const oc = out + t0 * row_hd + h * D + row0 + 16 * t;  // this chunk's first row, the tile's columns
        const int col = colw + 16 * t;
        constexpr int PIECES = 2 * C, PER_LANE = (PIECES + kWaveSize - 1) / kWaveSize;
#pragma unroll
        for (int m = 0; m < PER_LANE; ++m) {
          const int e = lane_id() + m * kWaveSize;  // piece e of the tile's C rows x 32 bytes
          if constexpr (kSwz) {
            // swizzled: eight neighbouring lanes read one half of eight rows (eight bank
            // groups), the next eight the other half of the same rows (whole 32-byte segments)
            const int i = 8 * (e >> 4) + (e & 7), half = (e >> 3) & 1;
            if ((PIECES % kWaveSize == 0 || e < PIECES) && i < valid)
              *reinterpret_cast<uint4*>(oc + i * static_cast<int>(row_hd) + 8 * half) =
                  *reinterpret_cast<const uint4*>(Us + lds_index<BV, Lay::LDU, true>(i, col + 8 * half));
          } else {
            const int i = e >> 1, half = e & 1;
            if (i < valid)
              *reinterpret_cast<uint4*>(oc + i * static_cast<int>(row_hd) + 8 * half) =
                  *reinterpret_cast<const uint4*>(Us + i * Lay::LDU + col + 8 * half);
          }
        }
      }
    };

    if constexpr (kWg) {
      // The warpgroup's products: -S^T times the w and qg tiles as one operand of 2 C rows
      // (the qg tile follows the w tile in LDS: v_new^T and -S^T qg^T from one product),
      // KH k-slices per group (their bf16 -S^T stays in registers while in flight: KH =
      // KT / 2 keeps the walk within 128 registers); then v_new^T times the aqk and
      // (negated by the instruction) kg tiles.
      constexpr int KH = KT / 2, NV = kOutputs ? 2 * C : C;
      wg::wait<0>();  // the previous chunk's state update
      wg::fence_operands(S);
      mma::Acc vo[NV / 16];  // v_new^T | o^T
#pragma unroll
      for (int ct = 0; ct < CT; ++ct) {
        vo[ct] = vn[ct];
        if constexpr (kOutputs) vo[CT + ct] = o[ct];
      }
#pragma unroll
      for (int k0 = 0; k0 < KT; k0 += KH) {
        mma::Frag sa[KH];
#pragma unroll
        for (int j = 0; j < KH; ++j) {
          sa[j] = mma::to_a<Io>(S[k0 + j]);  // -S^T
          wg::fence_operands(sa[j]);
        }
        wg::fence_operands(vo);
        wg::fence();
#pragma unroll
        for (int j = 0; j < KH; ++j) wg::mma<NV, Io>(vo, sa[j], wg::desc(Ws, D, k0 + j));
        wg::commit();
        wg::wait<0>();
        wg::fence_operands(vo);
      }
#pragma unroll
      for (int ct = 0; ct < CT; ++ct) {
        vn[ct] = vo[ct];
        if constexpr (kOutputs) o[ct] = vo[CT + ct];
      }

      // o^T = -scale (-S^T qg^T) + v_new^T aqk^T (aqk is zero above its diagonal blocks);
      // -S^T = (-S^T) Diag(decay) - v_new^T kg
      mma::Frag va[CT];
#pragma unroll
      for (int ct = 0; ct < CT; ++ct) {
        va[ct] = mma::to_a<Io>(vn[ct]);
        wg::fence_operands(va[ct]);
        if constexpr (kOutputs) mma::for_each(o[ct], [&](int, int, float& x) { x *= -a.scale; });
      }
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) decay_slice(kt);
      wg::fence_operands(S);
      if constexpr (kOutputs) wg::fence_operands(o);
      wg::fence();
      if constexpr (kOutputs) {
#pragma unroll
        for (int ct = 0; ct < CT; ++ct) wg::mma<C, Io>(o, va[ct], wg::desc(As, C, ct));
        wg::commit();
      }
#pragma unroll
      for (int ct = 0; ct < CT; ++ct) wg::mma<D, Io, true>(S, va[ct], wg::desc(KGs, C, ct));
      wg::commit();  // waited for at the next chunk (after its barrier), or below
      if constexpr (kOutputs) {
        wg::wait<1>();  // o's products (the state update may still run)
        wg::fence_operands(o);
#pragma unroll
        for (int ci = 0; ci < CT; ++ci) stage_o(ci, o[ci], 0);
        store_o();
      }
    } else {
#pragma unroll
      for (int ct = 0; ct < (kPaired ? CT : 0); ++ct) mma::zero(vn1[ct]);
      if constexpr (kWgV) {
        // -S^T (and S1's) in bf16 for the whole product, then decayed for the update
        mma::Frag sa[KT], sa1[kTwo ? KT : 1];
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          sa[kt] = mma::to_a<Io>(S[kt]);
          wg::fence_operands(sa[kt]);
          if constexpr (kTwo) {
            sa1[kTwo ? kt : 0] = mma::to_a<Io>(S1[kTwo ? kt : 0]);
            wg::fence_operands(sa1[kTwo ? kt : 0]);
          }
          decay_slice(kt);
        }
        wg::fence_operands(vn);
        if constexpr (kTwo) wg::fence_operands(vn1);
        wg::fence();
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          wg::mma<C, Io>(vn, sa[kt], wg::desc(Ws, D, kt));
          if constexpr (kTwo) wg::mma<C, Io>(vn1, sa1[kTwo ? kt : 0], wg::desc(Ws, D, kt));
        }
        wg::commit();
        wg::wait<0>();
        wg::fence_operands(vn);
        if constexpr (kTwo) wg::fence_operands(vn1);
      } else {
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          const mma::Frag s = mma::to_a<Io>(S[kt]);  // -S^T
          [[maybe_unused]] const mma::Frag s1 = kTwo ? mma::to_a<Io>(S1[kTwo ? kt : 0]) : s;
          if constexpr (kWgU) {
            // the decay of the update, applied as soon as v_new has read the slice (the
            // warpgroup products below take the whole state at once)
            decay_slice(kt);
          }
#pragma unroll
          for (int ct = 0; ct < CT; ++ct) {
            const mma::Frag wb = mma::load_b_smem_at(WBlock{Ws, 16 * ct, 16 * kt});
            mma::mma<Io>(vn[ct], s, wb);
            if constexpr (kTwo) mma::mma<Io>(vn1[kTwo ? ct : 0], s1, wb);
            if constexpr (!kPassOne) {
              const mma::Frag qb = mma::load_b_smem_at(WBlock{Qs, 16 * ct, 16 * kt});
              mma::mma<Io>(o[ct], s, qb);
              if constexpr (kPairV) mma::mma<Io>(o1[kPairV ? ct : 0], s1, qb);
            }
          }
        }
      }
      if constexpr (kApart) {
#pragma unroll
        for (int ct = 0; ct < CT; ++ct) {
          mma::add(vn[ct], ua[ct]);
          if constexpr (kPairV) mma::add(vn1[kPairV ? ct : 0], ua1[kPairV ? ct : 0]);
        }
      }
      mma::Frag va[CT], va1[kTwo ? CT : 1];
#pragma unroll
      for (int ct = 0; ct < CT; ++ct) {
        va[ct] = mma::to_a<Io>(vn[ct]);
        if constexpr (kPairV) va1[kPairV ? ct : 0] = mma::to_a<Io>(vn1[kPairV ? ct : 0]);
      }

      // ---- o^T = -scale (-S^T qg^T) + v_new^T aqk^T (aqk is lower triangular by blocks) -----
      if constexpr (!kPassOne) {
        // (per tile: o^T scaled, plus v_new^T aqk^T, staged and stored; out_o writes o
        // element by element where u / o do not go through LDS)
        auto out_o = [&](mma::Acc& oc, int ci, int t) {
          mma::for_each(oc, [&](int r, int cc, float& x) {
            const int i = 16 * ci + cc;
            if (i < valid) out[(t0 + i) * row_hd + h * D + row0 + 16 * t + r] = from_float<Io>(x);
          });
        };
#pragma unroll
        for (int ci = 0; ci < CT; ++ci) {
          mma::for_each(o[ci], [&](int, int, float& x) { x *= -a.scale; });
          if constexpr (kPairV) mma::for_each(o1[kPairV ? ci : 0], [&](int, int, float& x) { x *= -a.scale; });
#pragma unroll
          for (int cj = 0; cj <= ci; ++cj) {
            const mma::Frag ab = mma::load_b_smem_at(CBlock{As, 16 * ci, 16 * cj});
            mma::mma<Io>(o[ci], va[cj], ab);
            if constexpr (kPairV) mma::mma<Io>(o1[kPairV ? ci : 0], va1[kPairV ? cj : 0], ab);
          }
          if constexpr (Cfg::kStageUO) {
            stage_o(ci, o[ci], 0);
            if constexpr (kPairV) stage_o(ci, o1[kPairV ? ci : 0], 1);
          } else {
            out_o(o[ci], ci, 0);
            if constexpr (kPairV) out_o(o1[kPairV ? ci : 0], ci, 1);
          }
        }
        if constexpr (Cfg::kStageUO) store_o();
      }

      // ---- -S^T = (-S^T) Diag(decay) + (-v_new^T) kg ----------------------------------------
      if constexpr (kWgU) {
        // per warpgroup (the state already scaled by the decay, above): D x 16 products
        // per tile pair, v_new^T negated by the instruction (scale-a -1), retired before
        // the step ends. (Retired after the next chunk's barrier instead, they need a
        // stage more and ptxas serialises them (C7515): pass one 0.454 -> 0.546 ms, H200.)
#pragma unroll
        for (int ct = 0; ct < CT; ++ct) {
          if constexpr (kPaired) va1[ct] = mma::to_a<Io>(vn1[ct]);
          wg::fence_operands(va[ct]);
          if constexpr (kTwo) wg::fence_operands(va1[kTwo ? ct : 0]);
        }
        wg::fence_operands(S);
        if constexpr (kTwo) wg::fence_operands(S1);
        wg::fence();
#pragma unroll
        for (int ct = 0; ct < CT; ++ct) {
          wg::mma<D, Io, true>(S, va[ct], wg::desc(KGs, C, ct));
          if constexpr (kTwo) wg::mma<D, Io, true>(S1, va1[kTwo ? ct : 0], wg::desc(KGs, C, ct));
        }
        wg::commit();
        wg::wait<0>();
        wg::fence_operands(S);
        if constexpr (kTwo) wg::fence_operands(S1);
      } else {
#pragma unroll
        for (int ct = 0; ct < CT; ++ct) {
          va[ct] = mma::neg(va[ct]);
          if constexpr (kPaired) va1[ct] = mma::neg(mma::to_a<Io>(vn1[ct]));
          if constexpr (kPairV) va1[kPairV ? ct : 0] = mma::neg(va1[kPairV ? ct : 0]);
        }
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          decay_slice(kt);
#pragma unroll
          for (int ct = 0; ct < CT; ++ct) {
            const mma::Frag kb = mma::load_b_smem_at(CBlock{KGs, 16 * kt, 16 * ct});
            mma::mma<Io>(S[kt], va[ct], kb);
            if constexpr (kTwo) mma::mma<Io>(S1[kTwo ? kt : 0], va1[kTwo ? ct : 0], kb);
          }
        }
      }
    }
    // ---- mid-prefill checkpoint: the state after the first ck_tokens tokens ----------------
    if (ck_tokens > 0 && (c + 1) * C == ck_tokens) {
      if constexpr (kWg) {
        wg::wait<0>();
        wg::fence_operands(S);
      }
      const int row = a.checkpoint_state_indices != nullptr ? a.checkpoint_state_indices[n] : n;
      if (row >= 0 && row < a.num_checkpoint_rows) {
        float* dst = a.checkpoint_state + (static_cast<int64_t>(row) * H + h) * D * D;
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          mma::for_each(S[kt], [&](int r, int k, float& x) { dst[static_cast<int64_t>(row0 + r) * D + 16 * kt + k] = -x; });
          if constexpr (kPairV)
            mma::for_each(S1[kPairV ? kt : 0], [&](int r, int k, float& x) { dst[static_cast<int64_t>(row0 + 16 + r) * D + 16 * kt + k] = -x; });
        }
      }
    }
  }
  if (!kSegments || c >= c1) break;
  store_point(next_start - 1);  // pass one: B and R at a group start inside the segment
  ++next_start;
  }

  // ---- where the walk's end state goes ---------------------------------------------------
  if constexpr (kWg) {
    wg::wait<0>();  // the last chunk's state update
    wg::fence_operands(S);
  }
  if constexpr (kMode == kWalkPassOne) {  // group g's end: group g + 1's start, slot g
    store_point(g);
    return;
  }
  if constexpr (kSegments) {
    // the group starts at c1 (several where they clamp to nc; at 0 for a sequence with no
    // chunks), then the segment's end where no group starts there
    bool end_is_start = false;
    for (; next_start < G && seg.segment_of(seg.start_of_group(next_start)) == g; ++next_start) {
      store_point(next_start - 1);
      end_is_start = seg.start_of_group(next_start) == c1;
    }
    if (g + 1 < a.num_segments && !end_is_start) store_point(G - 1 + g);
    return;
  }
  float* dst = nullptr;
  if (kMode == kWalkSingle || g == last_group) dst = final_plane(a, n, h, D);
  if (dst != nullptr) store_state(S, dst, row0);
  if constexpr (kPairV) {
    if (dst != nullptr) store_state(S1, dst, row0 + 16);
  }
}

template <class Cfg, int kMode, bool kAkk = false>
__global__ void KDAGEN_LAUNCH_BOUNDS((ChunkLayout<Cfg, true, false, kPairedRows<Cfg, kMode>>::kThreads),
                                     (kPairedWalk<Cfg, kMode> ? 1 : Cfg::kChunkMinBlocks)) chunk_kernel(ChunkArgs a) {
  if constexpr (kIsPassOne<kMode> && Cfg::kPassOneLead > 0) {
    if (blockIdx.z % a.num_segments == 0) {  // segment (or group) 0: the lead
      // (unpaired: the blocks past V would walk its transfer rows, which nobody reads)
      if (!kPairedWalk<Cfg, kMode> && blockIdx.x * Cfg::kBlockV >= Cfg::kHeadDim) return;
      chunk_walk<Cfg, kMode, kAkk, true>(a);
      return;
    }
  }
  chunk_walk<Cfg, kMode, kAkk, false>(a);
}

// The scan's products of one sequence, in order: for each segment s, the group starts in
// it (sin[g] = X_s R + B from bg / rg slot g - 1), then its end (X_{s+1} = X_s R + B: the
// last group start there, or slot G - 1 + s). With one segment per group (P = G - 1) that
// is S_start(g) = S_start(g - 1) R + B from slot g - 1, each item X. ScanItem packs the
// slot, the group whose start it is (or -1) and whether it is X_{s+1}. At most
// G + P - 2 <= kMaxScanItems items (launch_args.h; kdagen/checks.py keeps them so).
struct ScanItem {
  int16_t slot, group;
  bool next_x;
};

// Fills items (one thread) and returns their count. With a lead (seg.from_x0) segment 0's
// items, the first *num_lead, hold the true state in B already.
__device__ inline int scan_items(const PassOneSegments& seg, ScanItem* items, int* num_lead) {
  const bool lead = seg.from_x0;
  if (seg.P >= seg.G - 1) {
    for (int g = 1; g < seg.G; ++g) items[g - 1] = ScanItem{static_cast<int16_t>(g - 1), static_cast<int16_t>(g), true};
    *num_lead = lead && seg.G > 1 ? 1 : 0;
    return seg.G - 1;
  }
  *num_lead = 0;
  int count = 0, gs = 1;
  for (int s = 0; s < seg.P; ++s) {
    bool end_is_start = false;
    for (; gs < seg.G && seg.segment_of(seg.start_of_group(gs)) == s; ++gs) {
      end_is_start = seg.start_of_group(gs) == seg.seg_end(s);
      items[count++] = ScanItem{static_cast<int16_t>(gs - 1), static_cast<int16_t>(gs), false};
    }
    if (s + 1 < seg.P) {
      if (end_is_start) items[count - 1].next_x = true;
      else items[count++] = ScanItem{static_cast<int16_t>(seg.G - 1 + s), -1, true};
    }
    if (s == 0 && lead) *num_lead = count;
  }
  return count;
}

// S_start(0) = the initial state = X_0; then the items above. Writes every group's start
// state into the sin planes. Block: ROWS rows of one (n, h), X_s's rows in LDS (Sx); the
// launcher picks ROWS per call from the variant's choices (kernels.hip.j2, scan_rows_for).
// Only X chains from segment to segment: the transfer planes R stream through a ring of
// NS LDS tiles of kScanTile rows each, loaded ahead across the items
// (asynchronously where the target can), and B's rows are read at the start of their
// item. Thread (rg, c4) owns columns 4 c4 .. 4 c4 + 3 of rows rg + RG * m: a 16-byte read
// of R per k and one broadcast read of Sx per row.
template <class Cfg, int ROWS, int NS>
__global__ void __launch_bounds__(Cfg::kScanThreads) group_scan_kernel(ChunkArgs a) {
  constexpr int D = Cfg::kHeadDim, NT = Cfg::kScanThreads, KP = Cfg::kScanTile;
  constexpr int CG = D / 4, RG = NT / CG, RPT = ROWS / RG;  // column groups, row groups, rows per thread
  constexpr int TPG = D / KP, PIECES = KP * D / 4;          // tiles per item, 16-byte pieces per tile
  static_assert(NT % CG == 0 && ROWS % RG == 0 && D % KP == 0 && PIECES % NT == 0 && NS >= 2,
                "scan threads must tile the rows and the R tiles");
  __shared__ __align__(16) float Rs[NS][KP][D];
  __shared__ __align__(16) float Sx[ROWS][D];
  __shared__ ScanItem items[kMaxScanItems];
  __shared__ int num_items, num_lead;
  const int h = blockIdx.y, n = blockIdx.z, nh = n * a.num_heads + h;
  const int v0 = blockIdx.x * ROWS;
  const int tid = threadIdx.x, c4 = tid % CG, rg = tid / CG;
  if (tid == 0) {
    const PassOneSegments seg(a.chunk_offsets[n + 1] - a.chunk_offsets[n], a.num_groups, a.num_segments,
                              Cfg::kPassOneLead);
    num_items = scan_items(seg, items, &num_lead);
  }
  __syncthreads();
  // the R tiles: TPG per item after the lead items (which take B as it is)
  const int lead_items = num_lead, tiles = (num_items - lead_items) * TPG;
  auto row_of = [&](int m) { return rg + RG * m; };
  auto plane_row = [&](float* plane, int m) {
    return reinterpret_cast<float4*>(plane + static_cast<int64_t>(v0 + row_of(m)) * D + 4 * c4);
  };
  // tile i: rows (i % TPG) * KP .. + KP - 1 of item i / TPG's R, into slot i % NS
  auto load_tile = [&](int i) {
    if (i < tiles) {
      const float* src = group_plane<Cfg>(a, 1, items[lead_items + i / TPG].slot, nh) + (i % TPG) * KP * D;
#pragma unroll
      for (int j = 0; j < PIECES / NT; ++j) {
        const int e = tid + j * NT;
        async::copy16(&Rs[i % NS][0][0] + 4 * e, src + 4 * e, true);
      }
    }
    async::commit();  // (empty past the end: every wait below counts the same)
  };
#pragma unroll
  for (int i = 0; i < NS - 1; ++i) load_tile(i);

  const float* init = initial_plane(a, n, h, D);  // (the caller's: 4-byte aligned only)
  float4 acc[RPT];
#pragma unroll
  for (int m = 0; m < RPT; ++m) {
    acc[m] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (init != nullptr) {
      const float* x = init + static_cast<int64_t>(v0 + row_of(m)) * D + 4 * c4;
      acc[m] = make_float4(x[0], x[1], x[2], x[3]);
    }
    *plane_row(group_plane<Cfg>(a, 2, 0, nh), m) = acc[m];
    *reinterpret_cast<float4*>(&Sx[row_of(m)][4 * c4]) = acc[m];
  }
  for (int it = 0; it < num_items; ++it) {
    const ScanItem item = items[it];
    float4 b[RPT];  // B's rows, in flight during the products
#pragma unroll
    for (int m = 0; m < RPT; ++m) {
      b[m] = *plane_row(group_plane<Cfg>(a, 0, item.slot, nh), m);
      acc[m] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll 1  // (an unrolled item streams all its tiles at once: hipcc spilled at 8 rows)
    for (int q = 0; q < (it < lead_items ? 0 : TPG); ++q) {
      const int i = (it - lead_items) * TPG + q;
      async::wait<NS - 2>();  // this thread's pieces of tile i have landed
      __syncthreads();        // everyone's have, Sx is written, and slot (i - 1) % NS is free
      load_tile(i + NS - 1);
      const float(*R)[D] = Rs[i % NS];
#pragma unroll
      for (int kp = 0; kp < KP; ++kp) {
        const float4 r = *reinterpret_cast<const float4*>(&R[kp][4 * c4]);
#pragma unroll
        for (int m = 0; m < RPT; ++m) {
          const float x = Sx[row_of(m)][q * KP + kp];
          acc[m].x += x * r.x;
          acc[m].y += x * r.y;
          acc[m].z += x * r.z;
          acc[m].w += x * r.w;
        }
      }
    }
#pragma unroll
    for (int m = 0; m < RPT; ++m) {
      acc[m].x += b[m].x;
      acc[m].y += b[m].y;
      acc[m].z += b[m].z;
      acc[m].w += b[m].w;
      if (item.group >= 0) *plane_row(group_plane<Cfg>(a, 2, item.group, nh), m) = acc[m];
    }
    if (item.next_x) {
      __syncthreads();  // every read of X_s in Sx is done
#pragma unroll
      for (int m = 0; m < RPT; ++m) *reinterpret_cast<float4*>(&Sx[row_of(m)][4 * c4]) = acc[m];
    }
  }
}

}  // namespace kdagen
