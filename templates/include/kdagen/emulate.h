// kdagen: a CPU emulation of the device environment, so that the generated kernels run
// (slowly, exactly as written) where there is no GPU: CI and the emulated tests.
//
// Compile a rendered kernels.hip as C++20 with -DKDAGEN_EMULATE (AMD flavour: wave 64,
// MFMA 16x16x16) or -DKDAGEN_EMULATE -DKDAGEN_EMULATE_NVIDIA (wave 32, mma.sync m16n8k16,
// cp.async). Every GPU thread of a block is a std::thread; blocks run one after another,
// in an order a GPU could also take (KDAGEN_EMULATE_BLOCK_ORDER: shuffle (the default,
// a fixed seed per launch: reproducible), forward or reverse), so a block that writes into
// a neighbour's rows is not hidden by the neighbour writing them again after it.
//   __syncthreads            a barrier of the block's threads
//   bar.sync id, count       a barrier of `count` threads, made at its first arrival
//   wave collectives         shuffles and matrix instructions meet at a barrier of the
//                            wave's threads, exchange operands through a wave scratchpad;
//                            so do ldmatrix / stmatrix (x4, .trans), from the row address
//                            each lane names, so the NVIDIA layer's LDS fragment loads run
//                            the hardware's own address code here
//   dynamic shared memory    one buffer per block, filled with NaN bytes before it starts
//                            (a read of anything the block did not write shows up)
//   wgmma                    products run at the wait that retires them (see WgOp)
//   barrier stagger          KDAGEN_EMULATE_STAGGER_US=n (read per launch): after every
//                            block barrier wave w waits w n microseconds (n < 0: the
//                            last wave leaves first), so one wave runs its whole phase
//                            before the next starts and a missing barrier reads stale data
//   cp.async                 KDAGEN_EMULATE_LATE_COPIES=1 holds each copy back until the
//                            latest wait_group that must have landed it (a miscounted
//                            group then reads stale or NaN data)
//   hipLaunchKernelGGL       runs the grid
//   hipDeviceGetAttribute    the compute units: KDAGEN_EMULATE_CUS (default 8)
//   hipOccupancyMax...       resident blocks: KDAGEN_EMULATE_RESIDENT (default 0: unknown)
// Matrix layouts follow the ISA documents: mma.sync m16n8k16 (PTX ISA, lane = 4 g + t)
// and v_mfma_f32_16x16x16 (CDNA ISA: A[i][k] in lane i + 16 (k / 4), element k % 4;
// B[k][j] in lane j + 16 (k / 4); D[i][j] in lane j + 16 (i / 4), element i % 4).
#pragma once

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(KDAGEN_EMULATE_NVIDIA)
#define KDAGEN_NVIDIA 1
#else
#define KDAGEN_AMD 1
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static  // blocks run one at a time: one instance serves each block

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
inline thread_local dim3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0};
inline dim3 blockDim, gridDim;

struct __attribute__((aligned(16))) uint4 { uint32_t x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __logf(float x) { return std::log(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __uint_as_float(uint32_t u) { return __builtin_bit_cast(float, u); }
inline uint32_t __float_as_uint(float f) { return __builtin_bit_cast(uint32_t, f); }
using std::exp2f;
using std::log1pf;
using std::max;
using std::min;

namespace kdagen_emu {

constexpr int kWave =
#if defined(KDAGEN_EMULATE_NVIDIA)
    32;
#else
    64;
#endif

struct Wave {
  std::unique_ptr<std::barrier<>> bar;
  float f[64];                 // shuffles
  float a[64][8], b[64][8];    // matrix operands, as floats
  uint16_t* rows[64];          // ldmatrix / stmatrix: each lane's row address
  uint32_t regs[64][4];        // stmatrix: each lane's registers
};

struct Block {
  unsigned char* smem = nullptr;
  std::unique_ptr<std::barrier<>> bar;
  std::vector<std::unique_ptr<Wave>> waves;
  std::mutex named_mutex;  // named barriers: made by their first arrival, with its count
  std::unique_ptr<std::barrier<>> named[16];
  int named_count[16] = {};
};
inline Block block;

inline Wave& my_wave() { return *block.waves[threadIdx.x / kWave]; }
inline int my_lane() { return static_cast<int>(threadIdx.x % kWave); }
inline unsigned char* smem() { return block.smem; }
// KDAGEN_EMULATE_STAGGER_US of the running launch (0: threads leave barriers at once)
inline int stagger_us = 0;
// After a block barrier: wave w waits w n microseconds (n > 0), or (waves - 1 - w) |n|.
inline void stagger() {
  if (stagger_us == 0) return;
  const int w = static_cast<int>(threadIdx.x) / kWave, nw = static_cast<int>(block.waves.size());
  const int steps = stagger_us > 0 ? w : nw - 1 - w;
  std::this_thread::sleep_for(std::chrono::microseconds(static_cast<long>(steps) * std::abs(stagger_us)));
}
inline void syncthreads() {
  block.bar->arrive_and_wait();
  stagger();
}
inline void wave_barrier() { my_wave().bar->arrive_and_wait(); }
// bar.sync id, count: the first thread to arrive makes the barrier; every later use of the
// id in the block must name the same count.
inline void named_barrier(int id, int count) {
  std::barrier<>* bar;
  {
    std::lock_guard<std::mutex> lock(block.named_mutex);
    if (!block.named[id]) {
      block.named[id] = std::make_unique<std::barrier<>>(count);
      block.named_count[id] = count;
    } else if (block.named_count[id] != count) {
      std::fprintf(stderr, "kdagen emulate: named barrier %d used with %d and %d threads\n", id,
                   block.named_count[id], count);
      std::abort();
    }
    bar = block.named[id].get();
  }
  bar->arrive_and_wait();
  stagger();
}
// 2^x with results below 2^-126 flushed to zero (the hardware forms of exp2_fast)
inline float exp2_ftz(float x) {
  const float y = std::exp2(x);
  return y < 0x1p-126f ? 0.0f : y;
}
// log2(x) for log2_fast, whose arguments lie in [1, 2] (no subnormals to flush)
inline float log2_approx(float x) { return std::log2(x); }
// Stop the run on an address the hardware instruction would fault on (or misread).
inline void require_aligned(const void* p, uintptr_t bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0) {
    std::fprintf(stderr, "kdagen emulate: misaligned %s (%p)\n", what, p);
    std::abort();
  }
}

inline float shfl_xor(float x, int o) {
  Wave& w = my_wave();
  const int l = my_lane();
  w.f[l] = x;
  w.bar->arrive_and_wait();
  const float r = w.f[l ^ o];
  w.bar->arrive_and_wait();
  return r;
}

// Warpgroup products (wgmma): issued products wait in a per-thread queue until the wait
// that retires their group, as on the hardware: their shared-memory operand is read then,
// an accumulator read early sees the old value, and one written while its product is in
// flight (or a product never waited for) stops the run.
struct WgOp {
  std::function<void()> run;
  float* acc;
  int n;
  std::vector<float> before;
  int group;
};
inline thread_local std::vector<WgOp> t_wg;
inline thread_local int t_wg_committed = 0;
inline void wg_issue(std::function<void()> run, float* acc, int n) {
  t_wg.push_back({std::move(run), acc, n, std::vector<float>(acc, acc + n), t_wg_committed});
}
inline void wg_commit() { ++t_wg_committed; }
inline void wg_wait(int newer) {  // retire all but the `newer` most recent committed groups
  const int limit = t_wg_committed - newer;
  size_t i = 0;
  for (; i < t_wg.size() && t_wg[i].group < limit; ++i) {
    WgOp& op = t_wg[i];
    if (std::memcmp(op.acc, op.before.data(), op.n * sizeof(float)) != 0) {
      std::fprintf(stderr, "kdagen emulate: a wgmma accumulator changed while its product was in flight\n");
      std::abort();
    }
    op.run();
    for (size_t j = i + 1; j < t_wg.size(); ++j)  // later products on the same accumulator
      if (t_wg[j].acc == op.acc) t_wg[j].before.assign(op.acc, op.acc + op.n);
  }
  t_wg.erase(t_wg.begin(), t_wg.begin() + static_cast<long>(i));
}

// The grid's blocks in the order they run (KDAGEN_EMULATE_BLOCK_ORDER, see the top).
inline std::vector<dim3> block_order(dim3 grid) {
  std::vector<dim3> order;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) order.emplace_back(x, y, z);
  const char* env = std::getenv("KDAGEN_EMULATE_BLOCK_ORDER");
  const std::string how = env != nullptr && *env != '\0' ? env : "shuffle";
  static unsigned launches = 0;  // a fixed seed per launch of the process
  if (how == "reverse") {
    std::reverse(order.begin(), order.end());
  } else if (how == "shuffle") {
    std::mt19937 rng(0x6b646167u + launches++);
    std::shuffle(order.begin(), order.end(), rng);
  } else if (how != "forward") {
    std::fprintf(stderr, "kdagen emulate: KDAGEN_EMULATE_BLOCK_ORDER=%s is not shuffle, forward or reverse\n",
                 how.c_str());
    std::abort();
  }
  return order;
}

// The grids launched since kdagen_emulate_grids last read them (tests: which kernel form
// a launcher picked).
inline std::vector<dim3> launched_grids;

// An integer setting of the emulation: the variable's value, or fallback where it is unset or empty.
inline int env_int(const char* name, int fallback) {
  const char* env = std::getenv(name);
  return env != nullptr && *env != '\0' ? std::atoi(env) : fallback;
}
// Run a grid: blocks one after another (block_order), the threads of each block at once.
inline void launch(dim3 grid, dim3 blk, size_t shmem, const std::function<void()>& body) {
  launched_grids.push_back(grid);
  stagger_us = env_int("KDAGEN_EMULATE_STAGGER_US", 0);
  const int nt = static_cast<int>(blk.x * blk.y * blk.z);
  std::vector<unsigned char> buf(shmem + 64);
  unsigned char* base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  blockDim = blk;
  gridDim = grid;
  for (const dim3 b : block_order(grid)) {
    const unsigned x = b.x, y = b.y, z = b.z;
    std::memset(base, 0xff, shmem);  // NaN bytes
    block.smem = base;
    block.bar = std::make_unique<std::barrier<>>(nt);
    for (int id = 0; id < 16; ++id) block.named[id].reset(), block.named_count[id] = 0;
    block.waves.clear();
    for (int w = 0; w < (nt + kWave - 1) / kWave; ++w) {
      auto wave = std::make_unique<Wave>();
      wave->bar = std::make_unique<std::barrier<>>(std::min(kWave, nt - kWave * w));
      block.waves.push_back(std::move(wave));
    }
    std::vector<std::thread> threads;
    threads.reserve(nt);
    for (int t = 0; t < nt; ++t)
      threads.emplace_back([&, t] {
        threadIdx = dim3(static_cast<unsigned>(t), 0, 0);
        blockIdx = dim3(x, y, z);
        body();
        if (!t_wg.empty()) {
          std::fprintf(stderr, "kdagen emulate: a wgmma product was never waited for\n");
          std::abort();
        }
      });
    for (auto& t : threads) t.join();
  }
}

#if defined(KDAGEN_EMULATE_NVIDIA)
inline float h2f(uint16_t h, bool bf16) {
  return bf16 ? __uint_as_float(uint32_t(h) << 16) : float(__builtin_bit_cast(_Float16, h));
}

// mma.sync.m16n8k16, one m16n8 half: A regs {(g,2t..),(g+8,2t..),(g,2t+8..),(g+8,2t+8..)},
// B regs {(k=2t..,n=g),(k=2t+8..,n=g)}, D (g,2t),(g,2t+1),(g+8,2t),(g+8,2t+1).
inline void mma16816(float* d, const uint32_t* ar, uint32_t b0, uint32_t b1, bool bf16) {
  Wave& w = my_wave();
  const int l = my_lane();
  for (int r = 0; r < 4; ++r) {
    w.a[l][2 * r] = h2f(ar[r] & 0xffff, bf16);
    w.a[l][2 * r + 1] = h2f(ar[r] >> 16, bf16);
  }
  w.b[l][0] = h2f(b0 & 0xffff, bf16);
  w.b[l][1] = h2f(b0 >> 16, bf16);
  w.b[l][2] = h2f(b1 & 0xffff, bf16);
  w.b[l][3] = h2f(b1 >> 16, bf16);
  w.bar->arrive_and_wait();
  auto A = [&](int row, int k) { return w.a[4 * (row % 8) + (k % 8) / 2][2 * ((row / 8) + 2 * (k / 8)) + (k % 2)]; };
  auto B = [&](int k, int n) { return w.b[4 * n + (k % 8) / 2][2 * (k / 8) + (k % 2)]; };
  const int g = l / 4, t = l % 4;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  float out[4];
  for (int e = 0; e < 4; ++e) {
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) s += A(rows[e], k) * B(k, cols[e]);
    out[e] = d[e] + s;
  }
  w.bar->arrive_and_wait();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l names row l % 8 of 8x8 matrix
// l / 8 (16 bytes, 16-byte aligned); register i of lane l = 4 g + t receives matrix i's
// row g, columns 2t and 2t + 1 (with .trans: rows 2t and 2t + 1 of column g).
inline void ldmatrix_x4(uint32_t* r, const uint16_t* row, bool trans) {
  require_aligned(row, 16, "ldmatrix row");
  Wave& w = my_wave();
  const int l = my_lane(), g = l / 4, t = l % 4;
  w.rows[l] = const_cast<uint16_t*>(row);
  w.bar->arrive_and_wait();
  for (int i = 0; i < 4; ++i) {
    uint16_t* const* m = &w.rows[8 * i];
    const uint16_t lo = trans ? m[2 * t][g] : m[g][2 * t];
    const uint16_t hi = trans ? m[2 * t + 1][g] : m[g][2 * t + 1];
    r[i] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  w.bar->arrive_and_wait();
}
// stmatrix.sync.aligned.m8n8.x4.trans.shared.b16: the registers in ldmatrix's layout,
// matrix i stored transposed into the rows lanes 8 i .. 8 i + 7 name: stored row j,
// column c is the fragment's (c, j), held by lane 4 c + j / 2, half j % 2.
inline void stmatrix_x4_trans(uint16_t* row, const uint32_t* r) {
  require_aligned(row, 16, "stmatrix row");
  Wave& w = my_wave();
  const int l = my_lane(), i = l / 8, j = l % 8;
  w.rows[l] = row;
  for (int k = 0; k < 4; ++k) w.regs[l][k] = r[k];
  w.bar->arrive_and_wait();
  for (int c = 0; c < 8; ++c) row[c] = uint16_t(w.regs[4 * c + j / 2][i] >> (16 * (j % 2)));
  w.bar->arrive_and_wait();
}

struct Copy { void* dst; const void* src; bool pred; };
inline thread_local std::vector<std::vector<Copy>> t_groups;  // committed, oldest first
inline thread_local std::vector<Copy> t_open;
inline bool late_copies() {
  static const bool v = [] {  // set and not "" / "0"
    const char* env = std::getenv("KDAGEN_EMULATE_LATE_COPIES");
    return env != nullptr && env[0] != '\0' && std::strcmp(env, "0") != 0;
  }();
  return v;
}
inline void land(const Copy& c) {
  if (c.pred) std::memcpy(c.dst, c.src, 16);
  else std::memset(c.dst, 0, 16);
}
inline void cp_async(void* dst, const void* src, bool pred) {
  require_aligned(dst, 16, "cp.async destination");
  if (pred) require_aligned(src, 16, "cp.async source");
  if (late_copies()) t_open.push_back({dst, src, pred});
  else land({dst, src, pred});
}
inline void cp_commit() {
  if (late_copies()) {
    t_groups.push_back(t_open);
    t_open.clear();
  }
}
inline void cp_wait(int n) {
  while (static_cast<int>(t_groups.size()) > n) {
    for (auto& c : t_groups.front()) land(c);
    t_groups.erase(t_groups.begin());
  }
}
#else
typedef float f32x4 __attribute__((ext_vector_type(4)));
typedef short i16x4 __attribute__((ext_vector_type(4)));
typedef _Float16 f16x4 __attribute__((ext_vector_type(4)));

inline f32x4 mfma(const float* a, const float* b, f32x4 c) {
  Wave& w = my_wave();
  const int l = my_lane();
  for (int j = 0; j < 4; ++j) {
    w.a[l][j] = a[j];
    w.b[l][j] = b[j];
  }
  w.bar->arrive_and_wait();
  f32x4 out = c;
  for (int e = 0; e < 4; ++e) {
    const int i = 4 * (l / 16) + e, jj = l % 16;
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) s += w.a[i + 16 * (k / 4)][k % 4] * w.b[jj + 16 * (k / 4)][k % 4];
    out[e] += s;
  }
  w.bar->arrive_and_wait();
  return out;
}
inline f32x4 mfma_bf16(i16x4 a, i16x4 b, f32x4 c) {
  float fa[4], fb[4];
  for (int j = 0; j < 4; ++j) {
    fa[j] = __uint_as_float(uint32_t(uint16_t(a[j])) << 16);
    fb[j] = __uint_as_float(uint32_t(uint16_t(b[j])) << 16);
  }
  return mfma(fa, fb, c);
}
inline f32x4 mfma_f16(f16x4 a, f16x4 b, f32x4 c) {
  float fa[4], fb[4];
  for (int j = 0; j < 4; ++j) {
    fa[j] = float(a[j]);
    fb[j] = float(b[j]);
  }
  return mfma(fa, fb, c);
}
#endif

}  // namespace kdagen_emu

inline void __syncthreads() { kdagen_emu::syncthreads(); }
#define KDAGEN_DYNAMIC_SHARED(name) unsigned char* name = kdagen_emu::smem()

#if defined(KDAGEN_EMULATE_NVIDIA)
inline float __shfl_xor_sync(unsigned, float x, int o) { return kdagen_emu::shfl_xor(x, o); }
inline void __syncwarp() { kdagen_emu::wave_barrier(); }
struct __half { uint16_t x; };
struct __half2 { uint16_t x, y; };
struct __nv_bfloat162 { uint16_t x, y; };
inline __half __ushort_as_half(uint16_t u) { return {u}; }
inline uint16_t __half_as_ushort(__half h) { return h.x; }
inline float __half2float(__half h) { return float(__builtin_bit_cast(_Float16, h.x)); }
inline __half __float2half_rn(float f) { return {__builtin_bit_cast(uint16_t, static_cast<_Float16>(f))}; }
inline uint16_t kdagen_emu_bf16_rne(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {kdagen_emu_bf16_rne(a), kdagen_emu_bf16_rne(b)};
}
inline __half2 __floats2half2_rn(float a, float b) {
  return {__float2half_rn(a).x, __float2half_rn(b).x};
}
#else
inline float __shfl_xor(float x, int o) { return kdagen_emu::shfl_xor(x, o); }
#define __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, x, y, z) kdagen_emu::mfma_bf16(a, b, c)
#define __builtin_amdgcn_mfma_f32_16x16x16f16(a, b, c, x, y, z) kdagen_emu::mfma_f16(a, b, c)
#endif

// ---- the HIP runtime subset the launchers use ------------------------------------------
using hipStream_t = void*;
using hipError_t = int;
constexpr hipError_t hipSuccess = 0;
constexpr int hipFuncAttributeMaxDynamicSharedMemorySize = 8;
inline hipError_t hipGetLastError() { return hipSuccess; }
inline const char* hipGetErrorString(hipError_t e) { return e == 0 ? "no error" : "emulated error"; }
inline hipError_t hipFuncSetAttribute(const void*, int, int) { return hipSuccess; }
constexpr int hipDeviceAttributeMultiprocessorCount = 16;
inline hipError_t hipGetDevice(int* d) {
  *d = 0;
  return hipSuccess;
}
// The emulated device's compute units: KDAGEN_EMULATE_CUS, 8 unless set (what launchers
// that size their grids by the machine see here).
inline hipError_t hipDeviceGetAttribute(int* v, int, int) {
  *v = kdagen_emu::env_int("KDAGEN_EMULATE_CUS", 8);
  return hipSuccess;
}
// The emulated device has no occupancy: blocks resident per compute unit are
// KDAGEN_EMULATE_RESIDENT, 0 (the runtime cannot tell) unless set.
inline hipError_t hipOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void*, int, size_t) {
  *n = kdagen_emu::env_int("KDAGEN_EMULATE_RESIDENT", 0);
  return hipSuccess;
}
#define hipLaunchKernelGGL(kernel, grid, blk, shmem, stream, ...) \
  kdagen_emu::launch((grid), (blk), (shmem), [&] { kernel(__VA_ARGS__); })

// For tests: the grids launched since the last call, x / y / z of each into out (at most
// max of them); returns how many there were.
extern "C" __attribute__((used)) int kdagen_emulate_grids(unsigned* out, int max) {
  const int n = static_cast<int>(kdagen_emu::launched_grids.size());
  for (int i = 0; i < n && i < max; ++i) {
    const dim3 g = kdagen_emu::launched_grids[static_cast<size_t>(i)];
    out[3 * i] = g.x, out[3 * i + 1] = g.y, out[3 * i + 2] = g.z;
  }
  kdagen_emu::launched_grids.clear();
  return n;
}
