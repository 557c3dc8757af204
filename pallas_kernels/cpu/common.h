// What every native CPU kernel shares: the includes, the instruction-set levels and the
// attributes that compile a function for one, scalar conversions, and the threads a call
// splits its work over (kernels.cc includes it first).
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

#pragma once

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
#include <type_traits>
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


}  // namespace
}  // namespace jaxserve
