// Native CPU kernels for jaxserve, called from jitted JAX code through the XLA FFI.
//
//   jaxserve_matmul                  y_i[M, N_i] = x[M, K] @ W_i for one or more weights
//                                    W_i [K, N_i] (or [N_i, K] with transpose_w), f32 x f32 or
//                                    bf16 x bf16, f32 accumulation, rows >= num_rows left
//                                    unwritten (no cost); few rows stream all weights at once.
//   jaxserve_ragged_paged_attention  the semantics of
//                                    pallas_kernels/ragged_paged_attention/reference.py.
//   jaxserve_write_kv                new tokens' K/V into the paged cache, in place
//                                    (kv_cache.write_kv).
//   jaxserve_rms_norm                RMSNorm of the real rows, optionally after adding the
//                                    residual (pallas_kernels/rows.py).
//   jaxserve_gated_act               act(gate) * up of the real rows (silu, tanh gelu).
//
// One portable .so: the code is compiled for baseline x86-64 (or whatever the compiler
// targets), and the fast paths are functions compiled for AVX-512 (+ AVX512_BF16) or
// AVX2+FMA with __attribute__((target)), picked at run time with __builtin_cpu_supports.
// The generic path (plain C++ written so that the compiler vectorises it) is compiled
// twice: once for AVX2+FMA and once for the baseline, which is also what runs on other
// architectures.
//
// Threads: XLA's intra-op thread pool, reached through ffi::Ctx<ffi::ThreadPool> (a
// persistent std::thread pool where XLA gives none; JAXSERVE_CPU_THREADS caps either). A call
// splits its work into independent tasks handed out through an atomic counter and works on
// them itself; helpers from the pool join in. A helper stays resident for a short while
// after its last task (see ResidentHelper), because a parked pool thread wakes up too late
// for the 10-100 us calls a decode step is made of.
//
// Matmul: few rows are bandwidth-bound: [K, N] weights (M <= 6) are split by rows of K over
// the threads and streamed in memory order into per-part f32 partial sums; [N, K] weights
// (M <= 24) are dot products, one weight row after another, each read once for all rows
// (weights sharing x in one parallel loop, no barrier between them).
// Larger M is compute-bound: each task copies a 64-column strip of the weight into a panel
// in the micro-kernel's layout (bf16: pairs of K rows interleaved for vdpbf16ps; [N, K]:
// transposed), then runs 6 x 64 register tiles over a block of rows against it (f32 [K, N]
// strips are read in place); while they run, the tiles prefetch the [N, K] strip the thread
// likely packs next, so its copy does not wait on memory.
//
// Attention: one task per (sequence, KV head, block of queries), largest first; keys in
// chunks of 32, software-prefetched two chunks ahead, and a thread's likely next task's
// first chunks while the current one runs (into L2 on AVX-512); scores as 4 x 4 (1 x 16,
// 2 x 8) tiles of dot products for few rows (decode; vdpbf16ps for bf16 q and pages) or
// from K^T for many (prefill); online softmax and P.V in f32. Below AVX-512 the same plan
// in 8-lane vectors (4 x 2, 1 x 8, 2 x 4 tiles). See
// pallas_kernels/ragged_paged_attention/cpu.py.
//
// See pallas_kernels/cpu/__init__.py for how this file is built and loaded.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64)
#define JS_X86 1
#include <immintrin.h>
#else
#define JS_X86 0
#endif

namespace ffi = xla::ffi;

namespace jaxserve {
namespace {

#define JS_INLINE inline __attribute__((always_inline))
// Fully unroll a loop of constant trip count, so that arrays of vector accumulators indexed
// by it become registers (GCC keeps a partly unrolled array in memory, storing it every step).
#define JS_UNROLL _Pragma("GCC unroll 32")
#if JS_X86
#define JS_AVX2 __attribute__((target("avx2,fma,f16c")))
#define JS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define JS_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))
#endif

// ------------------------------------------------------------------------------------------
// Instruction-set levels

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

int DetectIsa() {
#if JS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return __builtin_cpu_supports("avx512bf16") ? kAvx512Bf16 : kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

std::atomic<int> g_max_isa{kAvx512Bf16};

int DetectedIsa() {
  static const int detected = DetectIsa();
  return detected;
}

int CurrentIsa() { return std::min(DetectedIsa(), g_max_isa.load(std::memory_order_relaxed)); }

// ------------------------------------------------------------------------------------------
// Scalar conversions (exact bit manipulation; no dependence on the FPU's denormal modes)

JS_INLINE float Bf16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

JS_INLINE uint16_t F32ToBf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  // A select, not a branch: loops over it vectorise (the row-wise ops below).
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is
// NaN. A table of all 256 values, built once from the definition.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) {
      const int e = (i >> 3) & 15, m = i & 7;
      float x;
      if (e == 15 && m == 7) {
        x = std::nanf("");
      } else if (e == 0) {
        x = std::ldexp(static_cast<float>(m), -9);
      } else {
        x = std::ldexp(1.0f + m / 8.0f, e - 7);
      }
      v[i] = (i & 0x80) ? -x : x;
    }
  }
};

const float* Fp8Values() {
  static const Fp8Table table;
  return table.v;
}

JS_INLINE int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
JS_INLINE int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// ------------------------------------------------------------------------------------------
// Parallel loop over XLA's intra-op pool

struct ForState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t n = 0;
  const std::function<void(int64_t)>* fn = nullptr;  // valid while done < n
  std::mutex mu;
  std::condition_variable cv;
};

void RunTasks(ForState& st) {
  int64_t finished = 0;
  for (;;) {
    const int64_t i = st.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= st.n) break;
    (*st.fn)(i);
    ++finished;
  }
  if (finished > 0 && st.done.fetch_add(finished, std::memory_order_acq_rel) + finished == st.n) {
    std::lock_guard<std::mutex> lock(st.mu);
    st.cv.notify_all();
  }
}

// Used only where XLA hands no thread pool to the call (num_threads() == 0): a persistent
// pool of std::threads, one per core beside the caller's, created on first use.
class OwnPool {
 public:
  static OwnPool& Get() {
    static OwnPool* pool = new OwnPool();  // never destroyed: its threads run until exit
    return *pool;
  }
  int64_t threads() const { return workers_ + 1; }
  void Schedule(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  OwnPool() {
    workers_ = std::max<int64_t>(0, static_cast<int64_t>(std::thread::hardware_concurrency()) - 1);
    for (int64_t i = 0; i < workers_; ++i) std::thread([this] { Loop(); }).detach();
  }
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !queue_.empty(); });
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  int64_t workers_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
};

// Threads a call may use: XLA's intra-op pool (or OwnPool), capped by JAXSERVE_CPU_THREADS.
int64_t ThreadCap() {
  static const int64_t cap = [] {
    const char* env = std::getenv("JAXSERVE_CPU_THREADS");
    const long v = env ? std::strtol(env, nullptr, 10) : 0;
    return v > 0 ? static_cast<int64_t>(v) : int64_t{1} << 30;
  }();
  return cap;
}

// Resident helpers. A task scheduled on a parked pool thread starts tens of microseconds
// later (a futex wake-up; measured: with one task per 20-60 us matmul, the caller ran 99% of
// the work itself), while one step of a model is a chain of such calls. So a helper, once
// running, stays: it works on whatever job was published last, then spins (pause) for up
// to kResidentSpinUs waiting for the next, and only then returns its thread to the pool.
// A call publishes its job and schedules a new helper only when fewer than threads - 1
// are resident. Spinning threads (an idle helper, a caller waiting for a helper's last
// task) yield the core every 64 pauses: with as many compute threads as cores, the host
// thread that dispatches the next step must get a core from a thread that is only waiting,
// not preempt one holding a task the others then wait for (the engine's bf16 decode of
// smollm2-135m went from 11.8 to 10.6 ms per token with this and the native K/V writer).
constexpr int64_t kResidentSpinUs = 50;

struct Resident {
  std::mutex mu;
  std::shared_ptr<ForState> job;  // the latest published job
  std::atomic<uint64_t> generation{0};
  std::atomic<int64_t> helpers{0};
};

Resident& Residents() {
  static Resident* r = new Resident();  // never destroyed: helpers may outlive main()
  return *r;
}

void ResidentHelper() {
  Resident& r = Residents();
  uint64_t seen = 0;
  auto idle_since = std::chrono::steady_clock::now();
  for (int64_t spin = 0;; ++spin) {
    if (r.generation.load(std::memory_order_acquire) != seen) {
      std::shared_ptr<ForState> job;
      {
        std::lock_guard<std::mutex> lock(r.mu);
        job = r.job;
        seen = r.generation.load(std::memory_order_acquire);
      }
      if (job) RunTasks(*job);
      idle_since = std::chrono::steady_clock::now();
      continue;
    }
    if (spin % 64 == 0 && std::chrono::steady_clock::now() - idle_since >
                              std::chrono::microseconds(kResidentSpinUs)) {
      r.helpers.fetch_sub(1);
      // A job published just before the decrement may have counted on this helper.
      if (r.generation.load() == seen) return;
      r.helpers.fetch_add(1);
      continue;
    }
    if (spin % 64 == 63) {
      std::this_thread::yield();  // a host thread waiting for this core runs now
    } else {
#if JS_X86
      _mm_pause();
#endif
    }
  }
}

class Runner {
 public:
  explicit Runner(ffi::ThreadPool* pool) {
    const int64_t n = pool ? pool->num_threads() : 0;
    if (n > 0) {
      pool_ = pool;
      threads_ = n;
    } else {
      own_ = &OwnPool::Get();
      threads_ = own_->threads();
    }
    threads_ = std::max<int64_t>(1, std::min(threads_, ThreadCap()));
  }
  int64_t threads() const { return threads_; }

  // fn(i) for i in [0, n), each exactly once, spread over resident helpers and this thread.
  void For(int64_t n, const std::function<void(int64_t)>& fn) const {
    if (n <= 0) return;
    if (n == 1 || threads_ <= 1) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    auto st = std::make_shared<ForState>();
    st->n = n;
    st->fn = &fn;
    Resident& r = Residents();
    {
      std::lock_guard<std::mutex> lock(r.mu);
      r.job = st;
      r.generation.fetch_add(1);
    }
    const int64_t want = std::min<int64_t>(n - 1, threads_ - 1);
    for (int64_t h = r.helpers.load(); h < want; h = r.helpers.load()) {
      if (!r.helpers.compare_exchange_weak(h, h + 1)) continue;
      if (pool_) {
        pool_->Schedule([] { ResidentHelper(); });
      } else {
        own_->Schedule([] { ResidentHelper(); });
      }
    }
    RunTasks(*st);
    // Every task has been claimed; wait for those a helper is still running.
    for (int spin = 0; spin < 20000; ++spin) {
      if (st->done.load(std::memory_order_acquire) == n) return;
      if (spin % 64 == 63) {
        std::this_thread::yield();  // a preempted helper may be waiting for a core
      } else {
#if JS_X86
        _mm_pause();
#endif
      }
    }
    std::unique_lock<std::mutex> lock(st->mu);
    st->cv.wait(lock, [&] { return st->done.load(std::memory_order_acquire) == n; });
  }

 private:
  ffi::ThreadPool* pool_ = nullptr;
  OwnPool* own_ = nullptr;
  int64_t threads_ = 1;
};

// ==========================================================================================
// Matmul
// ==========================================================================================

struct Mm {
  const void* x;  // [M_all, K]
  const void* w;  // [K, N] or, with trans, [N, K]
  void* y;        // [M_all, N]
  int64_t m;      // real rows (num_rows clamped to [0, M_all])
  int64_t k, n;
  bool trans;
  bool bf16;
  // With trans: w's 64-row strips are stored as packed panels (see "AVX-512 packed
  // panels"), packed once at load; N is a multiple of 64 and, for bf16, K is even.
  bool packed;
};

// Offset of w[n, k] of an [N, K] weight in strips of packed panels (Mm::packed).
JS_INLINE int64_t PackedOffset(const Mm& a, int64_t n, int64_t k) {
  const int64_t strip = n / 64 * 64 * a.k, c = n % 64;
  return a.bf16 ? strip + (k / 2 * 64 + c) * 2 + k % 2 : strip + k * 64 + c;
}

// ---------------------------------------------------------------- generic (AVX2 / scalar)

template <typename T>
JS_INLINE float ToF32(T v);
template <>
JS_INLINE float ToF32<float>(float v) { return v; }
template <>
JS_INLINE float ToF32<uint16_t>(uint16_t v) { return Bf16ToF32(v); }

template <typename T>
JS_INLINE T FromF32(float v);
template <>
JS_INLINE float FromF32<float>(float v) { return v; }
template <>
JS_INLINE uint16_t FromF32<uint16_t>(float v) { return F32ToBf16(v); }

constexpr int64_t kGenericCols = 16;  // KN: columns per task
constexpr int64_t kGenericRows = 4;   // NK: weight rows per task

// KN: one task is a tile of 16 output columns for all rows, 4 rows at a time.
template <typename T>
JS_INLINE void GenericKnTask(const Mm& a, int64_t task) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  T* y = static_cast<T*>(a.y);
  const int64_t n0 = task * kGenericCols, nc = std::min(kGenericCols, a.n - n0);
  for (int64_t m0 = 0; m0 < a.m; m0 += 4) {
    const int64_t mr = std::min<int64_t>(4, a.m - m0);
    float acc[4][kGenericCols] = {};
    for (int64_t k = 0; k < a.k; ++k) {
      float wf[kGenericCols];
      const T* wk = w + k * a.n + n0;
      if (nc == kGenericCols) {
        for (int c = 0; c < kGenericCols; ++c) wf[c] = ToF32<T>(wk[c]);
      } else {
        for (int c = 0; c < kGenericCols; ++c) wf[c] = c < nc ? ToF32<T>(wk[c]) : 0.0f;
      }
      float xr[4];
      for (int r = 0; r < 4; ++r) xr[r] = r < mr ? ToF32<T>(x[(m0 + r) * a.k + k]) : 0.0f;
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < kGenericCols; ++c) acc[r][c] += xr[r] * wf[c];
    }
    for (int64_t r = 0; r < mr; ++r)
      for (int64_t c = 0; c < nc; ++c) y[(m0 + r) * a.n + n0 + c] = FromF32<T>(acc[r][c]);
  }
}

// NK: one task is 4 weight rows (output columns) for all rows; dot products in 16 lanes.
// kPacked: w[n, k] found in its strip of packed panels (Mm::packed).
template <typename T, bool kPacked = false>
JS_INLINE void GenericNkTask(const Mm& a, int64_t task) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  T* y = static_cast<T*>(a.y);
  const int64_t n0 = task * kGenericRows, nt = std::min(kGenericRows, a.n - n0);
  const int64_t k16 = a.k / 16 * 16;
  for (int64_t m = 0; m < a.m; ++m) {
    const T* xm = x + m * a.k;
    for (int64_t t = 0; t < nt; ++t) {
      const T* wn = w + (n0 + t) * a.k;
      auto wk = [&](int64_t k) {
        return ToF32<T>(kPacked ? w[PackedOffset(a, n0 + t, k)] : wn[k]);
      };
      float part[16] = {};
      for (int64_t k = 0; k < k16; k += 16)
        for (int l = 0; l < 16; ++l) part[l] += ToF32<T>(xm[k + l]) * wk(k + l);
      for (int64_t k = k16; k < a.k; ++k) part[k - k16] += ToF32<T>(xm[k]) * wk(k);
      float s = 0.0f;
      for (int l = 0; l < 16; ++l) s += part[l];
      y[m * a.n + n0 + t] = FromF32<T>(s);
    }
  }
}

JS_INLINE int64_t GenericTasks(const Mm& a) {
  return a.trans ? CeilDiv(a.n, kGenericRows) : CeilDiv(a.n, kGenericCols);
}

JS_INLINE void GenericMatmulTask(const Mm& a, int64_t task) {
  if (a.packed) {
    a.bf16 ? GenericNkTask<uint16_t, true>(a, task) : GenericNkTask<float, true>(a, task);
  } else if (a.bf16) {
    a.trans ? GenericNkTask<uint16_t>(a, task) : GenericKnTask<uint16_t>(a, task);
  } else {
    a.trans ? GenericNkTask<float>(a, task) : GenericKnTask<float>(a, task);
  }
}

void ScalarMatmulTask(const Mm& a, int64_t task) { GenericMatmulTask(a, task); }
#if JS_X86
JS_AVX2 void Avx2MatmulTask(const Mm& a, int64_t task) { GenericMatmulTask(a, task); }
#endif

void GenericMatmul(const Runner& run, const Mm& a, int isa) {
#if JS_X86
  if (isa >= kAvx2) {
    run.For(GenericTasks(a), [&](int64_t i) { Avx2MatmulTask(a, i); });
    return;
  }
#endif
  (void)isa;
  run.For(GenericTasks(a), [&](int64_t i) { ScalarMatmulTask(a, i); });
}

#if JS_X86
// ---------------------------------------------------------------- AVX-512 helpers

// 16 vectors -> one vector whose lane i is the sum of the lanes of v[i].
JS_AVX512 JS_INLINE __m512 Reduce16(const __m512* v) {
  __m512 s1[8];
  JS_UNROLL for (int i = 0; i < 8; ++i)
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                          _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 s2[4];
  JS_UNROLL for (int i = 0; i < 4; ++i)
    s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 s3[2];
  JS_UNROLL for (int i = 0; i < 2; ++i)
    s3[i] = _mm512_add_ps(
        _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

JS_AVX512 JS_INLINE __mmask16 Mask16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff)
                 : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
}

JS_AVX512 JS_INLINE __mmask32 Mask32(int64_t n) {
  return n >= 32 ? static_cast<__mmask32>(0xffffffffu)
                 : n <= 0 ? static_cast<__mmask32>(0) : static_cast<__mmask32>((1u << n) - 1);
}

// bf16 <-> f32 without AVX512_BF16 (round to nearest even, NaN kept).
JS_AVX512 JS_INLINE __m512 LoadBf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

JS_AVX512 JS_INLINE __m256i F32ToBf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

// ---------------------------------------------------------------- AVX-512 f32 matmul

constexpr int64_t kTileCols = 64;  // KN micro-tile width (4 vectors of 16 f32 / 2 of 32 bf16)
constexpr int kMaxTileRows = 6;     // KN micro-tile height
// Software prefetch distance of a stream of weight rows: about 4 KiB ahead, enough bytes in
// flight to cover the memory latency at full bandwidth.
constexpr int64_t kPrefetchBytes = 4096;

// y[0:MR, 0:nc] = x[0:MR, :] @ w[:, 0:nc], nc <= 64; x row stride ldx, w row stride ldw.
// Prefetches: w's own rows ahead when read in place (`pf` null); for a packed panel w,
// `pf_step` lines of `pf` (the next panel's weights) per step of k, up to `pf_lines`.
template <int MR>
JS_AVX512 void F32KnTile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                         int64_t nc, float* y, int64_t ldy, const char* pf = nullptr,
                         int64_t pf_lines = 0, int64_t pf_step = 0) {
  __mmask16 mask[4];
  JS_UNROLL for (int v = 0; v < 4; ++v) mask[v] = Mask16(nc - 16 * v);
  __m512 acc[MR][4];
  JS_UNROLL for (int r = 0; r < MR; ++r)
    JS_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t ahead = kPrefetchBytes / 256 * ldw;  // 256 bytes of each row per step
  int64_t k = 0;
  do {  // K >= 1; a do-while keeps GCC from spilling acc every iteration
    const float* wk = w + k * ldw;
    if (pf == nullptr) {
      const char* own = reinterpret_cast<const char*>(wk + ahead);
      _mm_prefetch(own, _MM_HINT_T0);
      _mm_prefetch(own + 64, _MM_HINT_T0);
      _mm_prefetch(own + 128, _MM_HINT_T0);
      _mm_prefetch(own + 192, _MM_HINT_T0);
    } else {
      for (int64_t l = k * pf_step; l < std::min(pf_lines, (k + 1) * pf_step); ++l)
        _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
    }
    __m512 b[4];
    JS_UNROLL for (int v = 0; v < 4; ++v) b[v] = _mm512_maskz_loadu_ps(mask[v], wk + 16 * v);
    JS_UNROLL for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      JS_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(xv, b[v], acc[r][v]);
    }
  } while (++k < K);
  JS_UNROLL for (int r = 0; r < MR; ++r)
    JS_UNROLL for (int v = 0; v < 4; ++v)
      _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask[v], acc[r][v]);
}

// MR x NT dot products (MR * NT <= 16): y[r, t] = x[r, :] . w[t, :] for MR rows of x and NT
// rows of w (given as pointers; duplicates for rows past the end), stored where r < mr and
// t < nt. Each step prefetches the lines the same step of the next tile will read (the
// next NT rows of w, contiguous with these).
template <int MR, int NT>
JS_AVX512 void F32NkTile(const float* const* xr, const float* const* wr, int64_t K, int64_t mr,
                         int64_t nt, float* y, int64_t ldy) {
  static_assert(MR * NT <= 16, "at most 16 dot products per tile");
  __m512 acc[16];
  const int64_t next = NT * K;
  if constexpr (MR == 1 && NT == 16) {
    // Decode, one row of x: walk the weight rows one after another (sequential reads). A
    // 1 x 4 tail (NkTiles) takes the general loop: 4 independent sums, its rows in L1.
    JS_UNROLL for (int t = 0; t < NT; ++t) {
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 32 <= K; k += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(wr[t] + k) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wr[t] + k + 16) + kPrefetchBytes, _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xr[0] + k), _mm512_loadu_ps(wr[t] + k), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(xr[0] + k + 16), _mm512_loadu_ps(wr[t] + k + 16), a1);
      }
      for (; k < K; k += 16) {
        const __mmask16 m = Mask16(K - k);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, xr[0] + k),
                             _mm512_maskz_loadu_ps(m, wr[t] + k), a0);
      }
      acc[t] = _mm512_add_ps(a0, a1);
    }
  } else {
    JS_UNROLL for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();  // all: Reduce16
    int64_t k = 0;
    do {  // K >= 1; the last step masked
      const __mmask16 m = Mask16(K - k);
      JS_UNROLL for (int t = 0; t < NT; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(wr[t] + next + k), _MM_HINT_T0);
      JS_UNROLL for (int r = 0; r < MR; ++r) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, xr[r] + k);
        JS_UNROLL for (int t = 0; t < NT; ++t)
          acc[NT * r + t] =
              _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, wr[t] + k), acc[NT * r + t]);
      }
      k += 16;
    } while (k < K);
  }
  alignas(64) float out[16];
  _mm512_store_ps(out, Reduce16(acc));
  for (int64_t r = 0; r < mr; ++r)
    for (int64_t t = 0; t < nt; ++t) y[r * ldy + t] = out[NT * r + t];
}

// ---------------------------------------------------------------- AVX-512 bf16 matmul

JS_INLINE int32_t Load32(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}


template <int MR, int NT>  // as F32NkTile, 32 bf16 per step
JS_AVX512BF16 void Bf16NkTile(const uint16_t* const* xr, const uint16_t* const* wr, int64_t K,
                              int64_t mr, int64_t nt, uint16_t* y, int64_t ldy) {
  static_assert(MR * NT <= 16, "at most 16 dot products per tile");
  __m512 acc[16];
  const int64_t next = NT * K;
  if constexpr (MR == 1 && NT == 16) {
    // Decode, one row of x: walk the weight rows one after another (sequential reads). A
    // 1 x 4 tail (NkTiles) takes the general loop: 4 independent sums, its rows in L1.
    JS_UNROLL for (int t = 0; t < NT; ++t) {
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 64 <= K; k += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(wr[t] + k) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wr[t] + k + 32) + kPrefetchBytes, _MM_HINT_T0);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xr[0] + k),
                              (__m512bh)_mm512_loadu_si512(wr[t] + k));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(xr[0] + k + 32),
                              (__m512bh)_mm512_loadu_si512(wr[t] + k + 32));
      }
      for (; k < K; k += 32) {
        const __mmask32 m = Mask32(K - k);
        _mm_prefetch(reinterpret_cast<const char*>(wr[t] + k) + kPrefetchBytes, _MM_HINT_T0);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, xr[0] + k),
                              (__m512bh)_mm512_maskz_loadu_epi16(m, wr[t] + k));
      }
      acc[t] = _mm512_add_ps(a0, a1);
    }
  } else {
    JS_UNROLL for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();  // all: Reduce16
    int64_t k = 0;
    do {  // K >= 1; the last step masked
      const __mmask32 m = Mask32(K - k);
      JS_UNROLL for (int t = 0; t < NT; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(wr[t] + next + k), _MM_HINT_T0);
      JS_UNROLL for (int r = 0; r < MR; ++r) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xr[r] + k);
        JS_UNROLL for (int t = 0; t < NT; ++t)
          acc[NT * r + t] = _mm512_dpbf16_ps(acc[NT * r + t], xv,
                                             (__m512bh)_mm512_maskz_loadu_epi16(m, wr[t] + k));
      }
      k += 32;
    } while (k < K);
  }
  alignas(64) float out[16];
  _mm512_store_ps(out, Reduce16(acc));
  for (int64_t r = 0; r < mr; ++r)
    for (int64_t t = 0; t < nt; ++t) y[r * ldy + t] = F32ToBf16(out[NT * r + t]);
}

// ---------------------------------------------------------------- AVX-512 few-row KN

// Few rows of x (M <= 6) against w [K, N]: memory-bound, so w is read in its memory order.
// A task takes a range of w's rows and walks them `kKnBlockRows` at a time across all N
// columns, adding into its own float32 partial sums P [M, Np] (Np = N rounded up to 64),
// kept in the tiles' register layout; KnFinish adds the tasks' partials and stores y.
constexpr int64_t kKnBlockRows = 4;

template <int MR>
JS_AVX512 void F32KnRows(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kb,
                         int64_t N, float* P, int64_t ldp, bool first) {
  // Rows ahead, same columns: the next block, or ~4 KiB on for narrow rows.
  const int64_t ahead = std::max<int64_t>(kb, CeilDiv(kPrefetchBytes, ldw * 4)) * ldw;
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    __mmask16 mask[4];
    JS_UNROLL for (int v = 0; v < 4; ++v) mask[v] = Mask16(N - n0 - 16 * v);
    __m512 acc[MR][4];
    JS_UNROLL for (int r = 0; r < MR; ++r)
      JS_UNROLL for (int v = 0; v < 4; ++v)
        acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(P + r * ldp + n0 + 16 * v);
    for (int64_t k = 0; k < kb; ++k) {
      const float* wk = w + k * ldw + n0;
      const char* pf = reinterpret_cast<const char*>(wk + ahead);
      JS_UNROLL for (int l = 0; l < 4; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
      __m512 b[4];
      JS_UNROLL for (int v = 0; v < 4; ++v) b[v] = _mm512_maskz_loadu_ps(mask[v], wk + 16 * v);
      JS_UNROLL for (int r = 0; r < MR; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
        JS_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(xv, b[v], acc[r][v]);
      }
    }
    JS_UNROLL for (int r = 0; r < MR; ++r)
      JS_UNROLL for (int v = 0; v < 4; ++v) _mm512_storeu_ps(P + r * ldp + n0 + 16 * v, acc[r][v]);
  }
}

template <int MR>
JS_AVX512BF16 void Bf16KnRows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                              int64_t kb, int64_t N, float* P, int64_t ldp, bool first) {
  // Rows ahead, same columns: the next block, or ~4 KiB on for narrow rows.
  const int64_t ahead = std::max<int64_t>(kb, CeilDiv(kPrefetchBytes, ldw * 2)) * ldw;
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const __mmask32 m0 = Mask32(N - n0), m1 = Mask32(N - n0 - 32);
    __m512 acc[MR][4];
    JS_UNROLL for (int r = 0; r < MR; ++r)
      JS_UNROLL for (int v = 0; v < 4; ++v)
        acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(P + r * ldp + n0 + 16 * v);
    int64_t k = 0;
    for (; k + 1 < kb; k += 2) {
      const uint16_t* w0 = w + k * ldw + n0;
      const uint16_t* w1 = w0 + ldw;
      const char* pf = reinterpret_cast<const char*>(w0 + ahead);
      _mm_prefetch(pf, _MM_HINT_T0);
      _mm_prefetch(pf + 64, _MM_HINT_T0);
      _mm_prefetch(pf + 2 * ldw, _MM_HINT_T0);
      _mm_prefetch(pf + 2 * ldw + 64, _MM_HINT_T0);
      const __m512i a0 = _mm512_maskz_loadu_epi16(m0, w0), a1 = _mm512_maskz_loadu_epi16(m0, w1);
      const __m512i c0 = _mm512_maskz_loadu_epi16(m1, w0 + 32);
      const __m512i c1 = _mm512_maskz_loadu_epi16(m1, w1 + 32);
      const __m512bh b0 = (__m512bh)_mm512_unpacklo_epi16(a0, a1);
      const __m512bh b1 = (__m512bh)_mm512_unpackhi_epi16(a0, a1);
      const __m512bh b2 = (__m512bh)_mm512_unpacklo_epi16(c0, c1);
      const __m512bh b3 = (__m512bh)_mm512_unpackhi_epi16(c0, c1);
      JS_UNROLL for (int r = 0; r < MR; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(Load32(x + r * ldx + k));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, b1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, b2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, b3);
      }
    }
    if (k < kb) {  // odd row count (only at the end of K): the last row pairs with zeros
      const __m512i zero = _mm512_setzero_si512();
      const uint16_t* w0 = w + k * ldw + n0;
      const __m512i a0 = _mm512_maskz_loadu_epi16(m0, w0);
      const __m512i c0 = _mm512_maskz_loadu_epi16(m1, w0 + 32);
      const __m512bh b0 = (__m512bh)_mm512_unpacklo_epi16(a0, zero);
      const __m512bh b1 = (__m512bh)_mm512_unpackhi_epi16(a0, zero);
      const __m512bh b2 = (__m512bh)_mm512_unpacklo_epi16(c0, zero);
      const __m512bh b3 = (__m512bh)_mm512_unpackhi_epi16(c0, zero);
      JS_UNROLL for (int r = 0; r < MR; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[r * ldx + k]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, b1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, b2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, b3);
      }
    }
    JS_UNROLL for (int r = 0; r < MR; ++r)
      JS_UNROLL for (int v = 0; v < 4; ++v) _mm512_storeu_ps(P + r * ldp + n0 + 16 * v, acc[r][v]);
  }
}

// y[m, n0:n0+64] = sum over parts of P_part[m, n0:n0+64], un-permuting the bf16 layout.
template <typename T>
JS_AVX512 void KnFinish(const float* P, int64_t parts, int64_t part_stride, int64_t m,
                        int64_t ldp, int64_t n0, int64_t N, T* y) {
  const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i idx1 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t r = 0; r < m; ++r) {
    __m512 v[4];
    JS_UNROLL for (int i = 0; i < 4; ++i) v[i] = _mm512_loadu_ps(P + r * ldp + n0 + 16 * i);
    for (int64_t p = 1; p < parts; ++p)
      JS_UNROLL for (int i = 0; i < 4; ++i)
        v[i] = _mm512_add_ps(v[i], _mm512_loadu_ps(P + p * part_stride + r * ldp + n0 + 16 * i));
    T* dst = y + r * N + n0;
    if constexpr (sizeof(T) == 4) {
      JS_UNROLL for (int i = 0; i < 4; ++i)
        _mm512_mask_storeu_ps(dst + 16 * i, Mask16(N - n0 - 16 * i), v[i]);
    } else {
      JS_UNROLL for (int g = 0; g < 2; ++g) {
        const __m512 o0 = _mm512_permutex2var_ps(v[2 * g], idx0, v[2 * g + 1]);
        const __m512 o1 = _mm512_permutex2var_ps(v[2 * g], idx1, v[2 * g + 1]);
        _mm256_mask_storeu_epi16(dst + 32 * g, Mask16(N - n0 - 32 * g), F32ToBf16x16(o0));
        _mm256_mask_storeu_epi16(dst + 32 * g + 16, Mask16(N - n0 - 32 * g - 16),
                                 F32ToBf16x16(o1));
      }
    }
  }
}

template <typename T>
void KnRowsDispatch(const T* x, int64_t ldx, const T* w, int64_t ldw, int64_t kb, int64_t N,
                    float* P, int64_t ldp, bool first, int64_t mr) {
  if constexpr (sizeof(T) == 4) {
    switch (mr) {
      case 1: return F32KnRows<1>(x, ldx, w, ldw, kb, N, P, ldp, first);
      case 2: return F32KnRows<2>(x, ldx, w, ldw, kb, N, P, ldp, first);
      case 3: return F32KnRows<3>(x, ldx, w, ldw, kb, N, P, ldp, first);
      case 4: return F32KnRows<4>(x, ldx, w, ldw, kb, N, P, ldp, first);
      case 5: return F32KnRows<5>(x, ldx, w, ldw, kb, N, P, ldp, first);
      default: return F32KnRows<6>(x, ldx, w, ldw, kb, N, P, ldp, first);
    }
  } else {
    switch (mr) {
      case 1: return Bf16KnRows<1>(x, ldx, w, ldw, kb, N, P, ldp, first);
      case 2: return Bf16KnRows<2>(x, ldx, w, ldw, kb, N, P, ldp, first);
      case 3: return Bf16KnRows<3>(x, ldx, w, ldw, kb, N, P, ldp, first);
      case 4: return Bf16KnRows<4>(x, ldx, w, ldw, kb, N, P, ldp, first);
      case 5: return Bf16KnRows<5>(x, ldx, w, ldw, kb, N, P, ldp, first);
      default: return Bf16KnRows<6>(x, ldx, w, ldw, kb, N, P, ldp, first);
    }
  }
}

// Several [K, N_i] weights against the same few rows of x (q/k/v, gate/up): each weight is
// split by rows of K into parts, and the parts of all of them are one parallel loop, so a
// small weight (a k/v projection) shares the call's start-up instead of paying its own.
template <typename T>
void FewRowsKn(const Runner& run, const Mm* as, int64_t count) {
  struct Part {
    const Mm* a;
    int64_t k0, k1;
    float* P;  // this part's [m, ldp] partial sums
  };
  // Parts of K (an even number of rows each): two per thread (each part starts a cold
  // stream, so fewer are faster; two still balance a helper that starts late), >= 32 rows.
  // The calling thread's buffers, bound by reference: inside the lambda a thread_local
  // name would mean the worker's own (empty) one.
  thread_local std::vector<Part> caller_parts;
  thread_local std::vector<float> caller_partials;  // every part writes its own slice
  std::vector<Part>& parts = caller_parts;
  std::vector<float>& partials = caller_partials;
  parts.clear();
  size_t need = 0;
  for (int64_t i = 0; i < count; ++i) {
    const Mm& a = as[i];
    const int64_t n = std::clamp<int64_t>(a.k / 32, 1, 2 * run.threads());
    const int64_t rows = RoundUp(CeilDiv(a.k, n), 2);
    for (int64_t k0 = 0; k0 < a.k; k0 += rows) {
      parts.push_back({&a, k0, std::min(a.k, k0 + rows), reinterpret_cast<float*>(need)});
      need += static_cast<size_t>(a.m * RoundUp(a.n, 64));
    }
  }
  if (partials.size() < need) partials.resize(need);
  for (Part& part : parts) part.P = partials.data() + reinterpret_cast<size_t>(part.P);
  run.For(static_cast<int64_t>(parts.size()), [&](int64_t p) {
    const Part& part = parts[p];
    const Mm& a = *part.a;
    const T* x = static_cast<const T*>(a.x);
    const T* w = static_cast<const T*>(a.w);
    // The part's rows are contiguous: start its stream with a burst (the row blocks then
    // prefetch one block ahead as they go).
    const char* start = reinterpret_cast<const char*>(w + part.k0 * a.n);
    const int64_t burst =
        std::min<int64_t>(kPrefetchBytes, (part.k1 - part.k0) * a.n * sizeof(T));
    for (int64_t b = 0; b < burst; b += 64) _mm_prefetch(start + b, _MM_HINT_T0);
    for (int64_t k = part.k0; k < part.k1; k += kKnBlockRows) {
      KnRowsDispatch<T>(x + k, a.k, w + k * a.n, a.n, std::min(kKnBlockRows, part.k1 - k), a.n,
                        part.P, RoundUp(a.n, 64), k == part.k0, a.m);
    }
  });
  // Each weight's sum over its parts: M x N x parts floats, small next to w; on this thread
  // (no second wake-up). A weight's parts are consecutive, evenly spaced in `partials`.
  for (size_t first = 0; first < parts.size();) {
    const Mm& a = *parts[first].a;
    size_t last = first;
    while (last < parts.size() && parts[last].a == &a) ++last;
    const int64_t ldp = RoundUp(a.n, 64);
    for (int64_t n0 = 0; n0 < a.n; n0 += 64)
      KnFinish<T>(parts[first].P, static_cast<int64_t>(last - first), a.m * ldp, a.m, ldp, n0,
                  a.n, static_cast<T*>(a.y));
    first = last;
  }
}

// ---------------------------------------------------------------- AVX-512 packed panels

// Many rows of x (compute-bound): a task copies a 64-column strip of w once into a panel
// laid out for its micro-kernel, then runs every row of its block against it from L1/L2.
//   bf16: panel[p][c] = (w[2p, c], w[2p+1, c]) as one 32-bit pair (0 past K), 64 columns:
//         one 256-byte row of pairs per pair of k, loaded straight into vdpbf16ps.
//   f32 ([N, K] layout only; [K, N] strips are read in place): panel[k][c] = w[c, k].
constexpr int64_t kPanelCols = 64;

// dst[j * ldd + i] = src[i * lds + j] for i < 16 (rows past nrows read as 0), j < ncols.
JS_AVX512 JS_INLINE void Transpose16(const uint32_t* src, int64_t lds, int64_t nrows,
                                     int64_t ncols, uint32_t* dst, int64_t ldd) {
  const __mmask16 m = Mask16(ncols);
  __m512i r[16];
  JS_UNROLL for (int i = 0; i < 16; ++i)
    r[i] = i < nrows ? _mm512_maskz_loadu_epi32(m, src + i * lds) : _mm512_setzero_si512();
  __m512i t[16], u[16];
  JS_UNROLL for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  JS_UNROLL for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // u[4i + j], 128-bit lane L: rows 4i..4i+3 of column 4L + j.
  __m512i out[16];
  JS_UNROLL for (int j = 0; j < 4; ++j) {
    const __m512i s0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
    const __m512i s1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
    const __m512i s2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i s3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    out[j] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    out[j + 8] = _mm512_shuffle_i32x4(s0, s2, 0xdd);
    out[j + 4] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    out[j + 12] = _mm512_shuffle_i32x4(s1, s3, 0xdd);
  }
  JS_UNROLL for (int j = 0; j < 16; ++j)
    if (j < ncols) _mm512_storeu_si512(dst + j * ldd, out[j]);
}

// Columns [n0, n0 + nc) of w as a panel (see above); units: 32-bit pairs for bf16, f32.
JS_AVX512 void PackPanel(const Mm& a, int64_t n0, int64_t nc, void* panel) {
  uint32_t* dst = static_cast<uint32_t*>(panel);
  if (a.trans) {
    // Rows n0.. of w [N, K] hold the panel's columns: a 32-bit transpose (bf16: of pairs).
    const int64_t units = a.bf16 ? a.k / 2 : a.k;  // whole pairs / floats per row
    const int64_t lds_bytes = a.k * (a.bf16 ? 2 : 4);
    const char* base = static_cast<const char*>(a.w) + n0 * lds_bytes;
    for (int64_t c0 = 0; c0 < kPanelCols; c0 += 16) {
      for (int64_t k0 = 0; k0 < units; k0 += 16) {
        // Rows of w start on 2-byte boundaries for odd K: index as 32-bit from each row.
        const int64_t nrows = std::clamp<int64_t>(nc - c0, 0, 16);
        uint32_t tmp_rows[16 * 16];
        const uint32_t* src;
        int64_t lds;
        if (a.bf16 && (a.k & 1)) {  // odd K: copy the rows' pairs to an aligned scratch
          for (int64_t i = 0; i < nrows; ++i)
            std::memcpy(tmp_rows + i * 16, base + (c0 + i) * lds_bytes + k0 * 4,
                        static_cast<size_t>(std::min<int64_t>(16, units - k0)) * 4);
          src = tmp_rows;
          lds = 16;
        } else {
          src = reinterpret_cast<const uint32_t*>(base + c0 * lds_bytes) + k0;
          lds = lds_bytes / 4;
        }
        for (int64_t i = 0; i < nrows; ++i)  // the same rows 4 blocks on
          _mm_prefetch(base + (c0 + i) * lds_bytes + (k0 + 64) * 4, _MM_HINT_T0);
        Transpose16(src, lds, nrows, std::min<int64_t>(16, units - k0), dst + k0 * kPanelCols + c0,
                    kPanelCols);
      }
    }
    if (a.bf16 && (a.k & 1)) {  // the last k pairs with zero
      const uint16_t* w = static_cast<const uint16_t*>(a.w);
      for (int64_t c = 0; c < kPanelCols; ++c)
        dst[units * kPanelCols + c] = c < nc ? w[(n0 + c) * a.k + a.k - 1] : 0;
    }
    return;
  }
  // bf16 [K, N]: interleave rows 2p and 2p + 1 (64 columns) in column order.
  const uint16_t* w = static_cast<const uint16_t*>(a.w);
  __m512i lo_idx, hi_idx;
  {
    alignas(64) uint16_t lo[32], hi[32];
    for (int i = 0; i < 16; ++i) {
      lo[2 * i] = i;
      lo[2 * i + 1] = 32 + i;
      hi[2 * i] = 16 + i;
      hi[2 * i + 1] = 48 + i;
    }
    lo_idx = _mm512_load_si512(lo);
    hi_idx = _mm512_load_si512(hi);
  }
  const __mmask32 m0 = Mask32(nc), m1 = Mask32(nc - 32);
  for (int64_t k = 0; k < a.k; k += 2) {
    const uint16_t* r0 = w + k * a.n + n0;
    const bool pair = k + 1 < a.k;
    const char* pf = reinterpret_cast<const char*>(r0 + (kPrefetchBytes / 128) * a.n);
    _mm_prefetch(pf, _MM_HINT_T0);
    _mm_prefetch(pf + 64, _MM_HINT_T0);
    _mm_prefetch(pf + 2 * a.n, _MM_HINT_T0);
    _mm_prefetch(pf + 2 * a.n + 64, _MM_HINT_T0);
    const __m512i a0 = _mm512_maskz_loadu_epi16(m0, r0);
    const __m512i a1 = _mm512_maskz_loadu_epi16(m1, r0 + 32);
    const __m512i b0 = _mm512_maskz_loadu_epi16(pair ? m0 : 0, r0 + a.n);
    const __m512i b1 = _mm512_maskz_loadu_epi16(pair ? m1 : 0, r0 + a.n + 32);
    uint32_t* d = dst + (k / 2) * kPanelCols;
    _mm512_storeu_si512(d, _mm512_permutex2var_epi16(a0, lo_idx, b0));
    _mm512_storeu_si512(d + 16, _mm512_permutex2var_epi16(a0, hi_idx, b0));
    _mm512_storeu_si512(d + 32, _mm512_permutex2var_epi16(a1, lo_idx, b1));
    _mm512_storeu_si512(d + 48, _mm512_permutex2var_epi16(a1, hi_idx, b1));
  }
}

// y[0:MR, 0:nc] = x[0:MR, :] @ (packed bf16 panel), nc <= 64; or, with `part`, the float32
// sums there (row stride kPanelCols): a part of K (PanelMatmul).
// Each step of k also prefetches `pf_step` lines of `pf` (the next panel's weights) into L2,
// up to `pf_lines`, so that memory streams them while this tile computes.
template <int MR>
JS_AVX512BF16 void Bf16PanelTile(const uint16_t* x, int64_t ldx, const uint32_t* panel,
                                 int64_t K, int64_t nc, uint16_t* y, int64_t ldy,
                                 const char* pf, int64_t pf_lines, int64_t pf_step,
                                 float* part) {
  __m512 acc[MR][4];
  JS_UNROLL for (int r = 0; r < MR; ++r)
    JS_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  int64_t p = 0;
  if (pairs > 0) {
    do {  // a do-while keeps acc in registers
      for (int64_t l = p * pf_step; l < std::min(pf_lines, (p + 1) * pf_step); ++l)
        _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
      const uint32_t* b = panel + p * kPanelCols;
      __m512bh bv[4];
      JS_UNROLL for (int v = 0; v < 4; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + 16 * v);
      JS_UNROLL for (int r = 0; r < MR; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(Load32(x + r * ldx + 2 * p));
        JS_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, bv[v]);
      }
    } while (++p < pairs);
  }
  if (K & 1) {  // the panel's last pair is (w[K-1], 0)
    const uint32_t* b = panel + pairs * kPanelCols;
    JS_UNROLL for (int r = 0; r < MR; ++r) {
      const __m512bh xv =
          (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[r * ldx + K - 1]));
      JS_UNROLL for (int v = 0; v < 4; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, (__m512bh)_mm512_loadu_si512(b + 16 * v));
    }
  }
  if (part != nullptr) {
    JS_UNROLL for (int r = 0; r < MR; ++r)
      JS_UNROLL for (int v = 0; v < 4; ++v)
        _mm512_storeu_ps(part + r * kPanelCols + 16 * v, acc[r][v]);
    return;
  }
  JS_UNROLL for (int r = 0; r < MR; ++r)
    JS_UNROLL for (int v = 0; v < 4; ++v)
      _mm256_mask_storeu_epi16(y + r * ldy + 16 * v, Mask16(nc - 16 * v),
                               (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
}

// Rows [m0, m0 + rows) against a packed panel of columns [n0, n0 + nc); the tiles spread
// prefetches of `pf_bytes` at `pf` (the next panel's rows of w) over their k loops. With
// `part`: the panel holds K's elements [k0, k0 + kn), and the tiles write their float32
// sums to part (rows of kPanelCols) instead of y.
template <typename T>
void PanelRows(const Mm& a, const void* panel, int64_t m0, int64_t rows, int64_t n0,
               int64_t nc, const char* pf = nullptr, int64_t pf_bytes = 0, int64_t k0 = 0,
               int64_t kn = -1, float* part = nullptr) {
  if (kn < 0) kn = a.k;
  const T* x = static_cast<const T*>(a.x) + k0;
  T* y = static_cast<T*>(a.y);
  const int64_t pf_lines = CeilDiv(pf_bytes, 64);
  const int64_t tile_lines = CeilDiv(pf_lines, CeilDiv(rows, kMaxTileRows));
  const int64_t k_steps = sizeof(T) == 4 ? kn : kn / 2;  // a tile's steps of k
  const int64_t pf_step = CeilDiv(tile_lines, std::max<int64_t>(1, k_steps));
  for (int64_t r = 0; r < rows; r += kMaxTileRows) {
    const int64_t first = r / kMaxTileRows * tile_lines;  // this tile's lines of pf
    const int64_t lines = std::clamp<int64_t>(pf_lines - first, 0, tile_lines);
    const char* tpf = lines > 0 ? pf + 64 * first : nullptr;
    const int64_t mr = std::min<int64_t>(kMaxTileRows, rows - r);
    const T* xr = x + (m0 + r) * a.k;
    T* yr = y + (m0 + r) * a.n + n0;
    float* pr = part ? part + r * kPanelCols : nullptr;
    if constexpr (sizeof(T) == 4) {
      const float* pw = static_cast<const float*>(panel);
      float* out = pr ? pr : yr;
      const int64_t ld = pr ? kPanelCols : a.n;
      switch (mr) {
        case 1: F32KnTile<1>(xr, a.k, pw, kPanelCols, kn, nc, out, ld, tpf, lines, pf_step); break;
        case 2: F32KnTile<2>(xr, a.k, pw, kPanelCols, kn, nc, out, ld, tpf, lines, pf_step); break;
        case 3: F32KnTile<3>(xr, a.k, pw, kPanelCols, kn, nc, out, ld, tpf, lines, pf_step); break;
        case 4: F32KnTile<4>(xr, a.k, pw, kPanelCols, kn, nc, out, ld, tpf, lines, pf_step); break;
        case 5: F32KnTile<5>(xr, a.k, pw, kPanelCols, kn, nc, out, ld, tpf, lines, pf_step); break;
        default:
          F32KnTile<6>(xr, a.k, pw, kPanelCols, kn, nc, out, ld, tpf, lines, pf_step);
      }
    } else {
      const uint32_t* pw = static_cast<const uint32_t*>(panel);
      switch (mr) {
        case 1: Bf16PanelTile<1>(xr, a.k, pw, kn, nc, yr, a.n, tpf, lines, pf_step, pr); break;
        case 2: Bf16PanelTile<2>(xr, a.k, pw, kn, nc, yr, a.n, tpf, lines, pf_step, pr); break;
        case 3: Bf16PanelTile<3>(xr, a.k, pw, kn, nc, yr, a.n, tpf, lines, pf_step, pr); break;
        case 4: Bf16PanelTile<4>(xr, a.k, pw, kn, nc, yr, a.n, tpf, lines, pf_step, pr); break;
        case 5: Bf16PanelTile<5>(xr, a.k, pw, kn, nc, yr, a.n, tpf, lines, pf_step, pr); break;
        default: Bf16PanelTile<6>(xr, a.k, pw, kn, nc, yr, a.n, tpf, lines, pf_step, pr); break;
      }
    }
  }
}

// Several weights sharing x (q/k/v, gate/up; one or more): their 64-column strips are one
// list of tasks (strip, block of rows), at least 4 per thread, blocks of 6..128 rows, so
// a small weight (k, v: 3 strips) shares the others' threads and prefetches instead of
// paying a start and a cold first strip of its own. Where every strip is one block and
// they do not divide among the threads (a 576-column weight is 9 strips), the strips left
// over are split so that no thread computes a whole strip more than another (measured: 32
// rows of smollm2-135m's q/o/down took 5 strips' time on one of 2 threads, the other 4):
// into a block of rows per thread, or, packed weights with up to kSplitKRows rows, into a
// part of K per thread (each reads its part of the strip once; the float32 sums are added
// at the end).
// Packed weights (Mm::packed) are their own panels: no copy; a task's first tile of rows
// prefetches its own strip ahead (kPanelPrefetchBytes), as the dot-product paths do (bf16
// with more rows: the next strip, as when packing), and with up to kSplitKRows rows the
// whole strips are one run of consecutive ones per thread (the prefetch runs on from one
// strip into the next; each run starts cold: smollm2-135m's bf16 layers at one row, strips
// claimed one by one 1.13-1.16x the time, 8 / 4 / 2 runs per thread 1.04-1.10x / 1.0x /
// 0.95-0.97x, one run 0.91x the time of [N, K]'s dot products). Up to one tile of rows:
// past it, strips claimed one by one with their leftovers split by rows took less time
// than runs with leftovers split by K, as up to 32 rows before (smollm2-135m's layers,
// 2-core Zen 4 EPYC, the two alternating call by call): bf16 8 / 16 / 32 rows 0.87x /
// 0.90x / 0.95x the time, 12 and 24 rows 1.00x; float32 8-32 rows 0.96-0.97x.
constexpr int64_t kSplitKRows = kMaxTileRows;
// How far ahead of a packed strip's first tile of rows its prefetches run. The strip is
// contiguous and the hardware's stream prefetch does most of the work: 4 KiB
// (kPrefetchBytes) ahead, the software prefetches slowed the stream. Measured on
// smollm2-135m's layers (2-core Zen 4 EPYC, the model's matmuls as one chain, the
// distances alternating call by call): 4 KiB took 1.09-1.13x the time of 1 KiB at 1 row
// (bf16 and float32), 0.98-1.11x at 2-8 rows (one run of 8 float32 rows: 0.91x),
// 0.99-1.07x at 16-64 and 0.98-1.00x at 512. 512 B and 2 KiB were no faster than 1 KiB
// (2 KiB: 1.12x the time of 4 KiB at 8 float32 rows); no prefetch took 1.04x the time of
// 1 KiB at 1 float32 row, and 1.05-1.07x that of 4 KiB at 16-32 bf16 rows
// (benchmarks/RESULTS.md, stop 49).
constexpr int64_t kPanelPrefetchBytes = 1024;

template <typename T>
void PanelMatmul(const Runner& run, const Mm* as, int64_t count) {
  const Mm& a0 = as[0];  // the same x: m, k, layout and dtype for all
  std::vector<int64_t> first(count + 1, 0);  // weight j's strips: [first[j], first[j + 1])
  for (int64_t j = 0; j < count; ++j) first[j + 1] = first[j] + CeilDiv(as[j].n, kPanelCols);
  const int64_t threads = run.threads();
  const int64_t strips = first[count];
  const int64_t want = std::clamp(CeilDiv(4 * threads, strips), CeilDiv(a0.m, 256),
                                  CeilDiv(a0.m, kMaxTileRows));
  const int64_t rb = RoundUp(CeilDiv(a0.m, want), kMaxTileRows);
  const int64_t blocks = CeilDiv(a0.m, rb);
  const int64_t left = blocks == 1 ? strips % threads : 0;  // strips split by rows or K
  const bool by_k = a0.packed && a0.m <= kSplitKRows;
  const int64_t split_rb = RoundUp(CeilDiv(a0.m, threads), kMaxTileRows);
  const int64_t splits = by_k ? threads : CeilDiv(a0.m, split_rb);
  const int64_t whole = strips * blocks - left;  // tasks of one (strip, block) each
  const int64_t units = a0.bf16 ? a0.k / 2 : a0.k;  // rows of a panel: pairs or floats
  struct Task {
    int64_t strip, m0, rows;
    int64_t u0 = 0, un = -1, part = -1;  // by_k: panel rows [u0, u0 + un), its sums' slot
  };
  auto task = [&](int64_t i) {
    if (i < whole) {
      const int64_t m0 = i % blocks * rb;
      return Task{i / blocks, m0, std::min(rb, a0.m - m0)};
    }
    const int64_t j = i - whole, s = strips - left + j / splits, p = j % splits;
    if (by_k) {
      const int64_t u0 = p * units / threads, u1 = (p + 1) * units / threads;
      return Task{s, 0, a0.m, u0, u1 - u0, j};
    }
    const int64_t m0 = p * split_rb;
    return Task{s, m0, std::min(split_rb, a0.m - m0)};
  };
  // Strip s: its weight, and its first column there.
  auto strip = [&](int64_t s, int64_t* n0) -> const Mm& {
    const int64_t j = std::upper_bound(first.begin(), first.end(), s) - first.begin() - 1;
    *n0 = (s - first[j]) * kPanelCols;
    return as[j];
  };
  const int64_t tasks = whole + left * splits;
  const size_t panel_bytes = static_cast<size_t>(RoundUp(a0.k, 2)) * kPanelCols * 4;
  const int64_t row_bytes = a0.k * static_cast<int64_t>(sizeof(T));  // of an [N, K] w
  const int64_t part_floats = a0.m * kPanelCols;
  // The calling thread's buffer (no allocation per call); the tasks, on any thread, write
  // through `sums` (a thread_local named inside them would be the running thread's own).
  thread_local std::vector<float> sums_buffer;
  if (by_k && sums_buffer.size() < static_cast<size_t>(left * splits * part_floats))
    sums_buffer.resize(left * splits * part_floats);
  float* const sums = sums_buffer.data();
  auto run_task = [&](int64_t i) {
    const Task t = task(i);
    int64_t n0;
    const Mm& a = strip(t.strip, &n0);
    const int64_t nc = std::min(kPanelCols, a.n - n0);
    if (a.packed) {
      // Panel rows [u0, u0 + un).
      const int64_t u0 = t.u0, un = t.un < 0 ? units : t.un, per_unit = a.bf16 ? 2 : 1;
      const char* strip_w = static_cast<const char*>(a.w) + n0 * row_bytes;
      const uint32_t* panel = reinterpret_cast<const uint32_t*>(strip_w) + u0 * kPanelCols;
      float* part = t.part < 0 ? nullptr : sums + t.part * part_floats;
      if (a.bf16 && t.rows > kMaxTileRows && part == nullptr && t.strip + 1 < strips) {
        // bf16, several tiles of rows: they prefetch the next strip (this thread's next,
        // in a run) spread over their k loops, as with packing per call (float32 ran
        // slower so: 9 rows 1.14x, 32 rows 1.09x the time of the below).
        int64_t next_n0;
        const Mm& b = strip(t.strip + 1, &next_n0);
        return PanelRows<T>(a, panel, t.m0, t.rows, n0, nc,
                            static_cast<const char*>(b.w) + next_n0 * row_bytes,
                            kPanelCols * row_bytes);
      }
      // The first tile of rows streams the strip from memory, prefetching it ahead; the
      // others read it from L2.
      const int64_t r1 = std::min<int64_t>(t.rows, kMaxTileRows);
      const char* ahead = reinterpret_cast<const char*>(panel) + kPanelPrefetchBytes;
      PanelRows<T>(a, panel, t.m0, r1, n0, nc, ahead, un * kPanelCols * 4, u0 * per_unit,
                   un * per_unit, part);
      if (t.rows > r1) {
        PanelRows<T>(a, panel, t.m0 + r1, t.rows - r1, n0, nc, nullptr, 0, u0 * per_unit,
                     un * per_unit, part ? part + r1 * kPanelCols : nullptr);
      }
      return;
    }
    thread_local std::vector<uint32_t> buf;
    if (buf.size() * 4 < panel_bytes) buf.resize(panel_bytes / 4);
    PackPanel(a, n0, nc, buf.data());
    // [N, K] weights: the strip this thread likely takes next (task i + threads) is one
    // block of rows of w; fetch it while computing this one (packing waits on memory).
    const char* pf = nullptr;
    int64_t pf_bytes = 0;
    if (a.trans && i + threads < tasks) {
      const int64_t next = task(i + threads).strip;
      int64_t next_n0;
      const Mm& b = strip(next, &next_n0);
      if (next != t.strip) {
        pf = static_cast<const char*>(b.w) + next_n0 * row_bytes;
        pf_bytes = std::min(kPanelCols, b.n - next_n0) * row_bytes;
      }
    }
    PanelRows<T>(a, buf.data(), t.m0, t.rows, n0, nc, pf, pf_bytes);
  };
  const int64_t per = by_k ? std::max<int64_t>(1, whole / threads) : 1;
  const int64_t runs = CeilDiv(whole, per);
  run.For(runs + tasks - whole, [&](int64_t i) {
    if (i >= runs) return run_task(whole + i - runs);
    for (int64_t j = i * per; j < std::min(whole, (i + 1) * per); ++j) run_task(j);
  });
  // by_k: each strip left over is the sum of its parts (M x 64 floats each; this thread).
  for (int64_t l = 0; by_k && l < left; ++l) {
    int64_t n0;
    const Mm& a = strip(strips - left + l, &n0);
    T* y = static_cast<T*>(a.y);
    const float* s0 = sums + l * splits * part_floats;
    for (int64_t r = 0; r < a.m; ++r)
      for (int64_t c = 0; c < kPanelCols; ++c) {
        float v = 0.0f;
        for (int64_t p = 0; p < splits; ++p) v += s0[p * part_floats + r * kPanelCols + c];
        y[r * a.n + n0 + c] = FromF32<T>(v);
      }
  }
}

// ---------------------------------------------------------------- AVX-512 task plans

// f32 KN: rows [m0, m0 + rows) x columns [n0, n0 + nc), micro-tiles of 6 rows x 64 columns,
// w read in place (its 64-column strip stays in L2 while the rows pass it).
void F32KnBlock(const Mm& a, int64_t m0, int64_t rows, int64_t n0, int64_t nc) {
  const float* x = static_cast<const float*>(a.x);
  const float* w = static_cast<const float*>(a.w);
  float* y = static_cast<float*>(a.y);
  for (int64_t c = 0; c < nc; c += kTileCols) {
    const int64_t tc = std::min(kTileCols, nc - c);
    for (int64_t r = 0; r < rows; r += kMaxTileRows) {
      const int64_t mr = std::min<int64_t>(kMaxTileRows, rows - r);
      const float* xr = x + (m0 + r) * a.k;
      const float* wc = w + n0 + c;
      float* yr = y + (m0 + r) * a.n + n0 + c;
      switch (mr) {
        case 1: F32KnTile<1>(xr, a.k, wc, a.n, a.k, tc, yr, a.n); break;
        case 2: F32KnTile<2>(xr, a.k, wc, a.n, a.k, tc, yr, a.n); break;
        case 3: F32KnTile<3>(xr, a.k, wc, a.n, a.k, tc, yr, a.n); break;
        case 4: F32KnTile<4>(xr, a.k, wc, a.n, a.k, tc, yr, a.n); break;
        case 5: F32KnTile<5>(xr, a.k, wc, a.n, a.k, tc, yr, a.n); break;
        default: F32KnTile<6>(xr, a.k, wc, a.n, a.k, tc, yr, a.n); break;
      }
    }
  }
}

template <typename T, int MR, int NT>
JS_INLINE void NkTile(const T* const* xr, const T* const* wr, int64_t K, int64_t mr, int64_t nt,
                      T* y, int64_t ldy) {
  if constexpr (sizeof(T) == 4) {
    F32NkTile<MR, NT>(xr, wr, K, mr, nt, y, ldy);
  } else {
    Bf16NkTile<MR, NT>(xr, wr, K, mr, nt, y, ldy);
  }
}

// NK, MR x NT tiles over rows [m0, m0 + rows) x weight rows [n0, n0 + nn): weight tiles
// outer, so NT weight rows stay in L1 while every group of MR rows of x passes them.
template <typename T, int MR, int NT>
void NkTiles(const Mm& a, int64_t m0, int64_t rows, int64_t n0, int64_t nn) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  T* y = static_cast<T*>(a.y);
  for (int64_t t0 = 0; t0 < nn; t0 += NT) {
    const int64_t nt = std::min<int64_t>(NT, nn - t0);
    const T* wr[NT];
    JS_UNROLL for (int t = 0; t < NT; ++t)
      wr[t] = w + (n0 + t0 + std::min<int64_t>(t, nt - 1)) * a.k;
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
      const int64_t mr = std::min<int64_t>(MR, rows - r0);
      const T* xr[MR];
      JS_UNROLL for (int r = 0; r < MR; ++r)
        xr[r] = x + (m0 + r0 + std::min<int64_t>(r, mr - 1)) * a.k;
      T* yt = y + (m0 + r0) * a.n + n0 + t0;
      if constexpr (MR == 4) {
        // A last group of 1-3 rows after others (the weight rows in L1): those rows only.
        // Alone, 3 rows stream faster as a 4 x 4 tile with one row repeated.
        if (r0 > 0 && mr < MR) {
          switch (mr) {
            case 1: NkTile<T, 1, NT>(xr, wr, a.k, mr, nt, yt, a.n); break;
            case 2: NkTile<T, 2, NT>(xr, wr, a.k, mr, nt, yt, a.n); break;
            default: NkTile<T, 3, NT>(xr, wr, a.k, mr, nt, yt, a.n); break;
          }
          continue;
        }
      }
      NkTile<T, MR, NT>(xr, wr, a.k, mr, nt, yt, a.n);
    }
  }
}

// NK, up to NkFewRows rows: one row -> 1 x 16 tiles, two -> 2 x 8, more -> 4 x 4 (a last
// group of 1-3 rows after others as a 1-3 x 4 tile; 3 rows alone as 4 x 4). Every weight
// tile is read from memory once and passed by every group of rows while it is in L1.
// Measured on smollm2-135m's weights (bf16, all layers): up to 24 rows this beats packing
// panels (8 rows 15.0 against 17.7 ms, 16 rows 18.6 against 21.9, 24 rows 24.2 against
// 26.0; 32 rows equal); 6 x 2 and 8 x 2 tiles were slower than 4 x 4 ones (5 rows 15.1
// against 13.4 ms). float32 takes them up to 32 rows: at 32 its 30 layers of GEMMs ran
// 21-22 ms against 22-26 through panels (fastest / p20 of 150 calls, Zen 5, 2026-11-26),
// where bf16 ran 15-16 against 13-14 and stays at 24.
constexpr int64_t NkFewRows(bool bf16) { return bf16 ? 24 : 32; }

template <typename T>
void NkBlock(const Mm& a, int64_t m0, int64_t rows, int64_t n0, int64_t nn) {
  if (rows == 1) return NkTiles<T, 1, 16>(a, m0, rows, n0, nn);
  if (rows == 2) return NkTiles<T, 2, 8>(a, m0, rows, n0, nn);
  NkTiles<T, 4, 4>(a, m0, rows, n0, nn);
}

// One parallel loop over blocks of weight rows of all the [N, K] weights in `as` (no
// barrier between the weights): block(j, n0, nn) computes rows [n0, n0 + nn) of as[j].
template <typename Fn>
void ForWeightRowBlocks(const Runner& run, const Mm* as, int64_t count, const Fn& block) {
  std::vector<int64_t> nbs(count), starts(count + 1, 0);
  for (int64_t j = 0; j < count; ++j) {
    nbs[j] = std::clamp<int64_t>(RoundUp(CeilDiv(as[j].n, 4), 16), 16, 512);
    starts[j + 1] = starts[j] + CeilDiv(as[j].n, nbs[j]);
  }
  run.For(starts[count], [&](int64_t i) {
    int64_t j = 0;
    while (i >= starts[j + 1]) ++j;
    const int64_t n0 = (i - starts[j]) * nbs[j];
    block(j, n0, std::min(nbs[j], as[j].n - n0));
  });
}

// Few rows of x against [N, K] weights sharing it.
template <typename T>
void FewRowsNk(const Runner& run, const Mm* as, int64_t count) {
  ForWeightRowBlocks(run, as, count, [&](int64_t j, int64_t n0, int64_t nn) {
    NkBlock<T>(as[j], 0, as[j].m, n0, nn);
  });
}

template <typename T>
void Avx512Matmul(const Runner& run, const Mm& a) {
  // Bandwidth-bound: stream w once in its own layout.
  if (a.trans && a.m <= NkFewRows(sizeof(T) == 2)) return FewRowsNk<T>(run, &a, 1);
  if (!a.trans && a.m <= kMaxTileRows) return FewRowsKn<T>(run, &a, 1);
  if constexpr (sizeof(T) == 4) {
    if (!a.trans) {  // f32 [K, N]: 64-column strips read in place (rows of 256 bytes)
      const int64_t blocks = CeilDiv(a.m, 48);
      const int64_t rb = RoundUp(CeilDiv(a.m, blocks), kMaxTileRows);
      const int64_t row_blocks = CeilDiv(a.m, rb), col_tiles = CeilDiv(a.n, kTileCols);
      return run.For(row_blocks * col_tiles, [&](int64_t i) {
        const int64_t r = i / col_tiles, c = i % col_tiles;
        F32KnBlock(a, r * rb, std::min(rb, a.m - r * rb), c * kTileCols,
                   std::min(kTileCols, a.n - c * kTileCols));
      });
    }
  }
  PanelMatmul<T>(run, &a, 1);
}

// ---------------------------------------------------------------- AVX2 NK

// Decode on a CPU without the AVX-512 paths: 1 to 8 rows of x (float32; bf16 converted
// once, `xf`) against [N, K] weights, one weight row after another in memory order, each dotted
// with every row of x in 8-lane FMAs (1-4 accumulators a row); one row of x reads several
// parts of the block at once (Avx2NkRowStreams). The generic loop reads bf16 weights at
// ~1/3 of the bandwidth (10.5 of 32 GB/s on a 2-core AVX2 EPYC).
JS_AVX2 JS_INLINE __m256 Avx2Load8(const float* p) { return _mm256_loadu_ps(p); }
JS_AVX2 JS_INLINE __m256 Avx2Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

JS_AVX2 JS_INLINE float Avx2Sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename T, int MR>
JS_AVX2 void Avx2NkRows(const Mm& a, const float* xf, int64_t n0, int64_t nn) {
  // V accumulators a row: at least 8 FMA chains in flight, at most 12 registers of them.
  constexpr int V = MR <= 3 ? 4 : MR <= 6 ? 2 : 1;
  const T* w = static_cast<const T*>(a.w);
  T* y = static_cast<T*>(a.y);
  const int64_t K = a.k;
  for (int64_t n = n0; n < n0 + nn; ++n) {
    const T* wn = w + n * K;
    __m256 acc[MR][V];
    JS_UNROLL for (int r = 0; r < MR; ++r)
      JS_UNROLL for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const char* ahead = reinterpret_cast<const char*>(wn + k) + kPrefetchBytes;
      _mm_prefetch(ahead, _MM_HINT_T0);
      if constexpr (sizeof(T) == 4) _mm_prefetch(ahead + 64, _MM_HINT_T0);
      JS_UNROLL for (int u = 0; u < 4; ++u) {
        const __m256 b = Avx2Load8(wn + k + 8 * u);
        JS_UNROLL for (int r = 0; r < MR; ++r)
          acc[r][u % V] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + r * K + k + 8 * u), b,
                                          acc[r][u % V]);
      }
    }
    JS_UNROLL for (int r = 0; r < MR; ++r) {
      __m256 total = acc[r][0];
      JS_UNROLL for (int v = 1; v < V; ++v) total = _mm256_add_ps(total, acc[r][v]);
      float sum = Avx2Sum(total);
      for (int64_t t = k; t < K; ++t) sum += xf[r * K + t] * ToF32<T>(wn[t]);
      y[r * a.n + n] = FromF32<T>(sum);
    }
  }
}

// Decode, one row of x: the block of weight rows [n0, n0 + nn) cut into S parts read side
// by side, one row of each at a time (S streams in flight instead of one: on a 2-core
// AVX2 EPYC a model's worth of bf16 matrix-vector products went from 14.3 to 20.0 GB/s
// with 8 streams, f32 from 17.8 to 26.8 with 4, where XLA's dot reads f32 at 22; 8 / S
// accumulators a stream). Rows left over after S equal parts stream one by one.
template <typename T, int S>
JS_AVX2 void Avx2NkRowStreams(const Mm& a, const float* xf, int64_t n0, int64_t nn) {
  constexpr int V = 8 / S;
  const T* w = static_cast<const T*>(a.w);
  T* y = static_cast<T*>(a.y);
  const int64_t K = a.k, part = nn / S;
  for (int64_t i = 0; i < part; ++i) {
    const T* rows[S];
    JS_UNROLL for (int r = 0; r < S; ++r) rows[r] = w + (n0 + r * part + i) * K;
    __m256 acc[S][V];
    JS_UNROLL for (int r = 0; r < S; ++r)
      JS_UNROLL for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 * V <= K; k += 8 * V) {
      JS_UNROLL for (int v = 0; v < V; ++v) {
        const __m256 xv = _mm256_loadu_ps(xf + k + 8 * v);
        JS_UNROLL for (int r = 0; r < S; ++r)
          acc[r][v] = _mm256_fmadd_ps(xv, Avx2Load8(rows[r] + k + 8 * v), acc[r][v]);
      }
    }
    JS_UNROLL for (int r = 0; r < S; ++r) {
      __m256 t = acc[r][0];
      JS_UNROLL for (int v = 1; v < V; ++v) t = _mm256_add_ps(t, acc[r][v]);
      float sum = Avx2Sum(t);
      for (int64_t e = k; e < K; ++e) sum += xf[e] * ToF32<T>(rows[r][e]);
      y[n0 + r * part + i] = FromF32<T>(sum);
    }
  }
  if (nn % S) Avx2NkRows<T, 1>(a, xf, n0 + S * part, nn % S);
}

// The 8 x 8 block r (row i in r[i]) transposed, in registers.
JS_AVX2 JS_INLINE void Transpose8(__m256* r) {
  __m256 t[8];
  JS_UNROLL for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  JS_UNROLL for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  JS_UNROLL for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
  JS_UNROLL for (int i = 0; i < 8; ++i) r[i] = t[i];
}

// Prompts and batches: 16 weight rows at a time are packed into a float32 panel [K][16]
// (transposed, bf16 widened once), then 6 x 16 register tiles of y (12 accumulators, 2
// panel vectors, an element of x broadcast) run over every row of x against it: the
// inner loop is FMAs and loads, no widening and no horizontal sums. Each panel is packed
// once and every row of x runs against it, in blocks of 48 rows whose partial sums stay in
// L1 (packing it again for every block of rows read a [49152, 576] LM head from memory
// once per 48 rows: smollm2-135m's matmuls at 64 rows 10-20% slower, at 512 rows 5-15%).
constexpr int kAvx2PanelCols = 16, kAvx2TileRows = 6;
constexpr int64_t kAvx2RowBlock = 48;

// Weight rows w[0, cols) (cols <= 16; the last repeated past it) -> panel[k * 16 + c].
template <typename T>
JS_AVX2 void PackAvx2Panel(const T* w, int64_t K, int64_t cols, float* panel) {
  const T* rows[kAvx2PanelCols];
  for (int c = 0; c < kAvx2PanelCols; ++c) rows[c] = w + std::min<int64_t>(c, cols - 1) * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    JS_UNROLL for (int h = 0; h < 2; ++h) {
      __m256 r[8];
      JS_UNROLL for (int i = 0; i < 8; ++i) r[i] = Avx2Load8(rows[8 * h + i] + k);
      Transpose8(r);
      JS_UNROLL for (int i = 0; i < 8; ++i)
        _mm256_storeu_ps(panel + (k + i) * kAvx2PanelCols + 8 * h, r[i]);
    }
  }
  for (; k < K; ++k)
    for (int c = 0; c < kAvx2PanelCols; ++c) panel[k * kAvx2PanelCols + c] = ToF32<T>(rows[c][k]);
}

// acc[r][0:16] (+)= x[r, 0:kn] . panel[0:kn] for RB rows of x (row stride ldx).
template <int RB>
JS_AVX2 JS_INLINE void Avx2PanelTile(const float* x, int64_t ldx, const float* panel,
                                     int64_t kn, float* acc_rows, bool first) {
  __m256 acc[RB][2];
  JS_UNROLL for (int r = 0; r < RB; ++r) {
    acc[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_rows + r * kAvx2PanelCols);
    acc[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_rows + r * kAvx2PanelCols + 8);
  }
  for (int64_t k = 0; k < kn; ++k) {
    const __m256 p0 = _mm256_loadu_ps(panel + k * kAvx2PanelCols);
    const __m256 p1 = _mm256_loadu_ps(panel + k * kAvx2PanelCols + 8);
    JS_UNROLL for (int r = 0; r < RB; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xb, p0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, p1, acc[r][1]);
    }
  }
  JS_UNROLL for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(acc_rows + r * kAvx2PanelCols, acc[r][0]);
    _mm256_storeu_ps(acc_rows + r * kAvx2PanelCols + 8, acc[r][1]);
  }
}

// K in blocks whose slice of the panel (256 x 16 float32: 16 KiB) and of 6 rows of x
// (6 KiB) stay in L1; partial sums of a block of rows in a float32 buffer.
constexpr int64_t kAvx2PanelDepth = 256;

template <typename T>
JS_AVX2 void Avx2NkPanels(const Mm& a, const float* xf, int64_t n0, int64_t nn) {
  thread_local std::vector<float> buf;
  const size_t need = (a.k + kAvx2RowBlock) * kAvx2PanelCols;
  if (buf.size() < need) buf.resize(need);
  float* panel = buf.data();
  float* acc = panel + a.k * kAvx2PanelCols;  // [kAvx2RowBlock][16]
  const T* w = static_cast<const T*>(a.w);
  T* y = static_cast<T*>(a.y);
  const int64_t K = a.k;
  for (int64_t c0 = n0; c0 < n0 + nn; c0 += kAvx2PanelCols) {
    const int64_t cols = std::min<int64_t>(kAvx2PanelCols, n0 + nn - c0);
    PackAvx2Panel<T>(w + c0 * K, K, cols, panel);
    for (int64_t m0 = 0; m0 < a.m; m0 += kAvx2RowBlock) {
      const int64_t rows = std::min(kAvx2RowBlock, a.m - m0);
      for (int64_t k0 = 0; k0 < K; k0 += kAvx2PanelDepth) {
        const int64_t kn = std::min(kAvx2PanelDepth, K - k0);
        const float* p = panel + k0 * kAvx2PanelCols;
        const float* x = xf + m0 * K + k0;
        // Tiles of 6 rows; a remainder of 1 or 2 rows joins the last tile's 6 as 4 + 3 or
        // 4 + 4 (1 or 2 rows keep 2 or 4 FMA chains: half the FMA units idle on latency).
        const int64_t tail = rows % kAvx2TileRows;
        const int64_t six_end = rows - (rows > kAvx2TileRows && tail > 0 && tail < 3
                                            ? kAvx2TileRows + tail : tail);
        int64_t r = 0;
        for (; r < six_end; r += kAvx2TileRows)
          Avx2PanelTile<kAvx2TileRows>(x + r * K, K, p, kn, acc + r * kAvx2PanelCols, k0 == 0);
        while (r < rows) {
          const int64_t left = rows - r;
          const int64_t take = left >= 7 ? 4 : left;
          float* ar = acc + r * kAvx2PanelCols;
          switch (take) {
            case 1: Avx2PanelTile<1>(x + r * K, K, p, kn, ar, k0 == 0); break;
            case 2: Avx2PanelTile<2>(x + r * K, K, p, kn, ar, k0 == 0); break;
            case 3: Avx2PanelTile<3>(x + r * K, K, p, kn, ar, k0 == 0); break;
            case 4: Avx2PanelTile<4>(x + r * K, K, p, kn, ar, k0 == 0); break;
            default: Avx2PanelTile<5>(x + r * K, K, p, kn, ar, k0 == 0); break;
          }
          r += take;
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          y[(m0 + r) * a.n + c0 + c] = FromF32<T>(acc[r * kAvx2PanelCols + c]);
    }
  }
}

// Weights sharing x, all [N, K], on the real rows only: 1-8 rows stream each weight row
// once (Avx2NkRowStreams, Avx2NkRows), 3-8 of them while x's rows fit in L1 beside them
// (kAvx2RowsXBytes); more rows run packed panels (Avx2NkPanels). On a 2-core AVX2 EPYC,
// f32, fastest of 300 calls, panels -> rows: [1536, 576] x 2 at 3 / 5 / 8 rows 0.25-0.28 /
// 0.31-0.32 / 0.33-0.37 -> 0.17 / 0.19-0.21 / 0.22-0.25 ms; the [49152, 576] LM head at 5
// rows 7.7-8.1 -> 4.5-5.1 (bf16 7.1-7.6 -> 2.7-3.2): packing a panel cost more than its
// few rows' FMAs. 8 rows of K 1536 (48 KiB of x) ran slower as rows (0.21-0.26 -> 0.23-0.42).
constexpr int64_t kAvx2RowsXBytes = 24 * 1024;
template <typename T>
void Avx2Nk(const Runner& run, const Mm* as, int64_t count) {
  const Mm& a = as[0];
  std::vector<float> converted;  // bf16 x as float32; f32 x is read in place
  const float* xf = static_cast<const float*>(a.x);
  if constexpr (sizeof(T) == 2) {
    converted.resize(a.m * a.k);
    for (int64_t i = 0; i < a.m * a.k; ++i)
      converted[i] = Bf16ToF32(static_cast<const uint16_t*>(a.x)[i]);
    xf = converted.data();
  }
  ForWeightRowBlocks(run, as, count, [&](int64_t j, int64_t n0, int64_t nn) {
    const bool streamed = a.m <= 2 || a.m * a.k * int64_t{sizeof(float)} <= kAvx2RowsXBytes;
    switch (streamed ? a.m : 0) {
      case 1: return Avx2NkRowStreams<T, sizeof(T) == 2 ? 8 : 4>(as[j], xf, n0, nn);
      case 2: return Avx2NkRows<T, 2>(as[j], xf, n0, nn);
      case 3: return Avx2NkRows<T, 3>(as[j], xf, n0, nn);
      case 4: return Avx2NkRows<T, 4>(as[j], xf, n0, nn);
      case 5: return Avx2NkRows<T, 5>(as[j], xf, n0, nn);
      case 6: return Avx2NkRows<T, 6>(as[j], xf, n0, nn);
      case 7: return Avx2NkRows<T, 7>(as[j], xf, n0, nn);
      case 8: return Avx2NkRows<T, 8>(as[j], xf, n0, nn);
      default: return Avx2NkPanels<T>(as[j], xf, n0, nn);
    }
  });
}
#endif  // JS_X86

void Matmul(const Runner& run, const Mm& a);

// Weights sharing x: few rows stream them together (FewRowsKn, FewRowsNk), more rows pack
// the panels of all of them in one parallel loop (PanelMatmul); below those paths' ISA,
// [N, K] weights run the AVX2 paths in one parallel loop (Avx2Nk); else (f32 [K, N] weights
// read in place, generic loops) one matmul after another.
void Matmuls(const Runner& run, const Mm* as, int64_t count) {
#if JS_X86
  const Mm& a = as[0];
  const int isa = CurrentIsa();
  if (a.packed) {  // all of them (one attribute per call): their own panels
    const bool any_empty = std::any_of(as, as + count, [](const Mm& b) { return b.n == 0; });
    if (a.m > 0 && a.k > 0 && !any_empty && isa >= (a.bf16 ? kAvx512Bf16 : kAvx512)) {
      return a.bf16 ? PanelMatmul<uint16_t>(run, as, count) : PanelMatmul<float>(run, as, count);
    }
    for (int64_t i = 0; i < count; ++i) Matmul(run, as[i]);  // the generic loops
    return;
  }
  const bool together = count > 1 && a.m > 0 && a.m <= kMaxTileRows && a.k > 0 &&
                        std::all_of(as, as + count, [](const Mm& b) { return !b.trans && b.n > 0; });
  if (together && a.bf16 && isa >= kAvx512Bf16) return FewRowsKn<uint16_t>(run, as, count);
  if (together && !a.bf16 && isa >= kAvx512) return FewRowsKn<float>(run, as, count);
  const bool all_nk = a.m > 0 && a.k > 0 &&
                      std::all_of(as, as + count, [](const Mm& b) { return b.trans && b.n > 0; });
  const bool nk = all_nk && count > 1 && a.m <= NkFewRows(a.bf16);
  if (nk && a.bf16 && isa >= kAvx512Bf16) return FewRowsNk<uint16_t>(run, as, count);
  if (nk && !a.bf16 && isa >= kAvx512) return FewRowsNk<float>(run, as, count);
  if (all_nk && isa >= kAvx2 && isa < (a.bf16 ? kAvx512Bf16 : kAvx512)) {
    return a.bf16 ? Avx2Nk<uint16_t>(run, as, count) : Avx2Nk<float>(run, as, count);
  }
  // Panels: [N, K] weights past the few-row tiles, or bf16 [K, N] past the few-row sums.
  const bool panels = count > 1 && a.k > 0 &&
                      std::all_of(as, as + count, [&](const Mm& b) {
                        return b.trans == a.trans && b.n > 0 &&
                               b.m > (a.trans ? NkFewRows(a.bf16) : kMaxTileRows);
                      });
  if (panels && a.bf16 && isa >= kAvx512Bf16) return PanelMatmul<uint16_t>(run, as, count);
  if (panels && !a.bf16 && a.trans && isa >= kAvx512) return PanelMatmul<float>(run, as, count);
#endif
  for (int64_t i = 0; i < count; ++i) Matmul(run, as[i]);
}

void Matmul(const Runner& run, const Mm& a) {
  if (a.m == 0 || a.n == 0) return;
  const size_t esize = a.bf16 ? 2 : 4;
  if (a.k == 0) {
    std::memset(a.y, 0, static_cast<size_t>(a.m * a.n) * esize);
    return;
  }
  const int isa = CurrentIsa();
  if (a.packed) return GenericMatmul(run, a, isa);  // below the panels' ISA (Matmuls)
#if JS_X86
  if (a.bf16 && isa >= kAvx512Bf16) return Avx512Matmul<uint16_t>(run, a);
  if (!a.bf16 && isa >= kAvx512) return Avx512Matmul<float>(run, a);
  if (a.trans && isa >= kAvx2) {
    return a.bf16 ? Avx2Nk<uint16_t>(run, &a, 1) : Avx2Nk<float>(run, &a, 1);
  }
#endif
  GenericMatmul(run, a, isa);
}

// ==========================================================================================
// Row-wise ops on the real rows: RMSNorm (optionally after a residual add) and gated
// activations. Plain C++ over f32, compiled three times (scalar, AVX2, AVX-512) so the
// compiler vectorises the column loops; rows >= num_rows are left unwritten.
// ==========================================================================================

enum RowsAct : int { kActSilu = 0, kActGeluTanh = 1 };

// e^x, branch-free so that loops over it vectorise: 2^n * p(r) with r = x - n ln 2 and
// Cephes' degree-6 polynomial (about 1 ulp of float32 on [-87, 88.7], +inf above).
JS_INLINE float ExpF32(float x) {
  // Selects, and an integer from the bits of a float (a clamp before a float -> int
  // conversion, or a libm floor, keeps GCC from vectorising the loop around this).
  x = x < -87.0f ? -87.0f : x;  // e^-87: nothing beside the 1 that act() adds it to
  x = x > 89.0f ? 89.0f : x;    // n = 128: +inf, as e^x overflows
  const float big = x * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: rounds to an integer
  const float n = big - 12582912.0f;
  int32_t ni;
  std::memcpy(&ni, &big, sizeof(ni));
  ni -= 0x4B400000;  // the bits of 12582912.0f
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <int kAct>
JS_INLINE float Activate(float g) {
  if (kAct == kActSilu) return g / (1.0f + ExpF32(-g));
  // tanh-approximated gelu: 0.5 g (1 + tanh(z)) = g / (1 + e^(-2z)), no cancellation
  const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return g / (1.0f + ExpF32(-2.0f * z));
}

struct RowsOp {
  const void* a;   // x (norm) or gate (gated activation) [M, K]
  const void* b;   // residual (norm, or null) or up (gated activation) [M, K]
  const void* w;   // norm weight [K]
  void* y;         // [M, K]
  void* sum;       // norm with a residual: x + residual [M, K]
  int64_t m, k;
  float eps;
  bool offset;     // Gemma: scale by (1 + w) in float32
  int act;
};

// One element of each row op, rounded as the references round; the scalar rows and the
// AVX2 rows' tails share them.
template <typename T, int kAct>
JS_INLINE T GatedValue(T g, T u) {
  return FromF32<T>(ToF32<T>(FromF32<T>(Activate<kAct>(ToF32<T>(g)))) * ToF32<T>(u));
}
template <typename T>
JS_INLINE T SumValue(T x, T r) { return FromF32<T>(ToF32<T>(x) + ToF32<T>(r)); }
template <typename T>
JS_INLINE T NormValue(T x, T w, float inv, bool offset) {
  return offset ? FromF32<T>(ToF32<T>(x) * inv * (1.0f + ToF32<T>(w)))
                : FromF32<T>(ToF32<T>(w) * ToF32<T>(FromF32<T>(ToF32<T>(x) * inv)));
}

// y = act(g) * u, act(g) rounded to T before the product (as the reference, and as
// transformers computes it in bf16), float32 inside act.
template <typename T, int kAct>
JS_INLINE void GatedRow(const RowsOp& o, int64_t r) {
  const T* g = static_cast<const T*>(o.a) + r * o.k;
  const T* u = static_cast<const T*>(o.b) + r * o.k;
  T* y = static_cast<T*>(o.y) + r * o.k;
  for (int64_t c = 0; c < o.k; ++c) y[c] = GatedValue<T, kAct>(g[c], u[c]);
}

// As rows.rms_norm_reference: s = x (+ residual, rounded to T); x32 * rsqrt(mean(x32^2) +
// eps), rounded to T, times w rounded to T (offset: times 1 + w in float32, rounded once).
template <typename T>
JS_INLINE void NormRow(const RowsOp& o, int64_t r) {
  const T* x = static_cast<const T*>(o.a) + r * o.k;
  const T* w = static_cast<const T*>(o.w);
  T* y = static_cast<T*>(o.y) + r * o.k;
  float part[16] = {};
  const int64_t k16 = o.k / 16 * 16;
  if (o.b != nullptr) {
    const T* res = static_cast<const T*>(o.b) + r * o.k;
    T* s = static_cast<T*>(o.sum) + r * o.k;
    for (int64_t c = 0; c < o.k; ++c) s[c] = SumValue<T>(x[c], res[c]);
    x = s;
  }
  for (int64_t c = 0; c < k16; c += 16)
    for (int l = 0; l < 16; ++l) part[l] += ToF32<T>(x[c + l]) * ToF32<T>(x[c + l]);
  for (int64_t c = k16; c < o.k; ++c) part[c - k16] += ToF32<T>(x[c]) * ToF32<T>(x[c]);
  float sq = 0.0f;
  for (int l = 0; l < 16; ++l) sq += part[l];
  const float inv = 1.0f / std::sqrt(sq / static_cast<float>(o.k) + o.eps);
  if (o.offset) {
    for (int64_t c = 0; c < o.k; ++c) y[c] = NormValue<T>(x[c], w[c], inv, true);
  } else {
    for (int64_t c = 0; c < o.k; ++c) y[c] = NormValue<T>(x[c], w[c], inv, false);
  }
}

template <typename T>
JS_INLINE void RowsTask(const RowsOp& o, bool norm, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    if (norm) {
      NormRow<T>(o, r);
    } else if (o.act == kActSilu) {
      GatedRow<T, kActSilu>(o, r);
    } else {
      GatedRow<T, kActGeluTanh>(o, r);
    }
  }
}

void ScalarRows(const RowsOp& o, bool norm, bool bf16, int64_t r0, int64_t r1) {
  bf16 ? RowsTask<uint16_t>(o, norm, r0, r1) : RowsTask<float>(o, norm, r0, r1);
}
#if JS_X86
// The AVX2 rows in explicit 8-lane vectors (GCC leaves the bf16 rounding's select and
// the activation's division scalar here: a 32-token bf16 prompt of smollm2-135m spent 9%
// of its time in them), the same arithmetic as the scalar rows.
JS_AVX2 JS_INLINE __m256 Exp8(__m256 x) {  // ExpF32, 8 lanes
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(89.0f));
  const __m256 big = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                     _mm256_set1_ps(12582912.0f));
  const __m256 n = _mm256_sub_ps(big, _mm256_set1_ps(12582912.0f));
  const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(big), _mm256_set1_epi32(0x4B400000));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

template <int kAct>
JS_AVX2 JS_INLINE __m256 Activate8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  if (kAct == kActSilu)
    return _mm256_div_ps(g, _mm256_add_ps(one, Exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                 _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
  return _mm256_div_ps(g, _mm256_add_ps(one, Exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), z))));
}

// F32ToBf16 of 8 lanes, each in the low half of its 32-bit lane.
JS_AVX2 JS_INLINE __m256i Bf16Bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_cmpgt_epi32(
      _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, nan, is_nan);
}

// v rounded to T (bf16: to nearest even) and back to float32.
template <typename T>
JS_AVX2 JS_INLINE __m256 Round8(__m256 v) {
  if constexpr (sizeof(T) == 4) return v;
  return _mm256_castsi256_ps(_mm256_slli_epi32(Bf16Bits8(v), 16));
}

JS_AVX2 JS_INLINE void Store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
JS_AVX2 JS_INLINE void Store8(uint16_t* p, __m256 v) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(Bf16Bits8(v), Bf16Bits8(v)),
                                                  0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

template <typename T, int kAct>
JS_AVX2 void Avx2GatedRow(const RowsOp& o, int64_t r) {
  const T* g = static_cast<const T*>(o.a) + r * o.k;
  const T* u = static_cast<const T*>(o.b) + r * o.k;
  T* y = static_cast<T*>(o.y) + r * o.k;
  int64_t c = 0;
  for (; c + 8 <= o.k; c += 8) {
    const __m256 act = Round8<T>(Activate8<kAct>(Avx2Load8(g + c)));
    Store8(y + c, _mm256_mul_ps(act, Avx2Load8(u + c)));
  }
  for (; c < o.k; ++c) y[c] = GatedValue<T, kAct>(g[c], u[c]);
}

template <typename T>
JS_AVX2 void Avx2NormRow(const RowsOp& o, int64_t r) {
  const T* x = static_cast<const T*>(o.a) + r * o.k;
  const T* w = static_cast<const T*>(o.w);
  T* y = static_cast<T*>(o.y) + r * o.k;
  const int64_t k8 = o.k / 8 * 8;
  if (o.b != nullptr) {
    const T* res = static_cast<const T*>(o.b) + r * o.k;
    T* s = static_cast<T*>(o.sum) + r * o.k;
    for (int64_t c = 0; c < k8; c += 8)
      Store8(s + c, _mm256_add_ps(Avx2Load8(x + c), Avx2Load8(res + c)));
    for (int64_t c = k8; c < o.k; ++c) s[c] = SumValue<T>(x[c], res[c]);
    x = s;
  }
  __m256 sq8 = _mm256_setzero_ps();
  for (int64_t c = 0; c < k8; c += 8) {
    const __m256 v = Avx2Load8(x + c);
    sq8 = _mm256_fmadd_ps(v, v, sq8);
  }
  float sq = Avx2Sum(sq8);
  for (int64_t c = k8; c < o.k; ++c) sq += ToF32<T>(x[c]) * ToF32<T>(x[c]);
  const float inv = 1.0f / std::sqrt(sq / static_cast<float>(o.k) + o.eps);
  const __m256 inv8 = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.0f);
  for (int64_t c = 0; c < k8; c += 8) {
    const __m256 xv = Avx2Load8(x + c), wv = Avx2Load8(w + c);
    Store8(y + c, o.offset ? _mm256_mul_ps(_mm256_mul_ps(xv, inv8), _mm256_add_ps(one, wv))
                           : _mm256_mul_ps(wv, Round8<T>(_mm256_mul_ps(xv, inv8))));
  }
  for (int64_t c = k8; c < o.k; ++c) y[c] = NormValue<T>(x[c], w[c], inv, o.offset);
}

template <typename T>
JS_AVX2 void Avx2RowsTask(const RowsOp& o, bool norm, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    if (norm) {
      Avx2NormRow<T>(o, r);
    } else if (o.act == kActSilu) {
      Avx2GatedRow<T, kActSilu>(o, r);
    } else {
      Avx2GatedRow<T, kActGeluTanh>(o, r);
    }
  }
}

JS_AVX2 void Avx2Rows(const RowsOp& o, bool norm, bool bf16, int64_t r0, int64_t r1) {
  bf16 ? Avx2RowsTask<uint16_t>(o, norm, r0, r1) : Avx2RowsTask<float>(o, norm, r0, r1);
}
JS_AVX512 void Avx512Rows(const RowsOp& o, bool norm, bool bf16, int64_t r0, int64_t r1) {
  bf16 ? RowsTask<uint16_t>(o, norm, r0, r1) : RowsTask<float>(o, norm, r0, r1);
}
#endif

// rows(r0, r1) over [0, m), split over the threads when there is enough work (16K
// elements a task, `row` elements a row).
template <typename Fn>
void RowBlocks(const Runner& run, int64_t m, int64_t row, const Fn& rows) {
  const int64_t per = std::max<int64_t>(1, (16384 + row - 1) / std::max<int64_t>(row, 1));
  const int64_t tasks = CeilDiv(m, per);
  if (tasks <= 1) return rows(0, m);
  run.For(tasks, [&](int64_t i) { rows(i * per, std::min(m, (i + 1) * per)); });
}

void Rows(const Runner& run, const RowsOp& o, bool norm, bool bf16) {
  const int isa = CurrentIsa();
  RowBlocks(run, o.m, o.k, [&](int64_t r0, int64_t r1) {
#if JS_X86
    if (isa >= kAvx512) return Avx512Rows(o, norm, bf16, r0, r1);
    if (isa >= kAvx2) return Avx2Rows(o, norm, bf16, r0, r1);
#endif
    (void)isa;
    ScalarRows(o, norm, bf16, r0, r1);
  });
}

// Rotary embedding of q [M, Hq, D] and k [M, Hk, D] on the real rows, 'rotate half'
// layout: y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin over the halves x1, x2 of each head,
// with cos and sin [M, D/2] (float32, computed once a step by XLA) rounded to T first and
// each product and the sum rounded to T, as rows.rope_reference computes in T.
struct RopeOp {
  const void* x[2];
  void* y[2];
  int64_t heads[2];
  const float* cos;
  const float* sin;
  int64_t m, d;
};

template <typename T>
JS_INLINE void RopeTask(const RopeOp& o, int64_t r0, int64_t r1) {
  const int64_t half = o.d / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const float* cr = o.cos + r * half;
    const float* sr = o.sin + r * half;
    for (int j = 0; j < 2; ++j) {
      for (int64_t h = 0; h < o.heads[j]; ++h) {
        const int64_t at = (r * o.heads[j] + h) * o.d;
        const T* x = static_cast<const T*>(o.x[j]) + at;
        T* y = static_cast<T*>(o.y[j]) + at;
        for (int64_t i = 0; i < half; ++i) {
          const float c = ToF32<T>(FromF32<T>(cr[i])), s = ToF32<T>(FromF32<T>(sr[i]));
          const float a = ToF32<T>(x[i]), b = ToF32<T>(x[i + half]);
          const float ac = ToF32<T>(FromF32<T>(a * c)), bs = ToF32<T>(FromF32<T>(b * s));
          const float bc = ToF32<T>(FromF32<T>(b * c)), as = ToF32<T>(FromF32<T>(a * s));
          y[i] = FromF32<T>(ac - bs);
          y[i + half] = FromF32<T>(bc + as);
        }
      }
    }
  }
}

void ScalarRope(const RopeOp& o, bool bf16, int64_t r0, int64_t r1) {
  bf16 ? RopeTask<uint16_t>(o, r0, r1) : RopeTask<float>(o, r0, r1);
}
#if JS_X86
JS_AVX2 void Avx2Rope(const RopeOp& o, bool bf16, int64_t r0, int64_t r1) {
  bf16 ? RopeTask<uint16_t>(o, r0, r1) : RopeTask<float>(o, r0, r1);
}
// bf16 rounding of 16 floats, kept as floats (ToF32(FromF32<uint16_t>(v)) of each).
JS_AVX512 JS_INLINE __m512 RoundBf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(F32ToBf16x16(v)), 16));
}

// RopeTask<uint16_t>, 16 columns at a time (GCC left the scalar loop's roundings unrolled
// but not vectorised: ~1 ns an element).
JS_AVX512 void Avx512RopeBf16(const RopeOp& o, int64_t r0, int64_t r1) {
  const int64_t half = o.d / 2;
  for (int64_t r = r0; r < r1; ++r) {
    for (int j = 0; j < 2; ++j) {
      for (int64_t h = 0; h < o.heads[j]; ++h) {
        const int64_t at = (r * o.heads[j] + h) * o.d;
        const uint16_t* x = static_cast<const uint16_t*>(o.x[j]) + at;
        uint16_t* y = static_cast<uint16_t*>(o.y[j]) + at;
        for (int64_t i = 0; i < half; i += 16) {
          const __m512 c = RoundBf16(_mm512_loadu_ps(o.cos + r * half + i));
          const __m512 s = RoundBf16(_mm512_loadu_ps(o.sin + r * half + i));
          const __m512 a = LoadBf16(x + i), b = LoadBf16(x + i + half);
          const __m512 y1 = _mm512_sub_ps(RoundBf16(_mm512_mul_ps(a, c)),
                                          RoundBf16(_mm512_mul_ps(b, s)));
          const __m512 y2 = _mm512_add_ps(RoundBf16(_mm512_mul_ps(b, c)),
                                          RoundBf16(_mm512_mul_ps(a, s)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), F32ToBf16x16(y1));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i + half), F32ToBf16x16(y2));
        }
      }
    }
  }
}

JS_AVX512 void Avx512Rope(const RopeOp& o, bool bf16, int64_t r0, int64_t r1) {
  if (bf16 && o.d % 32 == 0) return Avx512RopeBf16(o, r0, r1);
  bf16 ? RopeTask<uint16_t>(o, r0, r1) : RopeTask<float>(o, r0, r1);
}
#endif

void Rope(const Runner& run, const RopeOp& o, bool bf16) {
  const int isa = CurrentIsa();
  RowBlocks(run, o.m, (o.heads[0] + o.heads[1]) * o.d, [&](int64_t r0, int64_t r1) {
#if JS_X86
    if (isa >= kAvx512) return Avx512Rope(o, bf16, r0, r1);
    if (isa >= kAvx2) return Avx2Rope(o, bf16, r0, r1);
#endif
    (void)isa;
    ScalarRope(o, bf16, r0, r1);
  });
}

// ==========================================================================================
// Ragged paged attention
// ==========================================================================================

enum KvType : int { kKvF32, kKvBf16, kKvS8, kKvF8 };

struct Attn {
  const void* q;  // [T, Hq, D], f32 or bf16
  bool q_bf16;
  const void* k;  // [Hkv, P, ps, D]
  const void* v;
  KvType kv;
  int64_t kv_esize;
  const float* ks;  // [Hkv, P, ps] for 8-bit caches, else null
  const float* vs;
  const int32_t* kv_lens;  // [S]
  const int32_t* pages;    // [S, pps]
  const int32_t* cu;       // [S + 1]
  void* out;               // [T, Hq, D] in q's dtype
  int64_t T, hq, hkv, group, d, num_pages, page_size, max_seqs, pps;
  float sm_scale, soft_cap;  // soft_cap 0: none
  int64_t window;            // 0: none
  bool bf16_dot;             // bf16 q and pages on an AVX512_BF16 CPU: q.k by vdpbf16ps
  const int32_t* tree_start;  // [S]: speculative trees (work_items.py), else null
  const int32_t* tree_mask;   // [T]
};

struct AttnTask {
  int32_t seq, head, q0, q1;  // queries [q0, q1) of the sequence's q_len
  int64_t cost;
};

constexpr int64_t kKeysPerChunk = 32;
constexpr int64_t kAttnPrefetchChunks = 2;  // prefetch distance, in chunks
constexpr float kMasked = -1e30f;

// Where a sequence's queries sit: token offset, q_len, kv_len.
struct SeqInfo {
  int64_t tok, q_len, kv_len;
};

JS_INLINE SeqInfo SequenceInfo(const Attn& a, int64_t s) {
  int64_t start = std::clamp<int64_t>(a.cu[s], 0, a.T);
  int64_t end = std::clamp<int64_t>(a.cu[s + 1], start, a.T);
  const int64_t kv_len = std::clamp<int64_t>(a.kv_lens[s], 0, a.pps * a.page_size);
  return {start, end - start, kv_len};
}

// Visible keys [lo, hi) of queries [q0, q1) of a sequence.
JS_INLINE void KeyRange(const Attn& a, const SeqInfo& si, int64_t q0, int64_t q1, int64_t* lo,
                        int64_t* hi) {
  const int64_t first_pos = si.kv_len - si.q_len + q0, last_pos = si.kv_len - si.q_len + q1 - 1;
  *hi = std::min(si.kv_len, last_pos + 1);
  *lo = a.window > 0 ? std::max<int64_t>(0, first_pos - a.window + 1) : 0;
}

// Flat row index ((head * pages + page) * page_size + row) of keys [c0, c0 + nk) of
// sequence s, head h: one division per chunk, then page by page. Page numbers are clamped
// into the pool (entries of used pages are assumed valid; clamping only keeps a bad table
// from reading outside the cache).
JS_INLINE void ChunkSlots(const Attn& a, int64_t s, int64_t h, int64_t c0, int64_t nk,
                          int64_t* slot) {
  int64_t entry = c0 / a.page_size, row = c0 - entry * a.page_size;
  const int32_t* table = a.pages + s * a.pps;
  int64_t base = (h * a.num_pages + std::clamp<int64_t>(table[entry], 0, a.num_pages - 1)) *
                 a.page_size;
  for (int64_t j = 0; j < nk; ++j) {
    slot[j] = base + row;
    if (++row == a.page_size) {
      row = 0;
      ++entry;
      if (j + 1 < nk)
        base = (h * a.num_pages + std::clamp<int64_t>(table[entry], 0, a.num_pages - 1)) *
               a.page_size;
    }
  }
}

JS_INLINE const char* KvRow(const Attn& a, const void* base, int64_t slot) {
  return static_cast<const char*>(base) + slot * a.d * a.kv_esize;
}

// Per-thread scratch, grown on demand.
struct Scratch {
  std::vector<float> buf;
  float* Get(size_t n) {
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

struct Work {  // views into the scratch for one task
  float *q, *o, *s, *kf, *vf, *kt, *m, *l, *corr, *ksc, *vsc, *zero;
  uint16_t* qb;  // the query rows as bf16 (unscaled), for bf16_dot
  int64_t rows, rows_pad;
};

JS_INLINE Work MakeWork(int64_t rows, int64_t d) {
  const int64_t rows_pad = RoundUp(rows, 4);
  const int64_t kc = kKeysPerChunk;
  const size_t n = rows_pad * d * 2 + rows_pad * kc + 3 * kc * d + 3 * rows_pad + 2 * kc + d +
                   rows_pad * d / 2 + 96;
  float* p = ThreadScratch().Get(n);
  Work w;
  w.rows = rows;
  w.rows_pad = rows_pad;
  w.q = p; p += rows_pad * d;
  w.o = p; p += rows_pad * d;
  w.s = p; p += rows_pad * kc;
  w.kf = p; p += kc * d;
  w.vf = p; p += kc * d;
  w.kt = p; p += kc * d;
  w.m = p; p += rows_pad;
  w.l = p; p += rows_pad;
  w.corr = p; p += rows_pad;
  w.ksc = p; p += kc;
  w.vsc = p; p += kc;
  w.zero = p; p += d;
  w.qb = reinterpret_cast<uint16_t*>(p);
  return w;
}

// ---------------------------------------------------------------- generic attention

JS_INLINE float ExpGeneric(float x) { return std::exp(x); }

JS_INLINE void ConvertRowGeneric(const Attn& a, const char* src, float* dst) {
  switch (a.kv) {
    case kKvF32: std::memcpy(dst, src, a.d * 4); break;
    case kKvBf16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < a.d; ++i) dst[i] = Bf16ToF32(h[i]);
      break;
    }
    case kKvS8: {
      const int8_t* b = reinterpret_cast<const int8_t*>(src);
      for (int64_t i = 0; i < a.d; ++i) dst[i] = static_cast<float>(b[i]);
      break;
    }
    case kKvF8: {
      const uint8_t* b = reinterpret_cast<const uint8_t*>(src);
      const float* table = Fp8Values();
      for (int64_t i = 0; i < a.d; ++i) dst[i] = table[b[i]];
      break;
    }
  }
}

JS_INLINE void LoadQueries(const Attn& a, const AttnTask& t, const SeqInfo& si, const Work& w) {
  std::memset(w.q, 0, sizeof(float) * w.rows_pad * a.d);
  if (a.bf16_dot) std::memset(w.qb, 0, sizeof(uint16_t) * w.rows_pad * a.d);
  for (int64_t i = 0; i < t.q1 - t.q0; ++i) {
    for (int64_t g = 0; g < a.group; ++g) {
      const int64_t src = ((si.tok + t.q0 + i) * a.hq + t.head * a.group + g) * a.d;
      float* dst = w.q + (i * a.group + g) * a.d;
      if (a.q_bf16) {
        const uint16_t* q = static_cast<const uint16_t*>(a.q) + src;
        for (int64_t e = 0; e < a.d; ++e) dst[e] = Bf16ToF32(q[e]) * a.sm_scale;
        if (a.bf16_dot) std::memcpy(w.qb + (i * a.group + g) * a.d, q, sizeof(uint16_t) * a.d);
      } else {
        const float* q = static_cast<const float*>(a.q) + src;
        for (int64_t e = 0; e < a.d; ++e) dst[e] = q[e] * a.sm_scale;
      }
    }
  }
}

JS_INLINE void StoreOutputs(const Attn& a, const AttnTask& t, const SeqInfo& si, const Work& w) {
  for (int64_t r = 0; r < w.rows; ++r) {
    const int64_t i = r / a.group, g = r % a.group;
    const int64_t dst = ((si.tok + t.q0 + i) * a.hq + t.head * a.group + g) * a.d;
    const float inv = w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f;
    const float* o = w.o + r * a.d;
    if (a.q_bf16) {
      uint16_t* out = static_cast<uint16_t*>(a.out) + dst;
      for (int64_t e = 0; e < a.d; ++e) out[e] = F32ToBf16(o[e] * inv);
    } else {
      float* out = static_cast<float*>(a.out) + dst;
      for (int64_t e = 0; e < a.d; ++e) out[e] = o[e] * inv;
    }
  }
}

// Visible key indices [ja, jb) within a chunk [c0, c0 + nk) for row r.
JS_INLINE void RowRange(const Attn& a, int64_t qpos, int64_t c0, int64_t nk, int64_t hi,
                        int64_t* ja, int64_t* jb) {
  int64_t first = c0, last = std::min(c0 + nk, std::min(hi, qpos + 1));
  if (a.window > 0) first = std::max(first, qpos - a.window + 1);
  *ja = first - c0;
  *jb = last - c0;
}

// The keys of a chunk [c0, c0 + 32) that the tree mask of query token `tok` of sequence s
// leaves visible, bit j for key c0 + j: keys before the sequence's tree, and its nodes
// whose bits the token's mask sets (all of them without trees).
JS_INLINE uint32_t TreeBits(const Attn& a, int64_t s, int64_t tok, int64_t c0) {
  if (a.tree_start == nullptr) return 0xffffffffu;
  const int64_t start = a.tree_start[s];
  const uint32_t mask = static_cast<uint32_t>(a.tree_mask[tok]);
  uint32_t bits = 0;
  for (int64_t j = 0; j < kKeysPerChunk; ++j) {
    const int64_t node = c0 + j - start;
    if (node < 0 || (node < 32 && (mask >> node & 1u))) bits |= 1u << j;
  }
  return bits;
}

// The keys of a chunk [c0, c0 + nk) that row r of a task sees, bit j for key c0 + j
// (0: none): causal order, the sliding window and the tree mask.
JS_INLINE uint32_t VisibleKeys(const Attn& a, const AttnTask& t, const SeqInfo& si,
                               int64_t qpos0, int64_t r, int64_t c0, int64_t nk, int64_t hi) {
  int64_t ja, jb;
  RowRange(a, qpos0 + r / a.group, c0, nk, hi, &ja, &jb);
  if (ja >= jb) return 0;
  const uint32_t range = (jb - ja >= 32 ? 0xffffffffu : ((1u << (jb - ja)) - 1)) << ja;
  return range & TreeBits(a, t.seq, si.tok + t.q0 + r / a.group, c0);
}

#if JS_X86
// The int8 / fp8 scales of the 16 slots from `slot` (K and V).
JS_INLINE void PrefetchScales(const Attn& a, int64_t slot) {
  if (a.ks == nullptr) return;
  _mm_prefetch(reinterpret_cast<const char*>(a.ks + slot), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(a.vs + slot), _MM_HINT_T0);
}

// Into the cache (L1, or L2 with `ToL2`): the K and V rows of a slot and, for 8-bit
// caches, the scales of the 16 slots from it when `scales`.
template <bool ToL2 = false>
JS_INLINE void PrefetchKv(const Attn& a, int64_t slot, bool scales) {
  const int64_t row_bytes = a.d * a.kv_esize;
  const char* kp = KvRow(a, a.k, slot);
  const char* vp = KvRow(a, a.v, slot);
  for (int64_t b = 0; b < row_bytes; b += 64) {
    if constexpr (ToL2) {
      _mm_prefetch(kp + b, _MM_HINT_T1);
      _mm_prefetch(vp + b, _MM_HINT_T1);
    } else {
      _mm_prefetch(kp + b, _MM_HINT_T0);
      _mm_prefetch(vp + b, _MM_HINT_T0);
    }
  }
  if (scales) PrefetchScales(a, slot);
}

// The chunk kAttnPrefetchChunks ahead of the one a decode task works on, whose rows the
// AVX-512 tiles prefetch into L2 as they go: its K rows between the score tiles and its V
// rows between the keys of the P.V tile. Issued in a burst before the chunk's tiles (the
// loop that gathers its row pointers has nothing else to do), the prefetches filled the
// miss buffers and the tiles waited (Zen 4, bf16: decode 8 x 1024 and 4 x 8192 took 1.2x
// the time; benchmarks/RESULTS.md). Where rows are converted, the conversion spreads them.
struct Ahead {
  const char* k[kKeysPerChunk];
  const char* v[kKeysPerChunk];
  int64_t n = 0;      // its keys (0: nothing to prefetch)
  int64_t bytes = 0;  // of a K or V row
};

// K rows of the ahead chunk's keys [j0, j0 + count).
JS_INLINE void PrefetchAheadK(const Ahead& ah, int64_t j0, int64_t count) {
  for (int64_t j = j0; j < std::min(j0 + count, ah.n); ++j)
    for (int64_t b = 0; b < ah.bytes; b += 64) _mm_prefetch(ah.k[j] + b, _MM_HINT_T1);
}

// The V row of the ahead chunk's key j.
JS_INLINE void PrefetchAheadV(const Ahead* ah, int64_t j) {
  if (ah == nullptr || j >= ah->n) return;
  for (int64_t b = 0; b < ah->bytes; b += 64) _mm_prefetch(ah->v[j] + b, _MM_HINT_T1);
}

// The first kAttnPrefetchChunks chunks of keys [lo, hi), in a burst (later chunks are
// prefetched row by row, kAttnPrefetchChunks ahead, while the task works on a chunk).
template <bool ToL2 = false>
JS_INLINE void PrefetchFirstChunks(const Attn& a, const AttnTask& t, int64_t lo, int64_t hi) {
  int64_t slot[kKeysPerChunk];
  for (int64_t c = 0; c < kAttnPrefetchChunks; ++c) {
    const int64_t c0 = lo + c * kKeysPerChunk;
    if (c0 >= hi) break;
    const int64_t nk = std::min(kKeysPerChunk, hi - c0);
    ChunkSlots(a, t.seq, t.head, c0, nk, slot);
    for (int64_t j = 0; j < nk; ++j) PrefetchKv<ToL2>(a, slot[j], false);
  }
}

// A task's first chunks into L2, while the task before it runs: decode tasks are short
// (a few chunks of keys), so a burst at a task's own start leaves its first keys' loads
// waiting on memory.
JS_INLINE void PrefetchTaskStart(const Attn& a, const AttnTask& t) {
  int64_t lo, hi;
  KeyRange(a, SequenceInfo(a, t.seq), t.q0, t.q1, &lo, &hi);
  PrefetchFirstChunks</*ToL2=*/true>(a, t, lo, hi);
}
#endif

// The start every task path shares: its scratch, its queries loaded, its visible keys
// [lo, hi), and the online softmax reset (running max, sum and output) for its rows, or
// for its rows padded to the vector tiles.
JS_INLINE void StartTask(const Attn& a, const AttnTask& t, const SeqInfo& si, Work* w,
                         int64_t* lo, int64_t* hi, bool padded) {
  *w = MakeWork((t.q1 - t.q0) * a.group, a.d);
  LoadQueries(a, t, si, *w);
  KeyRange(a, si, t.q0, t.q1, lo, hi);
  const int64_t rows = padded ? w->rows_pad : w->rows;
  for (int64_t r = 0; r < rows; ++r) {
    w->m[r] = kMasked;
    w->l[r] = 0.0f;
  }
  std::memset(w->o, 0, sizeof(float) * rows * a.d);
}

JS_INLINE void AttnTaskGeneric(const Attn& a, const AttnTask& t) {
  const int64_t D = a.d, KC = kKeysPerChunk;
  const SeqInfo si = SequenceInfo(a, t.seq);
  Work w;
  int64_t lo, hi;
  StartTask(a, t, si, &w, &lo, &hi, /*padded=*/false);
  const int64_t qpos0 = si.kv_len - si.q_len + t.q0;
  const bool quant = a.ks != nullptr;
  for (int64_t c0 = lo; c0 < hi; c0 += KC) {
    const int64_t nk = std::min(KC, hi - c0);
    int64_t slot[kKeysPerChunk];
    ChunkSlots(a, t.seq, t.head, c0, nk, slot);
    for (int64_t j = 0; j < nk; ++j) {
      ConvertRowGeneric(a, KvRow(a, a.k, slot[j]), w.kf + j * D);
      ConvertRowGeneric(a, KvRow(a, a.v, slot[j]), w.vf + j * D);
      w.ksc[j] = quant ? a.ks[slot[j]] : 1.0f;
      w.vsc[j] = quant ? a.vs[slot[j]] : 1.0f;
    }
    for (int64_t r = 0; r < w.rows; ++r) {
      int64_t ja, jb;
      RowRange(a, qpos0 + r / a.group, c0, nk, hi, &ja, &jb);
      float* s = w.s + r * KC;
      if (ja >= jb) continue;
      const uint32_t vis = TreeBits(a, t.seq, si.tok + t.q0 + r / a.group, c0);
      const float* q = w.q + r * D;
      float mx = kMasked;
      for (int64_t j = ja; j < jb; ++j) {
        if (!(vis >> j & 1u)) continue;
        const float* k = w.kf + j * D;
        float part[16] = {};
        const int64_t d16 = D / 16 * 16;
        for (int64_t e = 0; e < d16; e += 16)
          for (int l = 0; l < 16; ++l) part[l] += q[e + l] * k[e + l];
        for (int64_t e = d16; e < D; ++e) part[e - d16] += q[e] * k[e];
        float dot = 0.0f;
        for (int l = 0; l < 16; ++l) dot += part[l];
        dot *= w.ksc[j];
        if (a.soft_cap > 0.0f) dot = a.soft_cap * std::tanh(dot / a.soft_cap);
        s[j] = dot;
        mx = std::max(mx, dot);
      }
      const float m_new = std::max(w.m[r], mx);
      const float corr = ExpGeneric(w.m[r] - m_new);
      w.m[r] = m_new;
      float sum = 0.0f;
      for (int64_t j = ja; j < jb; ++j) {
        const float p = vis >> j & 1u ? ExpGeneric(s[j] - m_new) : 0.0f;
        sum += p;
        s[j] = p * w.vsc[j];
      }
      w.l[r] = w.l[r] * corr + sum;
      float* o = w.o + r * D;
      for (int64_t e = 0; e < D; ++e) o[e] *= corr;
      for (int64_t j = ja; j < jb; ++j) {
        const float p = s[j];
        const float* v = w.vf + j * D;
        for (int64_t e = 0; e < D; ++e) o[e] += p * v[e];
      }
    }
  }
  StoreOutputs(a, t, si, w);
}

void ScalarAttnTask(const Attn& a, const AttnTask& t) { AttnTaskGeneric(a, t); }
#if JS_X86
// ---------------------------------------------------------------- AVX2 attention

// cap * tanh(s / cap), as SoftCap512.
JS_AVX2 JS_INLINE __m256 SoftCap256(__m256 s, float cap) {
  const __m256 c = _mm256_set1_ps(cap);
  const __m256 x = _mm256_div_ps(s, c);
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 e = Exp8(_mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(-2.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_mul_ps(c, _mm256_or_ps(t, sign));
}

JS_AVX2 JS_INLINE float Avx2Max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Lane i of the result: the sum of the 8 lanes of acc[i].
JS_AVX2 JS_INLINE __m256 Reduce8(const __m256* acc) {
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 8 elements of a K or V row at e as f32 (int8 unscaled, as LoadRow).
template <typename KV>
JS_AVX2 JS_INLINE __m256 LoadRow8(const void* row, int64_t e) {
  if constexpr (sizeof(KV) == 4) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + e);
  } else if constexpr (sizeof(KV) == 2) {
    return Avx2Load8(static_cast<const uint16_t*>(row) + e);
  } else {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(
        static_cast<const int8_t*>(row) + e));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
}

// One K/V row -> f32 (D a multiple of 8).
JS_AVX2 JS_INLINE void ConvertRow8(const Attn& a, const char* src, float* dst) {
  switch (a.kv) {
    case kKvBf16:
      for (int64_t e = 0; e < a.d; e += 8) _mm256_storeu_ps(dst + e, LoadRow8<uint16_t>(src, e));
      break;
    case kKvS8:
      for (int64_t e = 0; e < a.d; e += 8) _mm256_storeu_ps(dst + e, LoadRow8<int8_t>(src, e));
      break;
    default: ConvertRowGeneric(a, src, dst); break;
  }
}

// Scores of RB query rows against JB keys (RB * JB = 8): s[r * lds + j] = q[r] . k[j].
template <int RB, int JB, typename KV>
JS_AVX2 JS_INLINE void QkTile8(const float* q, int64_t D, const void* const* krow, float* s,
                               int64_t lds) {
  static_assert(RB * JB == 8, "8 dot products per tile");
  __m256 acc[8];
  JS_UNROLL for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  int64_t e = 0;
  do {  // D >= 8 (a multiple of 8)
    if constexpr (RB == 1) {
      const __m256 qv = _mm256_loadu_ps(q + e);
      JS_UNROLL for (int j = 0; j < JB; ++j)
        acc[j] = _mm256_fmadd_ps(qv, LoadRow8<KV>(krow[j], e), acc[j]);
    } else {
      __m256 kv[JB];
      JS_UNROLL for (int j = 0; j < JB; ++j) kv[j] = LoadRow8<KV>(krow[j], e);
      JS_UNROLL for (int r = 0; r < RB; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * D + e);
        JS_UNROLL for (int j = 0; j < JB; ++j)
          acc[r * JB + j] = _mm256_fmadd_ps(qv, kv[j], acc[r * JB + j]);
      }
    }
    e += 8;
  } while (e < D);
  alignas(32) float sum[8];
  _mm256_store_ps(sum, Reduce8(acc));
  JS_UNROLL for (int r = 0; r < RB; ++r)
    JS_UNROLL for (int j = 0; j < JB; ++j) s[r * lds + j] = sum[r * JB + j];
}

// Scores of all rows (rows_pad <= 8, a multiple of 4) against nk_pad keys (a multiple of 8).
template <typename KV>
JS_AVX2 void Scores8(const Work& w, const void* const* krow, int64_t nk_pad, int64_t D) {
  const int64_t KC = kKeysPerChunk;
  if (w.rows == 1) {
    for (int64_t j = 0; j < nk_pad; j += 8) QkTile8<1, 8, KV>(w.q, D, krow + j, w.s + j, KC);
  } else if (w.rows == 2) {
    for (int64_t j = 0; j < nk_pad; j += 4) QkTile8<2, 4, KV>(w.q, D, krow + j, w.s + j, KC);
  } else {
    for (int64_t r = 0; r < w.rows_pad; r += 4)
      for (int64_t j = 0; j < nk_pad; j += 2)
        QkTile8<4, 2, KV>(w.q + r * D, D, krow + j, w.s + r * KC + j, KC);
  }
}

// dst[c][r] = src[r][c] for an 8 x 8 block.
JS_AVX2 JS_INLINE void Transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8];
  JS_UNROLL for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  Transpose8(r);
  JS_UNROLL for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + i * ldd, r[i]);
}

// Many rows (prefill): scores of RB rows against 16 keys of K^T (row stride 32), as QkRowsT.
template <int RB>
JS_AVX2 JS_INLINE void QkRowsT8(const float* q, int64_t D, const float* kt, float* s) {
  __m256 acc[RB][2];
  JS_UNROLL for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  int64_t d = 0;
  do {  // D >= 8
    const __m256 k0 = _mm256_loadu_ps(kt + d * kKeysPerChunk);
    const __m256 k1 = _mm256_loadu_ps(kt + d * kKeysPerChunk + 8);
    JS_UNROLL for (int r = 0; r < RB; ++r) {
      const __m256 qb = _mm256_broadcast_ss(q + r * D + d);
      acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
    }
  } while (++d < D);
  JS_UNROLL for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(s + r * kKeysPerChunk, acc[r][0]);
    _mm256_storeu_ps(s + r * kKeysPerChunk + 8, acc[r][1]);
  }
}

// K^T of the chunk's first nk keys (kf [32][D], rows past them zero) into w.kt, then the
// scores of every row against them, 16 keys at a time, in blocks of 6 rows (12 accumulators).
JS_AVX2 void ScoresTransposed8(const Work& w, int64_t D, int64_t nk) {
  const int64_t KC = kKeysPerChunk, nk16 = RoundUp(nk, 16);
  for (int64_t j0 = 0; j0 < nk16; j0 += 8)
    for (int64_t d0 = 0; d0 < D; d0 += 8)
      Transpose8x8(w.kf + j0 * D + d0, D, w.kt + d0 * KC + j0, KC);
  for (int64_t j0 = 0; j0 < nk16; j0 += 16) {
    const float* kt = w.kt + j0;
    int64_t r = 0;
    for (; r + 6 <= w.rows; r += 6) QkRowsT8<6>(w.q + r * D, D, kt, w.s + r * KC + j0);
    const float* q = w.q + r * D;
    float* s = w.s + r * KC + j0;
    switch (w.rows - r) {
      case 1: QkRowsT8<1>(q, D, kt, s); break;
      case 2: QkRowsT8<2>(q, D, kt, s); break;
      case 3: QkRowsT8<3>(q, D, kt, s); break;
      case 4: QkRowsT8<4>(q, D, kt, s); break;
      case 5: QkRowsT8<5>(q, D, kt, s); break;
      default: break;
    }
  }
}

// o[r, cols] = o[r, cols] * corr[r] + sum_j p[r, j] v[j, cols] for RB rows and NV vectors of
// 8 columns from col, as PvTile.
template <int RB, int NV, typename KV>
JS_AVX2 JS_INLINE void PvTile8(const float* p, int64_t ldp, const void* const* vrow, int64_t nk,
                               float* o, int64_t D, const float* corr, int64_t col) {
  __m256 acc[RB][NV];
  JS_UNROLL for (int r = 0; r < RB; ++r) {
    const __m256 c = _mm256_set1_ps(corr[r]);
    JS_UNROLL for (int v = 0; v < NV; ++v)
      acc[r][v] = _mm256_mul_ps(_mm256_loadu_ps(o + r * D + col + 8 * v), c);
  }
  int64_t j = 0;
  do {  // nk >= 1
    __m256 vv[NV];
    JS_UNROLL for (int v = 0; v < NV; ++v) vv[v] = LoadRow8<KV>(vrow[j], col + 8 * v);
    JS_UNROLL for (int r = 0; r < RB; ++r) {
      const __m256 pb = _mm256_broadcast_ss(p + r * ldp + j);
      JS_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(pb, vv[v], acc[r][v]);
    }
  } while (++j < nk);
  JS_UNROLL for (int r = 0; r < RB; ++r)
    JS_UNROLL for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + r * D + col + 8 * v, acc[r][v]);
}

// All columns of RB rows from r0, NV vectors at a time (at most 12 accumulators beside the
// NV vectors of V).
template <int RB, typename KV>
JS_AVX2 JS_INLINE void PvRowBlock8(const Work& w, const void* const* vrow, int64_t nk,
                                   int64_t D, int64_t r0) {
  constexpr int kMaxNv = RB == 1 ? 8 : RB == 2 ? 4 : 2;
  const int64_t ldp = kKeysPerChunk;
  const float* p = w.s + r0 * ldp;
  float* o = w.o + r0 * D;
  const float* corr = w.corr + r0;
  int64_t col = 0;
  for (; col + 8 * kMaxNv <= D; col += 8 * kMaxNv)
    PvTile8<RB, kMaxNv, KV>(p, ldp, vrow, nk, o, D, corr, col);
  if constexpr (kMaxNv > 4) {
    if (col + 32 <= D) {
      PvTile8<RB, 4, KV>(p, ldp, vrow, nk, o, D, corr, col);
      col += 32;
    }
  }
  if constexpr (kMaxNv > 2) {
    if (col + 16 <= D) {
      PvTile8<RB, 2, KV>(p, ldp, vrow, nk, o, D, corr, col);
      col += 16;
    }
  }
  if (col + 8 <= D) PvTile8<RB, 1, KV>(p, ldp, vrow, nk, o, D, corr, col);
}

// P.V for all rows in blocks of 6, 4, 2 or 1 (a block's rows past the real ones, within
// rows_pad, have p = 0 and corr = 1).
template <typename KV>
JS_AVX2 void Accumulate8(const Work& w, const void* const* vrow, int64_t nk, int64_t D) {
  int64_t r = 0;
  while (r < w.rows) {
    const int64_t left = w.rows - r;
    if (left >= 6) {
      PvRowBlock8<6, KV>(w, vrow, nk, D, r);
      r += 6;
    } else if (left >= 3) {
      PvRowBlock8<4, KV>(w, vrow, nk, D, r);
      r += 4;
    } else if (left == 2) {
      PvRowBlock8<2, KV>(w, vrow, nk, D, r);
      r += 2;
    } else {
      PvRowBlock8<1, KV>(w, vrow, nk, D, r);
      r += 1;
    }
  }
}

// The AVX-512 task's plan in 8-lane vectors: K/V read in place (f32, bf16, int8) with at
// most 8 rows (decode), else converted to f32 once per chunk and the scores taken from K^T.
JS_AVX2 void Avx2AttnTask(const Attn& a, const AttnTask& t) {
  const int64_t D = a.d, KC = kKeysPerChunk;
  const SeqInfo si = SequenceInfo(a, t.seq);
  Work w;
  int64_t lo, hi;
  StartTask(a, t, si, &w, &lo, &hi, /*padded=*/true);
  const int64_t qpos0 = si.kv_len - si.q_len + t.q0;
  std::memset(w.zero, 0, sizeof(float) * D);
  const bool quant = a.ks != nullptr;
  const bool transposed = w.rows_pad > 8;
  const bool in_place = !transposed && a.kv != kKvF8;
  const KvType rows_type = in_place ? a.kv : kKvF32;
  const void* krow[kKeysPerChunk];
  const void* vrow[kKeysPerChunk];
  int64_t slot[kKeysPerChunk], ahead[kKeysPerChunk];
  PrefetchFirstChunks(a, t, lo, hi);
  for (int64_t c0 = lo; c0 < hi; c0 += KC) {
    const int64_t nk = std::min(KC, hi - c0);
    ChunkSlots(a, t.seq, t.head, c0, nk, slot);
    const int64_t c_ahead = c0 + kAttnPrefetchChunks * KC;
    const int64_t na = c_ahead < hi ? std::min(KC, hi - c_ahead) : 0;
    if (na > 0) ChunkSlots(a, t.seq, t.head, c_ahead, na, ahead);
    for (int64_t j = 0; j < nk; ++j) {
      if (j < na) PrefetchKv(a, ahead[j], j == 0 || ahead[j] % 16 == 0);
      const char* kp = KvRow(a, a.k, slot[j]);
      const char* vp = KvRow(a, a.v, slot[j]);
      if (in_place) {
        krow[j] = kp;
        vrow[j] = vp;
      } else {
        ConvertRow8(a, kp, w.kf + j * D);
        ConvertRow8(a, vp, w.vf + j * D);
        krow[j] = w.kf + j * D;
        vrow[j] = w.vf + j * D;
      }
      if (quant) {
        w.ksc[j] = a.ks[slot[j]];
        w.vsc[j] = a.vs[slot[j]];
      }
    }
    const int64_t nk_pad = RoundUp(nk, 8);
    for (int64_t j = nk; j < nk_pad; ++j) krow[j] = w.zero;
    if (transposed) {
      if (nk < KC) std::memset(w.kf + nk * D, 0, sizeof(float) * (KC - nk) * D);
      ScoresTransposed8(w, D, nk);
    } else if (rows_type == kKvBf16) {
      Scores8<uint16_t>(w, krow, nk_pad, D);
    } else if (rows_type == kKvS8) {
      Scores8<int8_t>(w, krow, nk_pad, D);
    } else {
      Scores8<float>(w, krow, nk_pad, D);
    }
    // Online softmax per row; probabilities replace the scores.
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int64_t r = 0; r < w.rows; ++r) {
      float* s = w.s + r * KC;
      const uint32_t bits = VisibleKeys(a, t, si, qpos0, r, c0, nk, hi);
      if (bits == 0) {
        for (int g = 0; g < 4; ++g) _mm256_storeu_ps(s + 8 * g, _mm256_setzero_ps());
        w.corr[r] = 1.0f;
        continue;
      }
      __m256 sv[4], mask[4];
      __m256 mx = _mm256_set1_ps(kMasked);
      JS_UNROLL for (int g = 0; g < 4; ++g) {
        const __m256i b = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits >> 8 * g)),
                                           lane_bit);
        mask[g] = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, lane_bit));
        sv[g] = _mm256_loadu_ps(s + 8 * g);
        if (quant) sv[g] = _mm256_mul_ps(sv[g], _mm256_loadu_ps(w.ksc + 8 * g));
        if (a.soft_cap > 0.0f) sv[g] = SoftCap256(sv[g], a.soft_cap);
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(kMasked), sv[g], mask[g]));
      }
      const float m_new = std::max(w.m[r], Avx2Max(mx));
      const float corr = std::exp(w.m[r] - m_new);
      w.m[r] = m_new;
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      JS_UNROLL for (int g = 0; g < 4; ++g) {
        __m256 p = _mm256_and_ps(mask[g], Exp8(_mm256_sub_ps(sv[g], mv)));
        sum = _mm256_add_ps(sum, p);
        if (quant) p = _mm256_mul_ps(p, _mm256_loadu_ps(w.vsc + 8 * g));
        _mm256_storeu_ps(s + 8 * g, p);
      }
      w.l[r] = w.l[r] * corr + Avx2Sum(sum);
      w.corr[r] = corr;
    }
    for (int64_t r = w.rows; r < w.rows_pad; ++r) {  // padding rows of the last P.V block
      for (int g = 0; g < 4; ++g) _mm256_storeu_ps(w.s + r * KC + 8 * g, _mm256_setzero_ps());
      w.corr[r] = 1.0f;
    }
    if (rows_type == kKvBf16) {
      Accumulate8<uint16_t>(w, vrow, nk, D);
    } else if (rows_type == kKvS8) {
      Accumulate8<int8_t>(w, vrow, nk, D);
    } else {
      Accumulate8<float>(w, vrow, nk, D);
    }
  }
  StoreOutputs(a, t, si, w);
}

// ---------------------------------------------------------------- AVX-512 attention

// e^x for x <= 0 (the softmax's only use): 2^n * e^r, |r| <= ln2/2, degree-7 Taylor
// polynomial (truncation < 6e-9 relative), vscalefps for 2^n. Inputs below -100 give ~0.
JS_AVX512 JS_INLINE __m512 Exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// cap * tanh(s / cap) = cap * sign(s) * (1 - e) / (1 + e), e = exp(-2 |s| / cap).
JS_AVX512 JS_INLINE __m512 SoftCap512(__m512 s, float cap) {
  const __m512 c = _mm512_set1_ps(cap);
  const __m512 x = _mm512_div_ps(s, c);
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 e = Exp512(_mm512_mul_ps(ax, _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  // copy the sign of x
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x80000000));
  t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
  return _mm512_mul_ps(c, t);
}

// One K/V row -> f32 (D a multiple of 16).
JS_AVX512 JS_INLINE void ConvertRow512(KvType kv, const char* src, float* dst, int64_t D) {
  switch (kv) {
    case kKvF32: std::memcpy(dst, src, sizeof(float) * D); break;
    case kKvBf16:
      for (int64_t e = 0; e < D; e += 16)
        _mm512_storeu_ps(dst + e, LoadBf16(reinterpret_cast<const uint16_t*>(src) + e));
      break;
    case kKvS8:
      for (int64_t e = 0; e < D; e += 16) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e));
        _mm512_storeu_ps(dst + e, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
      }
      break;
    case kKvF8:
      for (int64_t e = 0; e < D; e += 16) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e));
        const __m512i i = _mm512_cvtepu8_epi32(b);
        const __m512i em = _mm512_and_si512(i, _mm512_set1_epi32(0x7f));
        // normal: exponent and mantissa moved into an f32, rebiased by 2^(127 - 7)
        const __m512 normal = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(em, 20)),
                                            _mm512_set1_ps(1.329227995784916e+36f));
        // subnormal (exponent 0): mantissa * 2^-9
        const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / 512.0f));
        const __mmask16 is_sub = _mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8));
        const __mmask16 is_nan = _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7f));
        __m512 val = _mm512_mask_blend_ps(is_sub, normal, sub);
        val = _mm512_mask_blend_ps(is_nan, val, _mm512_set1_ps(std::nanf("")));
        const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(i, _mm512_set1_epi32(0x80)), 24);
        _mm512_storeu_ps(dst + e,
                         _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(val), sign)));
      }
      break;
  }
}

// A K or V row's 16 elements at e as f32: read in place (f32), or widened from bf16 or
// int8 (the int8 scale is applied to the scores and probabilities, not here).
template <typename KV>
JS_AVX512 JS_INLINE __m512 LoadRow(const void* row, int64_t e) {
  if constexpr (sizeof(KV) == 4) {
    return _mm512_loadu_ps(static_cast<const float*>(row) + e);
  } else if constexpr (sizeof(KV) == 2) {
    return LoadBf16(static_cast<const uint16_t*>(row) + e);
  } else {
    const int8_t* b8 = static_cast<const int8_t*>(row) + e;
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b8));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
}

// Scores of RB query rows against JB keys (RB * JB = 16): s[r * lds + j] = q[r] . k[j].
template <int RB, int JB, typename KV>
JS_AVX512 JS_INLINE void QkTile(const float* q, int64_t D, const void* const* krow, float* s,
                                int64_t lds) {
  static_assert(RB * JB == 16, "16 dot products per tile");
  __m512 acc[16];
  JS_UNROLL for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t e = 0;
  do {  // D >= 16 (a multiple of 16); a do-while keeps acc in registers
    if constexpr (JB <= 8) {
      __m512 kv[JB];
      JS_UNROLL for (int j = 0; j < JB; ++j) kv[j] = LoadRow<KV>(krow[j], e);
      JS_UNROLL for (int r = 0; r < RB; ++r) {
        const __m512 qv = _mm512_loadu_ps(q + r * D + e);
        JS_UNROLL for (int j = 0; j < JB; ++j)
          acc[r * JB + j] = _mm512_fmadd_ps(qv, kv[j], acc[r * JB + j]);
      }
    } else {
      const __m512 qv = _mm512_loadu_ps(q + e);
      JS_UNROLL for (int j = 0; j < JB; ++j)
        acc[j] = _mm512_fmadd_ps(qv, LoadRow<KV>(krow[j], e), acc[j]);
    }
    e += 16;
  } while (e < D);
  const __m512 sum = Reduce16(acc);
  if constexpr (JB == 16) {
    _mm512_storeu_ps(s, sum);
  } else if constexpr (JB == 8) {
    _mm256_storeu_ps(s, _mm512_castps512_ps256(sum));
    _mm256_storeu_ps(s + lds, _mm512_extractf32x8_ps(sum, 1));
  } else {
    _mm_storeu_ps(s, _mm512_castps512_ps128(sum));
    _mm_storeu_ps(s + lds, _mm512_extractf32x4_ps(sum, 1));
    _mm_storeu_ps(s + 2 * lds, _mm512_extractf32x4_ps(sum, 2));
    _mm_storeu_ps(s + 3 * lds, _mm512_extractf32x4_ps(sum, 3));
  }
}

// Scores of all rows (rows_pad, a multiple of 4) against nk_pad keys (a multiple of 16),
// prefetching the ahead chunk's K rows a tile's worth of keys at a time.
template <typename KV>
JS_AVX512 void Scores(const Work& w, const void* const* krow, int64_t nk_pad, int64_t D,
                      const Ahead& ah) {
  const int64_t KC = kKeysPerChunk;
  if (w.rows == 1) {
    for (int64_t j = 0; j < nk_pad; j += 16) {
      QkTile<1, 16, KV>(w.q, D, krow + j, w.s + j, KC);
      PrefetchAheadK(ah, j, 16);
    }
  } else if (w.rows == 2) {
    for (int64_t j = 0; j < nk_pad; j += 8) {
      QkTile<2, 8, KV>(w.q, D, krow + j, w.s + j, KC);
      PrefetchAheadK(ah, j, 8);
    }
  } else {
    for (int64_t r = 0; r < w.rows_pad; r += 4)
      for (int64_t j = 0; j < nk_pad; j += 4) {
        QkTile<4, 4, KV>(w.q + r * D, D, krow + j, w.s + r * KC + j, KC);
        if (r == 0) PrefetchAheadK(ah, j, 4);
      }
  }
}

// bf16 q and bf16 pages: scores as vdpbf16ps dot products of the unscaled bf16 rows (each
// product is exact in f32; the sums are f32), times sm_scale after. Half the instructions
// of the f32 tile and no widening of K.
template <int RB, int JB>
JS_AVX512BF16 JS_INLINE void QkTileDp(const uint16_t* q, int64_t D, const void* const* krow,
                                      float* s, int64_t lds, float scale) {
  static_assert(RB * JB == 16, "16 dot products per tile");
  __m512 acc[16];
  JS_UNROLL for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t e = 0;
  do {  // D >= 16; a last step of 16 elements is masked
    const __mmask32 m = Mask32(D - e);
    if constexpr (JB <= 8) {
      __m512bh kv[JB];
      JS_UNROLL for (int j = 0; j < JB; ++j)
        kv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(krow[j]) + e);
      JS_UNROLL for (int r = 0; r < RB; ++r) {
        const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + r * D + e);
        JS_UNROLL for (int j = 0; j < JB; ++j)
          acc[r * JB + j] = _mm512_dpbf16_ps(acc[r * JB + j], qv, kv[j]);
      }
    } else {
      const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + e);
      JS_UNROLL for (int j = 0; j < JB; ++j)
        acc[j] = _mm512_dpbf16_ps(
            acc[j], qv,
            (__m512bh)_mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(krow[j]) + e));
    }
    e += 32;
  } while (e < D);
  const __m512 sum = _mm512_mul_ps(Reduce16(acc), _mm512_set1_ps(scale));
  if constexpr (JB == 16) {
    _mm512_storeu_ps(s, sum);
  } else if constexpr (JB == 8) {
    _mm256_storeu_ps(s, _mm512_castps512_ps256(sum));
    _mm256_storeu_ps(s + lds, _mm512_extractf32x8_ps(sum, 1));
  } else {
    _mm_storeu_ps(s, _mm512_castps512_ps128(sum));
    _mm_storeu_ps(s + lds, _mm512_extractf32x4_ps(sum, 1));
    _mm_storeu_ps(s + 2 * lds, _mm512_extractf32x4_ps(sum, 2));
    _mm_storeu_ps(s + 3 * lds, _mm512_extractf32x4_ps(sum, 3));
  }
}

JS_AVX512BF16 void ScoresDp(const Work& w, const void* const* krow, int64_t nk_pad, int64_t D,
                            float scale, const Ahead& ah) {
  const int64_t KC = kKeysPerChunk;
  if (w.rows == 1) {
    for (int64_t j = 0; j < nk_pad; j += 16) {
      QkTileDp<1, 16>(w.qb, D, krow + j, w.s + j, KC, scale);
      PrefetchAheadK(ah, j, 16);
    }
  } else if (w.rows == 2) {
    for (int64_t j = 0; j < nk_pad; j += 8) {
      QkTileDp<2, 8>(w.qb, D, krow + j, w.s + j, KC, scale);
      PrefetchAheadK(ah, j, 8);
    }
  } else {
    for (int64_t r = 0; r < w.rows_pad; r += 4)
      for (int64_t j = 0; j < nk_pad; j += 4) {
        QkTileDp<4, 4>(w.qb + r * D, D, krow + j, w.s + r * KC + j, KC, scale);
        if (r == 0) PrefetchAheadK(ah, j, 4);
      }
  }
}

// Many rows (prefill): scores of RB rows against the chunk's 32 keys from K^T [D][32] --
// broadcast q[r, d] times a row of K^T, no horizontal sums.
template <int RB>
JS_AVX512 JS_INLINE void QkRowsT(const float* q, int64_t D, const float* kt, float* s) {
  __m512 acc[RB][2];
  JS_UNROLL for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t d = 0;
  do {  // D >= 16
    const __m512 k0 = _mm512_loadu_ps(kt + d * kKeysPerChunk);
    const __m512 k1 = _mm512_loadu_ps(kt + d * kKeysPerChunk + 16);
    JS_UNROLL for (int r = 0; r < RB; ++r) {
      const __m512 qb = _mm512_set1_ps(q[r * D + d]);
      acc[r][0] = _mm512_fmadd_ps(qb, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qb, k1, acc[r][1]);
    }
  } while (++d < D);
  JS_UNROLL for (int r = 0; r < RB; ++r) {
    _mm512_storeu_ps(s + r * kKeysPerChunk, acc[r][0]);
    _mm512_storeu_ps(s + r * kKeysPerChunk + 16, acc[r][1]);
  }
}

// K^T of the chunk (kf [32][D], rows past the chunk's keys zero) into w.kt, then the scores
// of every row in blocks of 12 (24 accumulators).
JS_AVX512 void ScoresTransposed(const Work& w, int64_t D) {
  const int64_t KC = kKeysPerChunk;
  for (int64_t j0 = 0; j0 < KC; j0 += 16)
    for (int64_t d0 = 0; d0 < D; d0 += 16)
      Transpose16(reinterpret_cast<const uint32_t*>(w.kf + j0 * D + d0), D, 16, 16,
                  reinterpret_cast<uint32_t*>(w.kt + d0 * KC + j0), KC);
  int64_t r = 0;
  for (; r + 12 <= w.rows; r += 12) QkRowsT<12>(w.q + r * D, D, w.kt, w.s + r * KC);
  const float* q = w.q + r * D;
  float* s = w.s + r * KC;
  switch (w.rows - r) {
    case 1: QkRowsT<1>(q, D, w.kt, s); break;
    case 2: QkRowsT<2>(q, D, w.kt, s); break;
    case 3: QkRowsT<3>(q, D, w.kt, s); break;
    case 4: QkRowsT<4>(q, D, w.kt, s); break;
    case 5: QkRowsT<5>(q, D, w.kt, s); break;
    case 6: QkRowsT<6>(q, D, w.kt, s); break;
    case 7: QkRowsT<7>(q, D, w.kt, s); break;
    case 8: QkRowsT<8>(q, D, w.kt, s); break;
    case 9: QkRowsT<9>(q, D, w.kt, s); break;
    case 10: QkRowsT<10>(q, D, w.kt, s); break;
    case 11: QkRowsT<11>(q, D, w.kt, s); break;
    default: break;
  }
}

// o[r, cols] = o[r, cols] * corr[r] + sum_j p[r, j] v[j, cols] for RB rows and NV vectors of
// columns starting at col; the V row of the ahead chunk's key j prefetched with key j's.
template <int RB, int NV, typename KV>
JS_AVX512 JS_INLINE void PvTile(const float* p, int64_t ldp, const void* const* vrow,
                                int64_t nk, float* o, int64_t D, const float* corr, int64_t col,
                                const Ahead* ah) {
  __m512 acc[RB][NV];
  JS_UNROLL for (int r = 0; r < RB; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    JS_UNROLL for (int v = 0; v < NV; ++v)
      acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + col + 16 * v), c);
  }
  int64_t j = 0;
  do {  // nk >= 1
    __m512 vv[NV];
    JS_UNROLL for (int v = 0; v < NV; ++v) vv[v] = LoadRow<KV>(vrow[j], col + 16 * v);
    PrefetchAheadV(ah, j);
    JS_UNROLL for (int r = 0; r < RB; ++r) {
      const __m512 pb = _mm512_set1_ps(p[r * ldp + j]);
      JS_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(pb, vv[v], acc[r][v]);
    }
  } while (++j < nk);
  JS_UNROLL for (int r = 0; r < RB; ++r)
    JS_UNROLL for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + r * D + col + 16 * v, acc[r][v]);
}

// All columns of RB rows from r0: NV vectors at a time, at most 16 / RB (up to 16
// accumulators beside the NV rows of V); the first tile prefetches `ah`'s V rows.
template <int RB, typename KV>
JS_AVX512 JS_INLINE void PvRowBlock(const Work& w, const void* const* vrow, int64_t nk,
                                    int64_t D, int64_t r0, const Ahead* ah) {
  constexpr int kMaxNv = RB <= 2 ? 8 : RB <= 4 ? 4 : 2;
  const int64_t ldp = kKeysPerChunk;
  const float* p = w.s + r0 * ldp;
  float* o = w.o + r0 * D;
  const float* corr = w.corr + r0;
  int64_t col = 0;
  for (; col + 16 * kMaxNv <= D; col += 16 * kMaxNv)
    PvTile<RB, kMaxNv, KV>(p, ldp, vrow, nk, o, D, corr, col, col == 0 ? ah : nullptr);
  if constexpr (kMaxNv > 4) {
    if (col + 64 <= D) {
      PvTile<RB, 4, KV>(p, ldp, vrow, nk, o, D, corr, col, col == 0 ? ah : nullptr);
      col += 64;
    }
  }
  if constexpr (kMaxNv > 2) {
    if (col + 32 <= D) {
      PvTile<RB, 2, KV>(p, ldp, vrow, nk, o, D, corr, col, col == 0 ? ah : nullptr);
      col += 32;
    }
  }
  if (col + 16 <= D) PvTile<RB, 1, KV>(p, ldp, vrow, nk, o, D, corr, col, col == 0 ? ah : nullptr);
}

// P.V for all rows in blocks of 8, 4 or 2 (a block's rows past the real ones, within
// rows_pad, have p = 0 and corr = 1), so each V element is loaded once per block.
template <typename KV>
JS_AVX512 void Accumulate(const Work& w, const void* const* vrow, int64_t nk, int64_t D,
                          const Ahead& ah) {
  int64_t r = 0;
  while (r < w.rows) {
    const int64_t left = w.rows - r;
    const Ahead* first = r == 0 ? &ah : nullptr;
    if (left >= 8) {
      PvRowBlock<8, KV>(w, vrow, nk, D, r, first);
      r += 8;
    } else if (left >= 3) {
      PvRowBlock<4, KV>(w, vrow, nk, D, r, first);
      r += 4;
    } else {
      PvRowBlock<2, KV>(w, vrow, nk, D, r, first);
      r += 2;
    }
  }
}

JS_AVX512 void Avx512AttnTask(const Attn& a, const AttnTask& t) {
  const int64_t D = a.d, KC = kKeysPerChunk;
  const SeqInfo si = SequenceInfo(a, t.seq);
  Work w;
  int64_t lo, hi;
  StartTask(a, t, si, &w, &lo, &hi, /*padded=*/true);
  const int64_t qpos0 = si.kv_len - si.q_len + t.q0;
  std::memset(w.zero, 0, sizeof(float) * D);
  const bool quant = a.ks != nullptr;
  // K/V rows are read in place when f32, bf16 or int8 with at most 8 rows (a row is widened
  // where it is used, once per 4-8 rows); otherwise (fp8, or many rows) converted to f32
  // once per chunk into the scratch.
  // With more than 8 rows (prefill) the scores come from K^T (ScoresTransposed).
  const bool transposed = w.rows_pad > 8;
  const bool in_place = !transposed && a.kv != kKvF8;
  const void* krow[kKeysPerChunk];
  const void* vrow[kKeysPerChunk];
  int64_t slot[kKeysPerChunk], ahead[kKeysPerChunk];
  Ahead ah;  // rows read in place: the tiles prefetch the ahead chunk
  ah.bytes = D * a.kv_esize;
  PrefetchFirstChunks</*ToL2=*/true>(a, t, lo, hi);
  for (int64_t c0 = lo; c0 < hi; c0 += KC) {
    const int64_t nk = std::min(KC, hi - c0);
    ChunkSlots(a, t.seq, t.head, c0, nk, slot);
    // Keys kAttnPrefetchChunks chunks on are prefetched into L2: by the tiles when the rows
    // are read in place, else row by row alongside this chunk's conversion.
    const int64_t c_ahead = c0 + kAttnPrefetchChunks * KC;
    const int64_t na = c_ahead < hi ? std::min(KC, hi - c_ahead) : 0;
    if (na > 0) ChunkSlots(a, t.seq, t.head, c_ahead, na, ahead);
    ah.n = in_place ? na : 0;
    // K and V rows of the chunk as f32: in place for an f32 cache, else converted.
    for (int64_t j = 0; j < nk; ++j) {
      if (j < na) {
        const bool scales = j == 0 || ahead[j] % 16 == 0;
        if (in_place) {
          ah.k[j] = KvRow(a, a.k, ahead[j]);
          ah.v[j] = KvRow(a, a.v, ahead[j]);
          if (scales) PrefetchScales(a, ahead[j]);
        } else {
          PrefetchKv</*ToL2=*/true>(a, ahead[j], scales);
        }
      }
      const char* kp = KvRow(a, a.k, slot[j]);
      const char* vp = KvRow(a, a.v, slot[j]);
      if (in_place) {
        krow[j] = kp;
        vrow[j] = vp;
      } else {
        ConvertRow512(a.kv, kp, w.kf + j * D, D);
        ConvertRow512(a.kv, vp, w.vf + j * D, D);
        krow[j] = w.kf + j * D;
        vrow[j] = w.vf + j * D;
      }
      if (quant) {
        w.ksc[j] = a.ks[slot[j]];
        w.vsc[j] = a.vs[slot[j]];
      }
    }
    const int64_t nk_pad = RoundUp(nk, 16);
    for (int64_t j = nk; j < nk_pad; ++j) krow[j] = w.zero;  // a row of zeros of either type
    // The element type the tiles read: f32 (scratch or an f32 cache), bf16 or int8 in place.
    const KvType rows_type = in_place ? a.kv : kKvF32;
    if (transposed) {
      if (nk < KC) std::memset(w.kf + nk * D, 0, sizeof(float) * (KC - nk) * D);
      ScoresTransposed(w, D);
    } else if (rows_type == kKvBf16 && a.bf16_dot) {
      ScoresDp(w, krow, nk_pad, D, a.sm_scale, ah);
    } else if (rows_type == kKvBf16) {
      Scores<uint16_t>(w, krow, nk_pad, D, ah);
    } else if (rows_type == kKvS8) {
      Scores<int8_t>(w, krow, nk_pad, D, ah);
    } else {
      Scores<float>(w, krow, nk_pad, D, ah);
    }
    // Online softmax per row; probabilities replace the scores.
    const __m512 ksc0 = quant ? _mm512_loadu_ps(w.ksc) : _mm512_set1_ps(1.0f);
    const __m512 ksc1 = quant ? _mm512_loadu_ps(w.ksc + 16) : _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < w.rows; ++r) {
      float* s = w.s + r * KC;
      const uint32_t bits = VisibleKeys(a, t, si, qpos0, r, c0, nk, hi);
      if (bits == 0) {
        _mm512_storeu_ps(s, _mm512_setzero_ps());
        _mm512_storeu_ps(s + 16, _mm512_setzero_ps());
        w.corr[r] = 1.0f;
        continue;
      }
      const __mmask16 m0 = static_cast<__mmask16>(bits & 0xffff);
      const __mmask16 m1 = static_cast<__mmask16>(bits >> 16);
      __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
      if (quant) {
        s0 = _mm512_mul_ps(s0, ksc0);
        s1 = _mm512_mul_ps(s1, ksc1);
      }
      if (a.soft_cap > 0.0f) {
        s0 = SoftCap512(s0, a.soft_cap);
        s1 = SoftCap512(s1, a.soft_cap);
      }
      const __m512 neg = _mm512_set1_ps(kMasked);
      const float mx = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_mask_mov_ps(neg, m0, s0), _mm512_mask_mov_ps(neg, m1, s1)));
      const float m_new = std::max(w.m[r], mx);
      const float corr = std::exp(w.m[r] - m_new);
      w.m[r] = m_new;
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 p0 = _mm512_maskz_mov_ps(m0, Exp512(_mm512_sub_ps(s0, mv)));
      __m512 p1 = _mm512_maskz_mov_ps(m1, Exp512(_mm512_sub_ps(s1, mv)));
      w.l[r] = w.l[r] * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      if (quant) {
        p0 = _mm512_mul_ps(p0, _mm512_loadu_ps(w.vsc));
        p1 = _mm512_mul_ps(p1, _mm512_loadu_ps(w.vsc + 16));
      }
      _mm512_storeu_ps(s, p0);
      _mm512_storeu_ps(s + 16, p1);
      w.corr[r] = corr;
    }
    for (int64_t r = w.rows; r < w.rows_pad; ++r) {  // padding rows of the last P.V block
      _mm512_storeu_ps(w.s + r * KC, _mm512_setzero_ps());
      _mm512_storeu_ps(w.s + r * KC + 16, _mm512_setzero_ps());
      w.corr[r] = 1.0f;
    }
    // Accumulate P.V.
    if (rows_type == kKvBf16) {
      Accumulate<uint16_t>(w, vrow, nk, D, ah);
    } else if (rows_type == kKvS8) {
      Accumulate<int8_t>(w, vrow, nk, D, ah);
    } else {
      Accumulate<float>(w, vrow, nk, D, ah);
    }
  }
  // Normalise and store in q's dtype.
  for (int64_t r = 0; r < w.rows; ++r) {
    const int64_t i = r / a.group, g = r % a.group;
    const int64_t dst = ((si.tok + t.q0 + i) * a.hq + t.head * a.group + g) * D;
    const __m512 inv = _mm512_set1_ps(w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f);
    const float* o = w.o + r * D;
    for (int64_t e = 0; e < D; e += 16) {
      const __m512 val = _mm512_mul_ps(_mm512_loadu_ps(o + e), inv);
      if (a.q_bf16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(a.out) + dst + e),
                            F32ToBf16x16(val));
      } else {
        _mm512_storeu_ps(static_cast<float*>(a.out) + dst + e, val);
      }
    }
  }
}
#endif  // JS_X86

// Tasks: (sequence, KV head, block of queries), largest first.
std::vector<AttnTask> PlanAttention(const Attn& a, int64_t num_seqs, int64_t queries_per_block,
                                    int64_t threads) {
  std::vector<AttnTask> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const SeqInfo si = SequenceInfo(a, s);
    if (si.q_len <= 0) continue;
    int64_t bq = queries_per_block;
    if (bq <= 0) {
      bq = std::max<int64_t>(1, 64 / a.group);  // about 64 query rows per task
      // Enough tasks for the threads when a single prompt is the whole batch.
      while (bq > 1 && CeilDiv(si.q_len, bq) * a.hkv < 4 * threads) bq /= 2;
    }
    for (int64_t q0 = 0; q0 < si.q_len; q0 += bq) {
      const int64_t q1 = std::min(si.q_len, q0 + bq);
      int64_t lo, hi;
      KeyRange(a, si, q0, q1, &lo, &hi);
      const int64_t cost = (q1 - q0) * std::max<int64_t>(hi - lo, 0) + 64;
      for (int64_t h = 0; h < a.hkv; ++h)
        tasks.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h),
                         static_cast<int32_t>(q0), static_cast<int32_t>(q1), cost});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const AttnTask& x, const AttnTask& y) { return x.cost > y.cost; });
  return tasks;
}

void Attention(const Runner& run, const Attn& a, int64_t num_seqs, int64_t queries_per_block) {
  const size_t osize = a.q_bf16 ? 2 : 4;
  const int64_t token_bytes = a.hq * a.d * static_cast<int64_t>(osize);
  num_seqs = std::clamp<int64_t>(num_seqs, 0, a.max_seqs);
  // Padding tokens (past the last real sequence) are zeros.
  const int64_t real_end = num_seqs > 0 ? std::clamp<int64_t>(a.cu[num_seqs], 0, a.T) : 0;
  if (real_end < a.T)
    std::memset(static_cast<char*>(a.out) + real_end * token_bytes, 0,
                static_cast<size_t>((a.T - real_end) * token_bytes));
  const std::vector<AttnTask> tasks = PlanAttention(a, num_seqs, queries_per_block, run.threads());
  const int isa = CurrentIsa();
#if JS_X86
  // Claimed in order, a thread's next task is about `threads` further on: its first chunks
  // go into L2 while this one runs (taken by another thread, its keys are in the shared L3
  // by then). The AVX-512 tasks prefetch into L2 throughout: with their rows prefetched
  // into L1 the L1 miss buffers filled and the loads waited (Zen 4: decode 64 x 128-200
  // keys 1.3-1.6x, 8 x 1024 1.3x the time; benchmarks/RESULTS.md).
  const int64_t n = static_cast<int64_t>(tasks.size()), ahead = run.threads();
  auto run_tasks = [&](auto&& task) {
    run.For(n, [&](int64_t i) {
      if (i + ahead < n) PrefetchTaskStart(a, tasks[i + ahead]);
      task(tasks[i]);
    });
  };
  if (isa >= kAvx512 && a.d % 16 == 0) {
    Attn b = a;
    b.bf16_dot = isa >= kAvx512Bf16 && a.q_bf16 && a.kv == kKvBf16;
    return run_tasks([&](const AttnTask& t) { Avx512AttnTask(b, t); });
  }
  if (isa >= kAvx2 && a.d % 8 == 0)
    return run_tasks([&](const AttnTask& t) { Avx2AttnTask(a, t); });
#endif
  (void)isa;
  run.For(static_cast<int64_t>(tasks.size()), [&](int64_t i) { ScalarAttnTask(a, tasks[i]); });
}

// ==========================================================================================
// FFI handlers
// ==========================================================================================

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> num_rows,
                      ffi::RemainingArgs ws, ffi::RemainingRets ys, bool transpose_w,
                      bool packed_w) {
  const auto xd = x.dimensions();
  const ffi::DataType dt = x.element_type();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("jaxserve_matmul: x must be 2-D");
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("jaxserve_matmul: x must be float32 or bfloat16");
  if (num_rows.element_count() != 1)
    return ffi::Error::InvalidArgument("jaxserve_matmul: num_rows must be a scalar");
  if (ws.size() == 0 || ws.size() != ys.size())
    return ffi::Error::InvalidArgument("jaxserve_matmul: one result per weight, at least one");
  const int64_t m_all = xd[0], k = xd[1];
  const int64_t m = std::clamp<int64_t>(num_rows.typed_data()[0], 0, m_all);
  std::vector<Mm> mms;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("jaxserve_matmul: bad weight or result");
    const auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != 2 || yd.size() != 2)
      return ffi::Error::InvalidArgument("jaxserve_matmul: w and y must be 2-D");
    if (w->element_type() != dt || (*y)->element_type() != dt)
      return ffi::Error::InvalidArgument(
          "jaxserve_matmul: x, w and y must all be float32 or all bfloat16");
    const int64_t n = transpose_w ? wd[0] : wd[1];
    if ((transpose_w ? wd[1] : wd[0]) != k || yd[0] != m_all || yd[1] != n)
      return ffi::Error::InvalidArgument("jaxserve_matmul: shapes do not match");
    if (packed_w && (!transpose_w || n % 64 != 0 || (dt == ffi::DataType::BF16 && k % 2 != 0)))
      return ffi::Error::InvalidArgument(
          "jaxserve_matmul: a packed w is [N, K] (transpose_w) with N a multiple of 64 "
          "and, in bfloat16, K even");
    mms.push_back(Mm{x.untyped_data(), w->untyped_data(), (*y)->untyped_data(), m, k, n,
                     transpose_w, dt == ffi::DataType::BF16, packed_w});
  }
  Runner run(&pool);
  Matmuls(run, mms.data(), static_cast<int64_t>(mms.size()));
  return ffi::Error::Success();
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                         ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> kv_lens,
                         ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                         ffi::Buffer<ffi::S32> num_seqs, ffi::AnyBuffer k_scales,
                         ffi::AnyBuffer v_scales, ffi::Buffer<ffi::S32> tree_start,
                         ffi::Buffer<ffi::S32> tree_mask, ffi::Result<ffi::AnyBuffer> out,
                         float sm_scale, int64_t sliding_window, float soft_cap,
                         int64_t queries_per_block) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("jaxserve_ragged_paged_attention: " + what);
  };
  const auto qd = q.dimensions(), kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4) return bad("q must be 3-D and the pages 4-D");
  if (k_pages.dimensions().size() != v_pages.dimensions().size() ||
      k_pages.element_type() != v_pages.element_type())
    return bad("k_pages and v_pages differ");
  for (size_t i = 0; i < 4; ++i)
    if (k_pages.dimensions()[i] != v_pages.dimensions()[i])
      return bad("k_pages and v_pages differ");
  const ffi::DataType qt = q.element_type(), kt = k_pages.element_type();
  if (qt != ffi::DataType::F32 && qt != ffi::DataType::BF16) return bad("q must be f32 or bf16");
  if (out->element_type() != qt || out->element_count() != q.element_count())
    return bad("out must match q");
  Attn a{};
  switch (kt) {
    case ffi::DataType::F32: a.kv = kKvF32; a.kv_esize = 4; break;
    case ffi::DataType::BF16:
    case ffi::DataType::U16:  // a bf16 pool kept as its bits (kv_cache.pool_dtype)
      a.kv = kKvBf16;
      a.kv_esize = 2;
      break;
    case ffi::DataType::S8: a.kv = kKvS8; a.kv_esize = 1; break;
    case ffi::DataType::F8E4M3FN: a.kv = kKvF8; a.kv_esize = 1; break;
    default: return bad("pages must be f32, bf16 (or its uint16 bits), int8 or float8_e4m3fn");
  }
  a.T = qd[0];
  a.hq = qd[1];
  a.d = qd[2];
  a.hkv = kd[0];
  a.num_pages = kd[1];
  a.page_size = kd[2];
  if (kd[3] != a.d) return bad("head_dim of q and pages differ");
  if (a.hkv <= 0 || a.hq % a.hkv != 0) return bad("q heads must be a multiple of kv heads");
  a.group = a.hq / a.hkv;
  const auto pd = page_indices.dimensions();
  if (pd.size() != 2) return bad("page_indices must be 2-D");
  a.max_seqs = pd[0];
  a.pps = pd[1];
  if (kv_lens.element_count() != static_cast<size_t>(a.max_seqs) ||
      cu_q_lens.element_count() != static_cast<size_t>(a.max_seqs + 1) ||
      num_seqs.element_count() != 1)
    return bad("kv_lens, cu_q_lens or num_seqs has the wrong size");
  const bool quant = a.kv == kKvS8 || a.kv == kKvF8;
  if (quant) {
    const size_t n = static_cast<size_t>(a.hkv * a.num_pages * a.page_size);
    if (k_scales.element_type() != ffi::DataType::F32 ||
        v_scales.element_type() != ffi::DataType::F32 || k_scales.element_count() != n ||
        v_scales.element_count() != n)
      return bad("an 8-bit cache needs f32 k_scales and v_scales [kv_heads, pages, page_size]");
    a.ks = static_cast<const float*>(k_scales.untyped_data());
    a.vs = static_cast<const float*>(v_scales.untyped_data());
  }
  a.q = q.untyped_data();
  a.q_bf16 = qt == ffi::DataType::BF16;
  a.k = k_pages.untyped_data();
  a.v = v_pages.untyped_data();
  a.kv_lens = kv_lens.typed_data();
  a.pages = page_indices.typed_data();
  a.cu = cu_q_lens.typed_data();
  a.out = out->untyped_data();
  a.sm_scale = sm_scale;
  a.soft_cap = soft_cap > 0.0f ? soft_cap : 0.0f;
  a.window = sliding_window > 0 ? sliding_window : 0;
  if (tree_start.element_count() > 0 || tree_mask.element_count() > 0) {
    if (tree_start.element_count() != static_cast<size_t>(a.max_seqs) ||
        tree_mask.element_count() != static_cast<size_t>(a.T))
      return bad("tree_start must be [S] and tree_mask [T] (both empty: no trees)");
    a.tree_start = tree_start.typed_data();
    a.tree_mask = tree_mask.typed_data();
  }
  if (a.T == 0 || a.hq == 0 || a.d == 0) return ffi::Error::Success();
  if (a.num_pages == 0 || a.page_size == 0 || a.pps == 0) {
    std::memset(a.out, 0, out->size_bytes());
    return ffi::Error::Success();
  }
  Runner run(&pool);
  Attention(run, a, num_seqs.typed_data()[0], queries_per_block);
  return ffi::Error::Success();
}

// K/V write: token t's [num_kv_heads, head_dim] rows of k and v go to flat slot
// slot_mapping[t] (page * page_size + row) of every head's pages, in place (the results
// alias the pages); slots outside the pool (padding) are skipped. Bytes are copied as they
// are: the caller casts the new rows to the pool's dtype first.
ffi::Error WriteKvImpl(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("jaxserve_write_kv: " + what);
  };
  const auto pd = k_pages.dimensions(), xd = k.dimensions();
  if (pd.size() != 4 || xd.size() != 3) return bad("pages must be 4-D and new K/V 3-D");
  for (size_t i = 0; i < 4; ++i)
    if (v_pages.dimensions()[i] != pd[i]) return bad("k_pages and v_pages differ");
  for (size_t i = 0; i < 3; ++i)
    if (v.dimensions()[i] != xd[i]) return bad("k and v differ");
  // New K/V in the pages' dtype, or bf16 into a pool of their uint16 bits (copied as bits).
  const ffi::DataType dt = k_pages.element_type();
  auto fits = [dt](ffi::DataType x) {
    return x == dt || (dt == ffi::DataType::U16 && x == ffi::DataType::BF16);
  };
  if (v_pages.element_type() != dt || !fits(k.element_type()) ||
      v.element_type() != k.element_type())
    return bad("pages and new K/V must share one dtype (or bf16 K/V into uint16 pages)");
  const int64_t heads = pd[0], slots = pd[1] * pd[2], d = pd[3], T = xd[0];
  if (xd[1] != heads || xd[2] != d) return bad("new K/V must be [T, num_kv_heads, head_dim]");
  if (slot_mapping.element_count() != static_cast<size_t>(T))
    return bad("slot_mapping must hold one slot per token");
  const size_t row = static_cast<size_t>(d) * (k_pages.size_bytes() / k_pages.element_count());
  const std::pair<const ffi::AnyBuffer*, ffi::AnyBuffer*> pairs[2] = {
      {&k_pages, &*k_out}, {&v_pages, &*v_out}};
  const ffi::AnyBuffer* news[2] = {&k, &v};
  const int32_t* slot = slot_mapping.typed_data();
  for (int i = 0; i < 2; ++i) {
    char* dst = static_cast<char*>(pairs[i].second->untyped_data());
    if (dst != pairs[i].first->untyped_data())  // not aliased: start from the pages
      std::memcpy(dst, pairs[i].first->untyped_data(), pairs[i].first->size_bytes());
    const char* src = static_cast<const char*>(news[i]->untyped_data());
    for (int64_t t = 0; t < T; ++t) {
      if (slot[t] < 0 || slot[t] >= slots) continue;
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(dst + (h * slots + slot[t]) * row, src + (t * heads + h) * row, row);
    }
  }
  return ffi::Error::Success();
}

// Row-wise ops: shapes and dtypes of [M, K] operands and results, the rows past num_rows
// left unwritten. `a` is x (norm) or the gate; `b` the residual (norm; empty: none) or up.
ffi::Error RowsImpl(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer w,
                    ffi::Buffer<ffi::S32> num_rows, ffi::RemainingRets outs, bool norm,
                    const char* name, RowsOp o) {
  auto bad = [&](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(name) + ": " + what);
  };
  const auto ad = a.dimensions();
  const ffi::DataType dt = a.element_type();
  if (ad.size() != 2) return bad("operands must be 2-D");
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16) return bad("f32 or bf16 only");
  if (num_rows.element_count() != 1) return bad("num_rows must be a scalar");
  const bool with_b = !norm || b.element_count() > 0;
  if (with_b && (b.element_type() != dt || b.element_count() != a.element_count()))
    return bad("the second operand must match the first");
  if (norm && (w.element_type() != dt || w.element_count() != static_cast<size_t>(ad[1])))
    return bad("the weight must be [K] in the operands' dtype");
  const size_t want = norm && with_b ? 2 : 1;
  if (outs.size() != want) return bad("wrong number of results");
  void* ys[2] = {nullptr, nullptr};
  for (size_t i = 0; i < want; ++i) {
    auto y = outs.get<ffi::AnyBuffer>(i);
    if (!y.has_value() || (*y)->element_type() != dt ||
        (*y)->element_count() != a.element_count())
      return bad("results must match the operands");
    ys[i] = (*y)->untyped_data();
  }
  const int64_t m_all = ad[0];
  o.k = ad[1];
  o.m = std::clamp<int64_t>(num_rows.typed_data()[0], 0, m_all);
  o.a = a.untyped_data();
  o.b = with_b ? b.untyped_data() : nullptr;
  o.w = w.untyped_data();
  o.y = ys[0];
  o.sum = ys[1];
  Runner run(&pool);
  Rows(run, o, norm, dt == ffi::DataType::BF16);
  return ffi::Error::Success();
}

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                       ffi::AnyBuffer w, ffi::Buffer<ffi::S32> num_rows, ffi::RemainingRets outs,
                       float eps, bool offset) {
  RowsOp o{};
  o.eps = eps;
  o.offset = offset;
  return RowsImpl(pool, x, residual, w, num_rows, outs, true, "jaxserve_rms_norm", o);
}

ffi::Error GatedActImpl(ffi::ThreadPool pool, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                        ffi::Buffer<ffi::S32> num_rows, ffi::RemainingRets outs, int64_t act) {
  if (act != kActSilu && act != kActGeluTanh)
    return ffi::Error::InvalidArgument("jaxserve_gated_act: act must be 0 (silu) or 1 (gelu)");
  RowsOp o{};
  o.act = static_cast<int>(act);
  return RowsImpl(pool, gate, up, gate, num_rows, outs, false, "jaxserve_gated_act", o);
}

ffi::Error RopeImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                    ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                    ffi::Buffer<ffi::S32> num_rows, ffi::Result<ffi::AnyBuffer> q_out,
                    ffi::Result<ffi::AnyBuffer> k_out) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("jaxserve_rope: " + what);
  };
  const auto qd = q.dimensions(), kd = k.dimensions();
  const ffi::DataType dt = q.element_type();
  if (qd.size() != 3 || kd.size() != 3) return bad("q and k must be [T, heads, D]");
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16) return bad("f32 or bf16 only");
  if (k.element_type() != dt || kd[0] != qd[0] || kd[2] != qd[2] || qd[2] % 2)
    return bad("k must match q's dtype, tokens and (even) head size");
  const int64_t m_all = qd[0], d = qd[2];
  if (cos.element_count() != static_cast<size_t>(m_all * d / 2) ||
      sin.element_count() != cos.element_count())
    return bad("cos and sin must be [T, D / 2]");
  if (num_rows.element_count() != 1) return bad("num_rows must be a scalar");
  if (q_out->element_type() != dt || q_out->element_count() != q.element_count() ||
      k_out->element_type() != dt || k_out->element_count() != k.element_count())
    return bad("results must match q and k");
  RopeOp o{};
  o.x[0] = q.untyped_data();
  o.x[1] = k.untyped_data();
  o.y[0] = q_out->untyped_data();
  o.y[1] = k_out->untyped_data();
  o.heads[0] = qd[1];
  o.heads[1] = kd[1];
  o.cos = cos.typed_data();
  o.sin = sin.typed_data();
  o.d = d;
  o.m = std::clamp<int64_t>(num_rows.typed_data()[0], 0, m_all);
  Runner run(&pool);
  Rope(run, o, dt == ffi::DataType::BF16);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, jaxserve::MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<bool>("transpose_w")
                                  .Attr<bool>("packed_w"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttention, jaxserve::AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("queries_per_block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKv, jaxserve::WriteKvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRmsNorm, jaxserve::RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<float>("eps")
                                  .Attr<bool>("offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGatedAct, jaxserve::GatedActImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<int64_t>("act"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRope, jaxserve::RopeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// Instruction-set control for tests: the level the kernels run at (0 scalar, 1 AVX2+FMA,
// 2 AVX-512, 3 AVX-512 + BF16), capped at what the CPU has. Returns the level now in force.
extern "C" int jaxserve_cpu_set_max_isa(int level) {
  jaxserve::g_max_isa.store(level, std::memory_order_relaxed);
  return jaxserve::CurrentIsa();
}

extern "C" int jaxserve_cpu_isa() { return jaxserve::CurrentIsa(); }

// Diagnostics: nanoseconds for a cache line to go from this thread to another spinning one
// and back, the median of `rounds` timings of `trips` trips each. It tells where a VM's
// two vCPUs sit: on a 2-core Zen 4 EPYC VM 58-63 ns on one core's two SMT threads, 85-125
// on two cores of one L3 and 310-400 across two of the host's CCDs, the placement
// changing every few seconds under load (across CCDs memory reads 46-55 GB/s instead of
// 31-35; benchmarks/offline_throughput.py records it per round).
extern "C" double jaxserve_cpu_round_trip_ns(int64_t trips, int64_t rounds) {
  struct alignas(64) Ball {
    std::atomic<int64_t> turn{0};
  } ball;
  const int64_t total = trips * (rounds + 1);  // the first round, untimed, starts the thread
  std::thread other([&] {
    for (int64_t i = 0; i < total; ++i) {
      while (ball.turn.load(std::memory_order_acquire) != 2 * i + 1) {
      }
      ball.turn.store(2 * i + 2, std::memory_order_release);
    }
  });
  std::vector<double> ns;
  auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < total; ++i) {
    ball.turn.store(2 * i + 1, std::memory_order_release);
    while (ball.turn.load(std::memory_order_acquire) != 2 * i + 2) {
    }
    if ((i + 1) % trips == 0) {
      const auto now = std::chrono::steady_clock::now();
      if (i + 1 > trips)
        ns.push_back(std::chrono::duration<double, std::nano>(now - start).count() / trips);
      start = now;
    }
  }
  other.join();
  std::sort(ns.begin(), ns.end());
  return ns.empty() ? 0.0 : ns[ns.size() / 2];
}

namespace {
// `iters` steps of 16 independent multiply-add chains of 16 floats: seconds it took. The
// chains keep the floating-point units of one core busy, so two threads sharing a core
// (SMT siblings) each take about twice as long as one alone.
double FloatLoopSeconds(int64_t iters) {
  typedef float V16 __attribute__((vector_size(64)));
  V16 acc[16];
  const V16 mul = V16{} + 0.9999999f, add = V16{} + 1e-7f;
  for (int i = 0; i < 16; ++i) acc[i] = V16{} + (1.0f + 1e-7f * static_cast<float>(i));
  const auto start = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < iters; ++k)
    for (int i = 0; i < 16; ++i) acc[i] = acc[i] * mul + add;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sum = 0.0f;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) sum += acc[i][j];
  volatile float sink = sum;  // keeps the loop
  (void)sink;
  return seconds;
}
}  // namespace

// Diagnostics: the floating-point rate of two threads running at once over one thread's
// alone (the median of `rounds` pairs of timings of `iters` steps): about 2 on two cores,
// about 1 when a VM's two vCPUs are SMT siblings of one core (on the 2-core Zen 4 EPYC VM
// that placement comes and goes too, and halves what compute-bound work gets from two
// threads: a 32-token float32 prefill took 74 ms instead of 46).
extern "C" double jaxserve_cpu_pair_flops_ratio(int64_t iters, int64_t rounds) {
  std::vector<double> ratios;
  for (int64_t r = 0; r < rounds; ++r) {
    const double alone = FloatLoopSeconds(iters);
    std::atomic<int> ready{0};
    double other_seconds = 0.0;
    std::thread other([&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      other_seconds = FloatLoopSeconds(iters);
    });
    ready.fetch_add(1);
    while (ready.load() < 2) {
    }
    const double mine = FloatLoopSeconds(iters);
    other.join();
    ratios.push_back(alone / mine + alone / other_seconds);
  }
  std::sort(ratios.begin(), ratios.end());
  return ratios.empty() ? 0.0 : ratios[ratios.size() / 2];
}
