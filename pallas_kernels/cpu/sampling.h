// Sampling's top-k / top-p cut per row (jaxserve/engine/sampler.py, filter_cut): the
// value below which a row's tokens are masked, found without sorting the row. XLA:CPU
// sorts with a call of the comparator per comparison: top-p over 64 rows of a 49k
// vocabulary took it 674 ms, one row 11 ms (a 2-core Xeon).
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "common.h"
#include "rows.h"  // ExpF32

namespace jaxserve {
namespace {

struct Weighted {
  float value;
  float weight;  // exp(value - the row's maximum)
};

// The nucleus's last value among `items` [lo, hi), the mass of the tokens above them
// `above` (below `target`): the value of the token whose mass before it, in descending
// order, is below `target` and up to and with it reaches it. A quickselect on mass:
// partition around a pivot value, and go on in the part holding the token (expected
// O(hi - lo)). Masses summed in double. False when their masses fall short of `target`
// (by rounding, or it lies past them), `above` then holding theirs too.
inline bool NucleusCut(Weighted* lo, Weighted* hi, double target, double& above, float& cut) {
  auto mass = [](const Weighted* first, const Weighted* last) {
    double m = 0.0;
    for (; first != last; ++first) m += first->weight;
    return m;
  };
  while (lo != hi) {
    const float a = lo->value, b = (lo + (hi - lo) / 2)->value, c = (hi - 1)->value;
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
    Weighted* gt = std::partition(lo, hi, [&](const Weighted& x) { return x.value > pivot; });
    Weighted* eq = std::partition(gt, hi, [&](const Weighted& x) { return x.value == pivot; });
    const double m_gt = mass(lo, gt);
    if (above + m_gt >= target) {  // the token is above the pivot (gt < hi: eq is not empty)
      hi = gt;
      continue;
    }
    above += m_gt;
    const double m_eq = mass(gt, eq);
    if (above + m_eq >= target) {
      cut = pivot;
      return true;
    }
    above += m_eq;
    lo = eq;
  }
  return false;
}

// A row without top-k (k = V) bins its tokens by value below the row's maximum: bin b
// holds the values in (top - (b + 1) / kBinScale, top - b / kBinScale], the last one all
// below top - kBinRange (weights under e^-kBinRange each). One pass sums each bin's mass;
// the bins before the nucleus's last token are summed whole, and only that token's bin is
// searched (NucleusCut): a flat row's nucleus is most of the vocabulary.
constexpr int kBins = 4096;
constexpr float kBinRange = 32.0f;
constexpr float kBinScale = kBins / kBinRange;

JS_INLINE int BinOf(float x, float top) {
  constexpr float kLast = kBinRange * (1.0f - 1.0f / kBins);
  const float d = top - x;
  return static_cast<int>((d < kLast ? d : kLast) * kBinScale);  // NaN: the last bin
}

// The row's maximum and minimum, and each token's weight exp(x - top) (0 for a weight
// under e^-87, -inf's included), into w: loops the compiler vectorises (ExpF32 is
// branch-free), compiled for the baseline and for AVX2.
JS_INLINE void GenericMaxMin(const float* x, int64_t v, float* top, float* low) {
  float hi[16], lo[16];
  for (int l = 0; l < 16; ++l) hi[l] = lo[l] = x[0];
  const int64_t v16 = v / 16 * 16;
  for (int64_t i = 0; i < v16; i += 16)
    for (int l = 0; l < 16; ++l) {
      hi[l] = x[i + l] > hi[l] ? x[i + l] : hi[l];
      lo[l] = x[i + l] < lo[l] ? x[i + l] : lo[l];
    }
  for (int64_t i = v16; i < v; ++i) {
    hi[0] = x[i] > hi[0] ? x[i] : hi[0];
    lo[0] = x[i] < lo[0] ? x[i] : lo[0];
  }
  *top = hi[0], *low = lo[0];
  for (int l = 1; l < 16; ++l) {
    *top = hi[l] > *top ? hi[l] : *top;
    *low = lo[l] < *low ? lo[l] : *low;
  }
}

JS_INLINE void GenericWeights(const float* x, int64_t v, float top, float* w) {
  for (int64_t i = 0; i < v; ++i) {
    const float d = x[i] - top;
    w[i] = d >= -87.0f ? ExpF32(d) : 0.0f;  // NaN: 0
  }
}

void ScalarMaxMin(const float* x, int64_t v, float* top, float* low) {
  GenericMaxMin(x, v, top, low);
}
void ScalarWeights(const float* x, int64_t v, float top, float* w) {
  GenericWeights(x, v, top, w);
}
#if JS_X86
JS_AVX2 void Avx2MaxMin(const float* x, int64_t v, float* top, float* low) {
  GenericMaxMin(x, v, top, low);
}
JS_AVX2 void Avx2Weights(const float* x, int64_t v, float top, float* w) {
  GenericWeights(x, v, top, w);
}
#endif

struct CutScratch {
  std::vector<float> buf;  // the row (top-k: its top k first), or its weights
  std::vector<Weighted> items;
  std::vector<double> bins;
};

// A row's top-p cut without top-k (see kBins): the larger of its minimum and its nucleus's
// last value.
inline float TopPCut(const float* row, int64_t v, float top_p, CutScratch& s, int isa) {
  float top, low;
  std::vector<float>& w = s.buf;
  w.resize(v);
#if JS_X86
  if (isa >= kAvx2) {
    Avx2MaxMin(row, v, &top, &low);
    if (!(top_p < 1.0f)) return low;
    Avx2Weights(row, v, top, w.data());
  } else
#endif
  {
    (void)isa;
    ScalarMaxMin(row, v, &top, &low);
    if (!(top_p < 1.0f)) return low;
    ScalarWeights(row, v, top, w.data());
  }
  if (!std::isfinite(top)) return low;  // no finite maximum to weigh the row by
  s.bins.assign(kBins, 0.0);
  for (int64_t i = 0; i < v; ++i) s.bins[BinOf(row[i], top)] += w[i];
  double z = 0.0;
  for (double m : s.bins) z += m;
  const double target = double(top_p) * z;
  double above = 0.0;  // the mass of the bins before b: below target
  int b = 0;
  while (b < kBins && above + s.bins[b] < target) above += s.bins[b++];
  for (; b < kBins; ++b) {  // the token's bin (the next ones if its sums fall short)
    s.items.clear();
    for (int64_t i = 0; i < v; ++i)
      if (BinOf(row[i], top) == b && row[i] == row[i]) s.items.push_back({row[i], w[i]});
    float cut;
    if (NucleusCut(s.items.data(), s.items.data() + s.items.size(), target, above, cut))
      return std::max(low, cut);
  }
  return low;  // the masses fell short of top_p by rounding: every token kept
}

// What sorting the row in descending order gives (sampler.top_k_top_p_by_sort): the
// larger of its k-th value and the value of its last token whose mass before it, in the
// top k renormalised, is below top_p (the first whose mass up to and with it reaches
// top_p). The k-th value by nth_element, then NucleusCut over the top k.
inline float TopKTopPCut(const float* row, int64_t v, int32_t top_k, float top_p,
                         CutScratch& s, int isa) {
  if (!(top_k > 0 && top_k < v)) return TopPCut(row, v, top_p, s, isa);
  const int64_t k = top_k;
  std::vector<float>& buf = s.buf;
  buf.assign(row, row + v);
  std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<float>());
  const float kth = buf[k - 1];  // buf[0, k): the top k, unordered
  if (!(top_p < 1.0f)) return kth;
  const float top = *std::max_element(buf.begin(), buf.begin() + k);
  s.items.resize(k);
  double z = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    s.items[i] = {buf[i], std::exp(buf[i] - top)};
    z += s.items[i].weight;
  }
  double above = 0.0;
  float cut;
  if (NucleusCut(s.items.data(), s.items.data() + k, double(top_p) * z, above, cut))
    return std::max(kth, cut);
  return kth;  // the masses fell short of top_p by rounding: the top k kept
}

// cut[r] for each row r of logits [S, V] (float32), its top_k (0: off) and top_p.
inline void TopKTopPCuts(const Runner& run, const float* logits, int64_t s, int64_t v,
                         const int32_t* top_k, const float* top_p, float* cut) {
  const int isa = CurrentIsa();
  run.For(s, [&](int64_t r) {
    thread_local CutScratch scratch;
    cut[r] = TopKTopPCut(logits + r * v, v, top_k[r], top_p[r], scratch, isa);
  });
}

}  // namespace
}  // namespace jaxserve
