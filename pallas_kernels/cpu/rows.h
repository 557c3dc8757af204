// Row-wise ops on the real rows (jaxserve_rms_norm, jaxserve_gated_act, jaxserve_rope,
// pallas_kernels/rows.py).

#pragma once

#include "common.h"
#include "simd.h"

namespace jaxserve {
namespace {

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


}  // namespace
}  // namespace jaxserve
