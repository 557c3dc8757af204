// Sampling's top-k / top-p cut per row (jaxserve/engine/sampler.py, filter_cut): the
// value of the row's logits / temp below which its tokens are masked, found without
// sorting the row. XLA:CPU sorts with a call of the comparator per comparison: top-p
// over 64 rows of a 49k vocabulary took it 674 ms, one row 11 ms (a 2-core Xeon). Each
// logit is scaled as it is read, times 1 / temp, which is how XLA computes
// x / temp[:, None] (the same values, and no scaled copy of the logits written: that
// took 1.9 ms of a 64 x 49152 top-p draw).
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>
#include <vector>

#include "common.h"
#include "rows.h"  // ExpF32
#include "simd.h"  // Exp8, Avx2Load8

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
// How far below top the last bin starts.
constexpr float kBinLast = kBinRange * (1.0f - 1.0f / kBins);

JS_INLINE int BinOf(float x, float top) {
  const float d = top - x;
  return static_cast<int>((d < kBinLast ? d : kBinLast) * kBinScale);  // NaN: the last bin
}

// The row's maximum and minimum; each token's bin (BinOf of x * inv, inv = 1 / temp)
// into bin and, with kWeights, its weight exp(x * inv - top) into w (0 for a weight under
// e^-87, -inf's included): the baseline's loops, and AVX2's (eight tokens a step, Exp8).
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

template <bool kWeights>
JS_INLINE void GenericBins(const float* x, int64_t v, float inv, float top, uint16_t* bin,
                           float* w) {
  for (int64_t i = 0; i < v; ++i) {
    const float q = x[i] * inv;
    bin[i] = static_cast<uint16_t>(BinOf(q, top));
    if constexpr (kWeights) {
      const float d = q - top;
      w[i] = d >= -87.0f ? ExpF32(d) : 0.0f;  // NaN: 0
    }
  }
}

void ScalarMaxMin(const float* x, int64_t v, float* top, float* low) {
  GenericMaxMin(x, v, top, low);
}
template <bool kWeights>
void ScalarBins(const float* x, int64_t v, float inv, float top, uint16_t* bin, float* w) {
  GenericBins<kWeights>(x, v, inv, top, bin, w);
}
#if JS_X86
JS_AVX2 void Avx2MaxMin(const float* x, int64_t v, float* top, float* low) {
  GenericMaxMin(x, v, top, low);
}
// (GCC 12 leaves GenericBins' loop scalar, with or without the weights.)
template <bool kWeights>
JS_AVX2 void Avx2Bins(const float* x, int64_t v, float inv, float top, uint16_t* bin,
                      float* w) {
  const __m256 t = _mm256_set1_ps(top), floor = _mm256_set1_ps(-87.0f);
  const __m256 scale_x = _mm256_set1_ps(inv);
  const __m256 last = _mm256_set1_ps(kBinLast), scale = _mm256_set1_ps(kBinScale);
  const int64_t v8 = v / 8 * 8;
  for (int64_t i = 0; i < v8; i += 8) {
    const __m256 xi = _mm256_mul_ps(_mm256_loadu_ps(x + i), scale_x);
    // min_ps(a, b) is a < b ? a : b: a NaN's to the last bin, as BinOf.
    const __m256i b = _mm256_cvttps_epi32(
        _mm256_mul_ps(_mm256_min_ps(_mm256_sub_ps(t, xi), last), scale));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bin + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    if constexpr (kWeights) {  // d >= -87 (false for NaN): the weight, else 0
      const __m256 d = _mm256_sub_ps(xi, t);
      _mm256_storeu_ps(w + i, _mm256_and_ps(_mm256_cmp_ps(d, floor, _CMP_GE_OQ), Exp8(d)));
    }
  }
  GenericBins<kWeights>(x + v8, v - v8, inv, top, bin + v8, kWeights ? w + v8 : nullptr);
}
#endif

struct CutScratch {
  std::vector<float> buf;  // the row's weights, or (top-k) its top k first
  std::vector<float> boundary;  // (top-k) the values in the k-th largest's bin
  std::vector<uint16_t> bin;  // each token's bin
  std::vector<double> bins;  // each bin's mass
  std::vector<int32_t> counts;  // (top-k) each bin's tokens
  std::vector<Weighted> items;
};

// The maximum and minimum of the row * inv, and each token's bin into s.bin (with
// kWeights, its weight into s.buf). False when top_p is 1 (off): the minimum is all a
// top-p cut needs. (x * inv, inv > 0, keeps the order of x, rounded too: the extremes
// are those of the row, scaled.)
template <bool kWeights>
inline bool RowBins(const float* row, int64_t v, float inv, float top_p, CutScratch& s,
                    int isa, float* top, float* low) {
  s.bin.resize(v);
  if constexpr (kWeights) s.buf.resize(v);
  float* w = kWeights ? s.buf.data() : nullptr;
#if JS_X86
  if (isa >= kAvx2) {
    Avx2MaxMin(row, v, top, low);
    *top *= inv, *low *= inv;
    if (kWeights && !(top_p < 1.0f)) return false;
    Avx2Bins<kWeights>(row, v, inv, *top, s.bin.data(), w);
    return true;
  }
#endif
  (void)isa;
  ScalarMaxMin(row, v, top, low);
  *top *= inv, *low *= inv;
  if (kWeights && !(top_p < 1.0f)) return false;
  ScalarBins<kWeights>(row, v, inv, *top, s.bin.data(), w);
  return true;
}

// Bin b's tokens (NaNs left out) as (x * inv, weight) into items: AVX2 compares 16 bins
// at a time (the scalar loop was ~40% of TopPCut's own time over 49k tokens).
JS_INLINE void GenericCollectBin(const float* row, const uint16_t* bin, const float* w,
                                 int64_t first, int64_t v, int b, float inv,
                                 std::vector<Weighted>& items) {
  for (int64_t i = first; i < v; ++i)
    if (bin[i] == b && row[i] == row[i]) items.push_back({row[i] * inv, w[i]});
}

#if JS_X86
JS_AVX2 void Avx2CollectBin(const float* row, const uint16_t* bin, const float* w, int64_t v,
                            int b, float inv, std::vector<Weighted>& items) {
  const __m256i key = _mm256_set1_epi16(static_cast<int16_t>(b));
  int64_t i = 0;
  for (; i + 16 <= v; i += 16) {
    uint32_t m = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bin + i)), key)));
    for (; m; m &= m - 1, m &= m - 1) {  // two mask bits a token
      const int64_t j = i + __builtin_ctz(m) / 2;
      if (row[j] == row[j]) items.push_back({row[j] * inv, w[j]});
    }
  }
  GenericCollectBin(row, bin, w, i, v, b, inv, items);
}
#endif

inline void CollectBin(const float* row, const uint16_t* bin, const float* w, int64_t v, int b,
                       float inv, std::vector<Weighted>& items, int isa) {
  items.clear();
#if JS_X86
  if (isa >= kAvx2) return Avx2CollectBin(row, bin, w, v, b, inv, items);
#endif
  (void)isa;
  GenericCollectBin(row, bin, w, 0, v, b, inv, items);
}

// Each bin's mass into s.bins[0, kBins). Past kSplitBins tokens in four tables (token i
// into table i % 4), added up after: in one, each token's read-add-write of its bin
// waited on the one before it (~half of TopPCut's own time over 49k tokens).
constexpr int64_t kSplitBins = 16384;

inline void BinMasses(const uint16_t* bin, const float* w, int64_t v, std::vector<double>& out) {
  if (v < kSplitBins) {
    out.assign(kBins, 0.0);
    double* bins = out.data();
    for (int64_t i = 0; i < v; ++i) bins[bin[i]] += w[i];
    return;
  }
  out.assign(4 * kBins, 0.0);
  double* t = out.data();
  int64_t i = 0;
  for (; i + 4 <= v; i += 4)
    JS_UNROLL for (int l = 0; l < 4; ++l) t[l * kBins + bin[i + l]] += w[i + l];
  for (; i < v; ++i) t[bin[i]] += w[i];
  for (int b = 0; b < kBins; ++b)
    t[b] = (t[b] + t[kBins + b]) + (t[2 * kBins + b] + t[3 * kBins + b]);
}

// A row's top-p cut without top-k (see kBins): the larger of its minimum and its nucleus's
// last value.
inline float TopPCut(const float* row, int64_t v, float inv, float top_p, CutScratch& s,
                     int isa) {
  float top, low;
  if (!RowBins<true>(row, v, inv, top_p, s, isa, &top, &low)) return low;
  if (!std::isfinite(top)) return low;  // no finite maximum to weigh the row by
  const uint16_t* bin = s.bin.data();
  const float* w = s.buf.data();
  BinMasses(bin, w, v, s.bins);
  const double* bins = s.bins.data();
  // The bins' masses summed in groups of kGroup (four chains each: one chain through all
  // 4096 took longer than the rest of a 2048-token row), the groups in order.
  constexpr int kGroup = 64;
  double group[kBins / kGroup];
  double z = 0.0;
  for (int g = 0; g < kBins / kGroup; ++g) {
    double a[4] = {0.0, 0.0, 0.0, 0.0};
    for (int i = g * kGroup; i < (g + 1) * kGroup; i += 4)
      for (int l = 0; l < 4; ++l) a[l] += bins[i + l];
    group[g] = (a[0] + a[1]) + (a[2] + a[3]);
    z += group[g];
  }
  const double target = double(top_p) * z;
  double above = 0.0;  // the mass of the groups, then the bins, before b: below target
  int g = 0;
  while (g < kBins / kGroup && above + group[g] < target) above += group[g++];
  int b = g * kGroup;
  while (b < kBins && above + bins[b] < target) above += bins[b++];
  for (; b < kBins; ++b) {  // the token's bin (the next ones if its sums fall short)
    CollectBin(row, bin, w, v, b, inv, s.items, isa);
    float cut;
    if (NucleusCut(s.items.data(), s.items.data() + s.items.size(), target, above, cut))
      return std::max(low, cut);
  }
  return low;  // the masses fell short of top_p by rounding: every token kept
}

// What sorting the row in descending order gives (sampler.top_k_top_p_by_sort): the
// larger of its k-th value and the value of its last token whose mass before it, in the
// top k renormalised, is below top_p (the first whose mass up to and with it reaches
// top_p). The top k from the bins (kBins) counted: the tokens of the bins before the
// k-th largest's, then nth_element over that bin's (the whole row when it is the last
// bin); then NucleusCut over them.
inline float TopKTopPCut(const float* row, int64_t v, float inv, int32_t top_k, float top_p,
                         CutScratch& s, int isa) {
  if (!(top_k > 0 && top_k < v)) return TopPCut(row, v, inv, top_p, s, isa);
  const int64_t k = top_k;
  float top, low;
  RowBins<false>(row, v, inv, top_p, s, isa, &top, &low);
  const uint16_t* bin = s.bin.data();
  s.counts.assign(kBins, 0);
  for (int64_t i = 0; i < v; ++i) ++s.counts[bin[i]];
  int64_t before = 0;  // the tokens in the bins before b: fewer than k
  int b = 0;
  while (before + s.counts[b] < k) before += s.counts[b++];
  std::vector<float>& buf = s.buf;
  buf.clear();
  s.boundary.clear();
  for (int64_t i = 0; i < v; ++i) {
    if (bin[i] < b) buf.push_back(row[i] * inv);
    else if (bin[i] == b) s.boundary.push_back(row[i] * inv);
  }
  buf.insert(buf.end(), s.boundary.begin(), s.boundary.end());
  std::nth_element(buf.begin() + before, buf.begin() + (k - 1), buf.end(),
                   std::greater<float>());
  const float kth = buf[k - 1];  // buf[0, k): the top k, unordered
  if (!(top_p < 1.0f)) return kth;
  top = *std::max_element(buf.begin(), buf.begin() + k);
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

// cut[r] for each row r of logits [S, V] (float32) / its temp, its top_k (0: off) and
// top_p.
inline void TopKTopPCuts(const Runner& run, const float* logits, int64_t s, int64_t v,
                         const float* temp, const int32_t* top_k, const float* top_p,
                         float* cut) {
  const int isa = CurrentIsa();
  run.For(s, [&](int64_t r) {
    thread_local CutScratch scratch;
    cut[r] = TopKTopPCut(logits + r * v, v, 1.0f / temp[r], top_k[r], top_p[r], scratch, isa);
  });
}

// Greedy decoding's pick (jaxserve/engine/sampler.py, first_argmax): the first index of
// each row's maximum, NaN above every number (np.argmax's order). XLA:CPU's two-level
// argmax took 16-20% of a tiny model's whole decode step at 64-256 rows (2-core Xeon).
// Two passes over a row, the second over what the first just read: its maximum and
// whether it holds a NaN, then the first 16 (8) tokens holding the maximum.
template <typename T>
JS_INLINE float LoadLogit(const T* x, int64_t i) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return Bf16ToF32(x[i]);
  } else {
    return x[i];
  }
}

template <typename T>
JS_INLINE int32_t FirstNan(const T* x, int64_t v) {
  for (int64_t i = 0; i < v; ++i)
    if (LoadLogit(x, i) != LoadLogit(x, i)) return static_cast<int32_t>(i);
  return 0;
}

template <typename T>
int32_t ScalarArgmax(const T* x, int64_t v) {
  float top = LoadLogit(x, 0);
  bool nan = false;
  for (int64_t i = 0; i < v; ++i) {
    const float y = LoadLogit(x, i);
    top = y > top ? y : top;
    nan |= y != y;
  }
  if (nan) return FirstNan(x, v);
  for (int64_t i = 0; i < v; ++i)
    if (LoadLogit(x, i) == top) return static_cast<int32_t>(i);
  return 0;  // not reached: the maximum is one of the row's tokens
}

#if JS_X86
// 16 logits from p (those past n read as -inf), float32 or bf16.
template <typename T>
JS_AVX512 JS_INLINE __m512 LoadLogits16(const T* p, int64_t n) {
  const __mmask16 m = Mask16(n);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  if constexpr (std::is_same_v<T, uint16_t>) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    const __m512 y = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_mask_blend_ps(m, ninf, y);
  } else {
    return _mm512_mask_loadu_ps(ninf, m, p);
  }
}

template <typename T>
JS_AVX512 int32_t Avx512Argmax(const T* x, int64_t v) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 hi[4] = {ninf, ninf, ninf, ninf};
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 64 <= v; i += 64)
    JS_UNROLL for (int u = 0; u < 4; ++u) {
      const __m512 y = LoadLogits16(x + i + 16 * u, 16);
      hi[u] = _mm512_max_ps(y, hi[u]);  // a NaN y leaves hi as it was
      nan |= _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
    }
  for (; i < v; i += 16) {
    const __m512 y = LoadLogits16(x + i, v - i);
    hi[0] = _mm512_max_ps(y, hi[0]);
    nan |= _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
  }
  if (nan) return FirstNan(x, v);
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(
      _mm512_max_ps(_mm512_max_ps(hi[0], hi[1]), _mm512_max_ps(hi[2], hi[3]))));
  // Lanes past v read -inf: never before the row's first maximum, which is a real token.
  for (i = 0; i < v; i += 16) {
    const __mmask16 m = _mm512_cmp_ps_mask(LoadLogits16(x + i, v - i), top, _CMP_EQ_OQ);
    if (m) return static_cast<int32_t>(i + __builtin_ctz(m));
  }
  return 0;
}

template <typename T>
JS_AVX2 int32_t Avx2Argmax(const T* x, int64_t v) {
  __m256 hi[4], nan = _mm256_setzero_ps();
  JS_UNROLL for (int u = 0; u < 4; ++u) hi[u] = _mm256_set1_ps(-INFINITY);
  const int64_t v8 = v / 8 * 8;
  int64_t i = 0;
  for (; i + 32 <= v8; i += 32)
    JS_UNROLL for (int u = 0; u < 4; ++u) {
      const __m256 y = Avx2Load8(x + i + 8 * u);
      hi[u] = _mm256_max_ps(y, hi[u]);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    }
  for (; i < v8; i += 8) {
    const __m256 y = Avx2Load8(x + i);
    hi[0] = _mm256_max_ps(y, hi[0]);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(hi[0], hi[1]),
                                       _mm256_max_ps(hi[2], hi[3])));
  float top = -INFINITY;
  for (float y : lanes) top = y > top ? y : top;
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < v; ++i) {
    const float y = LoadLogit(x, i);
    top = y > top ? y : top;
    has_nan |= y != y;
  }
  if (has_nan) return FirstNan(x, v);
  const __m256 t = _mm256_set1_ps(top);
  for (i = 0; i < v8; i += 8) {
    const int m = _mm256_movemask_ps(_mm256_cmp_ps(Avx2Load8(x + i), t, _CMP_EQ_OQ));
    if (m) return static_cast<int32_t>(i + __builtin_ctz(m));
  }
  for (; i < v; ++i)
    if (LoadLogit(x, i) == top) return static_cast<int32_t>(i);
  return 0;
}
#endif

// out[r] = the argmax of row r of logits [S, V] (float32, or bf16 as uint16_t), rows split
// over the threads in runs of at least 1M tokens: below that one thread takes well under
// 0.1 ms, and a helper spinning after its share took the core the host's next step needed
// (tiny model, 256 x 2048 on 2 threads: the compiled step 2.2 ms against 2.45, the whole
// step 2.51 against 2.42; 2-core Xeon).
template <typename T>
inline void ArgmaxRows(const Runner& run, const T* logits, int64_t s, int64_t v, int32_t* out) {
  if (s <= 0) return;
  const int isa = CurrentIsa();
  const int64_t tasks = std::clamp<int64_t>(s * v / (1 << 20), 1, std::min(s, run.threads()));
  run.For(tasks, [&](int64_t t) {
    for (int64_t r = s * t / tasks; r < s * (t + 1) / tasks; ++r) {
      const T* row = logits + r * v;
#if JS_X86
      if (isa >= kAvx512) {
        out[r] = Avx512Argmax(row, v);
        continue;
      }
      if (isa >= kAvx2) {
        out[r] = Avx2Argmax(row, v);
        continue;
      }
#endif
      (void)isa;
      out[r] = ScalarArgmax(row, v);
    }
  });
}

// A sampled row's draw (jaxserve/engine/sampler.py, draw_from): the first token whose
// cumulative weight reaches u * the row's total weight, where token i weighs
// exp(q_i - top) if q_i = x_i / temp >= cut (and that exponent >= -87), else 0 (the
// sampler's Weights; q_i as XLA computes it, x_i times 1 / temp, as the cut's); never a
// token of weight 0. One pass sums the weights block by block (kDrawBlock tokens), the
// blocks' sums then find the token's block, whose weights are made again and scanned.
// XLA:CPU's two-level draw (sampler._inverse_cdf_in_blocks) took 1.6-1.8 ms over
// 64 x 49152, this 0.8 (AVX-512) or 1.2 (AVX2) on a 2-core Xeon.
constexpr int64_t kDrawBlock = 256;

// Weights of x[0, n) (n <= kDrawBlock) into w; returns their sum.
JS_INLINE float GenericDrawWeights(const float* x, int64_t n, float inv, float top, float cut,
                                   float* w) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float q = x[i] * inv, d = q - top;
    w[i] = q >= cut && d >= -87.0f ? ExpF32(d) : 0.0f;  // NaN: 0
    sum += w[i];
  }
  return sum;
}

float ScalarDrawWeights(const float* x, int64_t n, float inv, float top, float cut,
                        float* w) {
  return GenericDrawWeights(x, n, inv, top, cut, w);
}

#if JS_X86
JS_AVX2 float Avx2DrawWeights(const float* x, int64_t n, float inv, float top, float cut,
                              float* w) {
  const __m256 t = _mm256_set1_ps(inv), tp = _mm256_set1_ps(top), c = _mm256_set1_ps(cut);
  const __m256 floor = _mm256_set1_ps(-87.0f);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const int64_t n8 = n / 8 * 8;
  int64_t i = 0;
  for (; i < n8; i += 8) {
    const __m256 q = _mm256_mul_ps(_mm256_loadu_ps(x + i), t), d = _mm256_sub_ps(q, tp);
    const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(q, c, _CMP_GE_OQ),
                                      _mm256_cmp_ps(d, floor, _CMP_GE_OQ));
    const __m256 wi = _mm256_and_ps(keep, Exp8(d));
    _mm256_storeu_ps(w + i, wi);
    acc[(i / 8) & 1] = _mm256_add_ps(acc[(i / 8) & 1], wi);
  }
  return Avx2Sum(_mm256_add_ps(acc[0], acc[1])) +
         GenericDrawWeights(x + n8, n - n8, inv, top, cut, w + n8);
}

JS_AVX512 float Avx512DrawWeights(const float* x, int64_t n, float inv, float top, float cut,
                                  float* w) {
  const __m512 t = _mm512_set1_ps(inv), tp = _mm512_set1_ps(top), c = _mm512_set1_ps(cut);
  const __m512 floor = _mm512_set1_ps(-87.0f);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i = 0; i < n; i += 16) {  // lanes past n: weight 0, not stored
    const __mmask16 m = Mask16(n - i);
    const __m512 q = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), t);
    const __m512 d = _mm512_sub_ps(q, tp);
    const __mmask16 keep = m & _mm512_cmp_ps_mask(q, c, _CMP_GE_OQ) &
                           _mm512_cmp_ps_mask(d, floor, _CMP_GE_OQ);
    const __m512 wi = _mm512_maskz_mov_ps(keep, Exp16(d));
    _mm512_mask_storeu_ps(w + i, m, wi);
    acc[(i / 16) & 1] = _mm512_add_ps(acc[(i / 16) & 1], wi);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}
#endif

JS_INLINE float DrawWeights(const float* x, int64_t n, float inv, float top, float cut,
                            float* w, int isa) {
#if JS_X86
  if (isa >= kAvx512) return Avx512DrawWeights(x, n, inv, top, cut, w);
  if (isa >= kAvx2) return Avx2DrawWeights(x, n, inv, top, cut, w);
#endif
  (void)isa;
  return ScalarDrawWeights(x, n, inv, top, cut, w);
}

// A row's draw; 0 when no token has weight (a row without a finite maximum).
inline int32_t DrawRow(const float* x, int64_t v, float inv, float top, float cut, float u,
                       std::vector<float>& sums, int isa) {
  const int64_t blocks = (v + kDrawBlock - 1) / kDrawBlock;
  sums.resize(blocks);
  alignas(32) float w[kDrawBlock];
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    sums[b] = DrawWeights(x + b * kDrawBlock, std::min(kDrawBlock, v - b * kDrawBlock), inv,
                          top, cut, w, isa);
    total += sums[b];
  }
  if (!(total > 0.0)) return 0;
  const double target = double(u) * total;
  // The first block whose cumulative sum reaches target (it has weight: target > 0); if
  // rounding leaves them all short, the last block of weight.
  int64_t block = -1;
  double before = 0.0, before_block = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (sums[b] > 0.0f) {
      block = b, before_block = before;
      if (before + sums[b] >= target) break;
    }
    before += sums[b];
  }
  const int64_t first = block * kDrawBlock, n = std::min(kDrawBlock, v - first);
  DrawWeights(x + first, n, inv, top, cut, w, isa);
  // Likewise in the block: the first token reaching target, else its last of weight.
  int64_t last = 0;
  double cum = before_block;
  for (int64_t i = 0; i < n; ++i) {
    if (w[i] > 0.0f) {
      last = i;
      cum += w[i];
      if (cum >= target) break;
    }
  }
  return static_cast<int32_t>(first + last);
}

// out[r] = the draw of row r of logits [S, V] (float32) with its temp, top, cut and u;
// rows split over the threads in runs of at least 1M tokens (as ArgmaxRows).
inline void DrawRows(const Runner& run, const float* logits, int64_t s, int64_t v,
                     const float* temp, const float* top, const float* cut, const float* u,
                     int32_t* out) {
  if (s <= 0) return;
  const int isa = CurrentIsa();
  const int64_t tasks = std::clamp<int64_t>(s * v / (1 << 20), 1, std::min(s, run.threads()));
  run.For(tasks, [&](int64_t t) {
    thread_local std::vector<float> sums;
    for (int64_t r = s * t / tasks; r < s * (t + 1) / tasks; ++r)
      out[r] = DrawRow(logits + r * v, v, 1.0f / temp[r], top[r], cut[r], u[r], sums, isa);
  });
}

}  // namespace
}  // namespace jaxserve
