// kdagen: the plain argument blocks the torch binding fills and the launchers
// read. No HIP, CUDA or torch types here: the binding and the kernels are separate
// translation units, compiled by different compilers.
#pragma once

#include <stdint.h>

namespace kdagen {

// The group scan's table of products per sequence holds at most G + P - 2 items (chunk.h
// ScanItem): the binding refuses more, the scan sizes its table by it, and
// kdagen/resources.py (MAX_SCAN_ITEMS) counts its LDS.
constexpr int kMaxScanItems = 254;

// Token-major activations [.., T, H, D]: element (t, h, d) at t * token + h * head + d.
struct Strided {
  const void* ptr;
  int64_t token;
  int64_t head;
};

struct RecurrentArgs {
  Strided q, k, v, g;           // [N, H, D], last dim contiguous
  Strided beta;                 // [N, H], element (n, h) at n * token + h * head
  const float* a_log;           // [H]
  const float* dt_bias;         // [H * D]
  float* state;                 // [slots, H, V, K] fp32
  const int32_t* state_indices; // [N]; negative skips the sequence
  void* out;                    // [N, H, V] contiguous
  int32_t num_seqs, num_heads, num_slots;
  float scale, lower_bound;
};

struct PrologueArgs {
  Strided q, k, v, g, beta;
  const float* a_log;
  const float* dt_bias;
  void* qg;     // [T, H, K]
  void* w;      // [T, H, K]
  void* u;      // [T, H, V]; not written with akk
  void* kg_t;   // [chunks, H, K, C]
  void* aqk;    // [T, H, C]
  float* decay; // [chunks, H, K]
  void* akk;    // [T, H, C]: (I + L)^-1 Diag(beta), in place of u (the chunk scan forms
                // u = akk v); nullptr: u is written
  const int32_t* cu_seqlens;     // [N + 1]
  const int32_t* chunk_indices;  // [chunks, 2]: (sequence, chunk in sequence)
  // Fused causal conv (conv_weight == nullptr: off).
  const float* conv_weight;           // [3 * H * D, W]  (q | k | v channels)
  float* conv_state;                  // [slots, 3 * H * D, W - 1]
  const int32_t* conv_state_indices;  // [N]; negative: zero history, no write
  const bool* conv_has_initial_state; // [N]
  int32_t num_chunks, num_heads, num_seqs, num_conv_slots;
  float scale, lower_bound;
};

struct ChunkArgs {
  const void* qg; const void* w;
  Strided u;                     // u [T, H, V], or with akk the raw v (last dim contiguous)
  const void* kg_t; const void* aqk;
  const float* decay;
  const void* akk;               // [T, H, C] or nullptr: with it u = akk v per chunk
  void* out;                     // [T, H, V]
  const int32_t* cu_seqlens;     // [N + 1]
  const int32_t* chunk_offsets;  // [N + 1]
  const float* initial_state;    // [N, H, V, K] or nullptr
  float* final_state;            // [N, H, V, K] or nullptr
  float* state_cache;            // [slots, H, V, K] or nullptr (replaces the two above)
  const int32_t* state_indices;  // [N]
  const bool* has_initial_state; // [N]
  float* checkpoint_state;                  // [rows, H, V, K] or nullptr
  const int32_t* checkpoint_offsets;        // [N] tokens; 0 disables
  const int32_t* checkpoint_state_indices;  // [N] or nullptr (then row = sequence)
  float* workspace;              // chunk groups: bg | rg | sin, see chunk.h
  int32_t num_seqs, num_heads, num_groups, num_slots, num_checkpoint_rows;
  int32_t num_segments;          // pass one's segments per sequence, 1 .. num_groups - 1
  float scale;
};

}  // namespace kdagen
