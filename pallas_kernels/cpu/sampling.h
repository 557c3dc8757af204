// Sampling's top-k / top-p cut per row (jaxserve/engine/sampler.py, filter_logits): the
// value below which a row's tokens are masked, found without sorting the row. XLA:CPU
// sorts with a call of the comparator per comparison: top-p over 64 rows of a 49k
// vocabulary took it 674 ms, one row 11 ms (a 2-core Xeon).
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "common.h"

namespace jaxserve {
namespace {

struct Weighted {
  float value;
  float weight;  // exp(value - the row's maximum)
};

// What sorting the row in descending order gives (sampler.filter_logits): the larger of
// its k-th value and the value of its last token whose mass before it, in the top k
// renormalised, is below top_p (the first whose mass up to and with it reaches top_p).
// The k-th value by nth_element; that token by a quickselect on mass: partition the top k
// around a pivot value, and go on in the part holding the token (expected O(k)). Masses
// summed in double. `buf` and `items`: scratch.
inline float TopKTopPCut(const float* row, int64_t v, int32_t top_k, float top_p,
                         std::vector<float>& buf, std::vector<Weighted>& items) {
  const int64_t k = (top_k > 0 && top_k < v) ? top_k : v;
  buf.assign(row, row + v);
  std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<float>());
  const float kth = buf[k - 1];  // buf[0, k): the top k, unordered
  if (!(top_p < 1.0f)) return kth;
  const float top = *std::max_element(buf.begin(), buf.begin() + k);
  items.resize(k);
  double z = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    items[i] = {buf[i], std::exp(buf[i] - top)};
    z += items[i].weight;
  }
  const double target = double(top_p) * z;
  double above = 0.0;  // the mass of the tokens above [lo, hi): below target throughout
  auto lo = items.begin(), hi = items.begin() + k;
  auto mass = [](auto first, auto last) {
    double m = 0.0;
    for (; first != last; ++first) m += first->weight;
    return m;
  };
  while (lo != hi) {
    const float a = lo->value, b = (lo + (hi - lo) / 2)->value, c = (hi - 1)->value;
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
    auto gt = std::partition(lo, hi, [&](const Weighted& x) { return x.value > pivot; });
    auto eq = std::partition(gt, hi, [&](const Weighted& x) { return x.value == pivot; });
    const double m_gt = mass(lo, gt);
    if (above + m_gt >= target) {  // the token is above the pivot (gt < hi: eq is not empty)
      hi = gt;
      continue;
    }
    above += m_gt;
    const double m_eq = mass(gt, eq);
    if (above + m_eq >= target) return std::max(kth, pivot);
    above += m_eq;
    lo = eq;
  }
  return kth;  // the masses fell short of top_p by rounding: the top k kept
}

// cut[r] for each row r of logits [S, V] (float32), its top_k (0: off) and top_p.
inline void TopKTopPCuts(const Runner& run, const float* logits, int64_t s, int64_t v,
                         const int32_t* top_k, const float* top_p, float* cut) {
  run.For(s, [&](int64_t r) {
    thread_local std::vector<float> buf;
    thread_local std::vector<Weighted> items;
    cut[r] = TopKTopPCut(logits + r * v, v, top_k[r], top_p[r], buf, items);
  });
}

}  // namespace
}  // namespace jaxserve
