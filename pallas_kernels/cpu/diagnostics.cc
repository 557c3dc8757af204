// Diagnostics for the benchmarks, a library of their own (not in the serving build): where
// a VM's vCPUs sit, read from how fast a cache line travels between two threads and how
// two threads' floating-point rate compares with one's. pallas_kernels/cpu/__init__.py
// builds it on first use.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

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
// alone (`rounds` pairs of timings of `iters` steps): about 2 on two cores, about 1 when a
// VM's two vCPUs are SMT siblings of one core (on the 2-core Zen 4 EPYC VM that placement
// comes and goes too, and halves what compute-bound work gets from two threads: a 32-token
// float32 prefill took 74 ms instead of 46). A timeslice lost to another process only
// lengthens a timing, so one thread alone is the shortest of rounds + 1 timings (one before
// each pair, one after the last), and the answer is the largest pair's ratio to it: a
// lengthened alone reads the ratio high (a parallel test run once read 5.6 from a median
// of rounds that each took the shorter of two), a lengthened pair reads it low.
extern "C" double jaxserve_cpu_pair_flops_ratio(int64_t iters, int64_t rounds) {
  double alone = FloatLoopSeconds(iters);
  std::vector<std::pair<double, double>> pairs;
  for (int64_t r = 0; r < rounds; ++r) {
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
    pairs.emplace_back(mine, other_seconds);
    alone = std::min(alone, FloatLoopSeconds(iters));
  }
  double best = 0.0;
  for (const auto& [mine, other_seconds] : pairs)
    best = std::max(best, alone / mine + alone / other_seconds);
  return best;
}
