// kdagen: the recurrent (decode) kernel. One token per sequence per launch; the
// fp32 state lives in a paged cache [slots, H, V, K] addressed by state_indices.
//
// A block owns kRecurrentRows state rows (values v) of one (sequence, head); each
// wave walks its rows one at a time, its lanes spread over K (coalesced rows).
//   S_t = (I - b k k^T) Diag(exp g) S_{t-1} + b k v^T,  o = scale * S_t^T q
// per state row v (a K-vector s):  s <- e^g * s;  s <- s + b k (v_v - k.s);  o_v = scale q.s
#pragma once

#include "launch_args.h"

namespace kdagen {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kRecurrentWaves * kWaveSize)
    recurrent_kernel(RecurrentArgs a) {
  constexpr DType Io = Cfg::kIo;
  using T = io_t<Io>;
  constexpr int D = Cfg::kHeadDim;
  constexpr int PER = D / kWaveSize;  // K elements per lane
  constexpr int ROWS_PER_WAVE = Cfg::kRecurrentRows / Cfg::kRecurrentWaves;
  static_assert(D % kWaveSize == 0, "head dim must be a multiple of the wave size");

  const int n = blockIdx.z, h = blockIdx.y;
  const int lane = lane_id();
  const int row0 = blockIdx.x * Cfg::kRecurrentRows + wave_id() * ROWS_PER_WAVE;
  const int H = a.num_heads;
  T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(n) * H + h) * D;

  const int slot = a.state_indices[n];
  if (slot < 0 || slot >= a.num_slots) {  // padding entry: no state, zero output
    if (lane < ROWS_PER_WAVE) out[row0 + lane] = from_float<Io>(0.0f);
    return;
  }

  auto at = [&](const Strided& s, int d) -> float {
    return to_float<Io>(static_cast<const T*>(s.ptr)[n * s.token + h * s.head + d]);
  };

  float q[PER], k[PER], eg[PER];
  float qq = 0.0f, kk = 0.0f;
  const float a_exp = __expf(a.a_log[h]);
#pragma unroll
  for (int e = 0; e < PER; ++e) {
    const int d = lane + e * kWaveSize;
    q[e] = at(a.q, d);
    k[e] = at(a.k, d);
    qq += q[e] * q[e];
    kk += k[e] * k[e];
    const float x = at(a.g, d) + a.dt_bias[h * D + d];
    eg[e] = exp2f(gate_log2<Cfg::kLowerBound>(x, a_exp, a.lower_bound));
  }
  const float rq = rnorm(wave_sum(qq)), rk = rnorm(wave_sum(kk));
#pragma unroll
  for (int e = 0; e < PER; ++e) {
    q[e] *= rq;
    k[e] *= rk;
  }
  const float beta = sigmoid(to_float<Io>(
      static_cast<const T*>(a.beta.ptr)[n * a.beta.token + h * a.beta.head]));

  float* state = a.state + (static_cast<int64_t>(slot) * H + h) * D * D;
  for (int r = 0; r < ROWS_PER_WAVE; ++r) {
    const int v = row0 + r;
    float* srow = state + static_cast<int64_t>(v) * D;
    float s[PER];
    float ks = 0.0f;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      s[e] = srow[lane + e * kWaveSize] * eg[e];
      ks += k[e] * s[e];
    }
    const float delta = beta * (at(a.v, v) - wave_sum(ks));
    float qs = 0.0f;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      s[e] += k[e] * delta;
      qs += q[e] * s[e];
      srow[lane + e * kWaveSize] = s[e];
    }
    qs = wave_sum(qs);
    if (lane == 0) out[v] = from_float<Io>(a.scale * qs);
  }
}

}  // namespace kdagen
