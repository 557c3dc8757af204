// Vector helpers more than one kernel uses: AVX-512 (16 lanes) and AVX2 (8 lanes) loads,
// reductions, masks, conversions, transposes and e^x.

#pragma once

#include "common.h"

namespace jaxserve {
namespace {

#if JS_X86
// ---------------------------------------------------------------- AVX-512

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

// e^x for x <= 0 (the attention's softmax, the sampler's weights): 2^n * e^r,
// |r| <= ln2/2, degree-7 Taylor polynomial (truncation < 6e-9 relative), vscalefps for
// 2^n. Inputs below -100 give ~0.
JS_AVX512 JS_INLINE __m512 Exp16(__m512 x) {
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

// ---------------------------------------------------------------- AVX2

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
#endif  // JS_X86

}  // namespace
}  // namespace jaxserve
