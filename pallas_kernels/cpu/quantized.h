// Weight-only quantized matmul for few rows (jaxserve_quantized_matmul): see its FFI handler
// in kernels.cc and pallas_kernels/quantized_matmul/cpu.py.
//
// y[m] = x[m] @ dequantize(W) for the real rows m < num_rows (decode, draft verification,
// prefill chunks in blocks of kQmmMaxRows rows). W is stored as
// pallas_kernels/quantized_matmul stores it:
// - int8: values int8 [K, N], groups of G rows (G = K: per channel);
// - int4: values uint8 [K/2, N], groups of G rows (byte row j of a group holds its row j in
//   the low nibble and row j + G/2 in the high one, two's complement);
// - fp4 (MXFP4): int4's layout, each nibble an e2m1 code (sign, 2 exponent bits, 1
//   mantissa bit), decoded through a table in registers (offset 0, no zero points);
// scales [K/G, N], or [2, K/G, N] with zero points z (w = (q - z) * scale). The values may
// be packed with their scales (Qmm::packed, quantized_matmul/formats.py's pack_strips, what
// the engine does on one CPU device): each strip of kQmmCols columns holds its K' byte
// rows (and its G' scale rows) one after another, so a tile reads sequential streams. Row-major, a tile's rows are N bytes
// apart, a line each, which the hardware prefetchers do not follow: one-row matmuls of
// 1B / 8B-class layers read 2.2-3.7 GB/s on a 2-core Xeon, packed 18-21 (AVX-512).
// Each task owns kQmmTaskCols output columns and reads their bytes of every K row once,
// in memory order, converting them to float32 in registers: the weight crosses memory
// quantized, which is the point on a bandwidth-bound CPU. One or two rows of x (the direct
// tiles) accumulate per group p = sum_k x[k] * u[k] over the stored integers u (for int4
// the nibbles made unsigned, u = q + 8, by flipping their top bits) and add
// (p - (offset + z) * sum_k x[k]) * scale, offset 8 for int4's nibbles and 0 for int8, so
// a zero point costs one multiply-add per group, not per weight. More rows dequantize a
// panel of the weight once in L1 and run every row of x over it (the panels below).
// x is float32 or bfloat16 (read as float32); y is rounded once to x's dtype.

#pragma once

#include "common.h"
#include "matmul.h"  // ToF32, FromF32

namespace jaxserve {
namespace {

constexpr int64_t kQmmMaxRows = 64;
constexpr int64_t kQmmDirectRows = 2;  // up to this many rows convert straight into FMAs
constexpr int64_t kQmmPanelRows = 128; // weight rows of a float panel (16 KiB: L1)
constexpr int64_t kQmmCols = 32;       // columns of a register tile (4 x 8 lanes)
constexpr int64_t kQmmTaskCols = 64;   // columns per task: one cache line of int8 per row
// A direct tile's software prefetch, ahead of its reads: row-major, 16 rows (a line each,
// N bytes apart); packed, 4 KiB of its strip (the best of 0.5 / 2 / 4 / 8 KiB on a 2-core
// Xeon, one-row int8 / int4 matmuls of 16-58 MB: 17.8 / 21.3 / 22.6 / 20.6 GB/s int8).
constexpr int64_t kQmmAheadRows = 16;
constexpr int64_t kQmmAheadBytes = 4096;

struct Qmm {
  const float* x;   // [m, k], float32 (converted once from bf16 when x is bf16)
  const float* sx;  // [m, groups]: each group's sum of x
  const void* w;    // int8 [k, n] or uint8 [k / 2, n]
  const void* s;    // [groups, n] float32, or bfloat16 (`s_bf16`: fp4's, read as stored)
  const float* z;   // [groups, n] zero points, or null
  void* y;          // [m_all, n] in x's dtype
  int64_t m, k, n, group;
  bool int4, bf16;
  bool packed;      // values in strips of kQmmCols columns (QmmColumn)
  bool fp4;         // int4's nibbles are e2m1 codes (int4 is set too)
  bool s_bf16;      // the scales are bfloat16 (widened as they are read)
};

// e2m1's 16 values by code, and what the integer paths add to a nibble before converting
// it (int4: ^ 8 makes two's complement q the unsigned u = q + 8, taken off per group).
alignas(64) constexpr float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
JS_INLINE float QmmOffset(const Qmm& q) { return q.int4 && !q.fp4 ? 8.0f : 0.0f; }
JS_INLINE char QmmFlip(const Qmm& q) { return static_cast<char>(q.fp4 ? 0 : 0x88); }

JS_INLINE int64_t QmmGroups(const Qmm& q) { return q.k / q.group; }

// Scale `at` of the plane, and 8 / 16 consecutive ones, as float32 (a bfloat16 one is the
// top half of its float32: widened by a shift, not converted in a pass of its own).
JS_INLINE float QmmScale(const Qmm& q, int64_t at) {
  return q.s_bf16 ? Bf16ToF32(static_cast<const uint16_t*>(q.s)[at])
                  : static_cast<const float*>(q.s)[at];
}

// Byte row 0 of column c (a multiple of kQmmCols for a packed weight) and the distance
// between byte rows: [K', N] row-major, or packed: strip c / kQmmCols's K' rows of
// kQmmCols bytes in a row, so that a tile's K' rows are one sequential stream.
JS_INLINE int64_t QmmByteRows(const Qmm& q) { return q.int4 ? q.k / 2 : q.k; }
JS_INLINE int64_t QmmStride(const Qmm& q) { return q.packed ? kQmmCols : q.n; }
JS_INLINE int64_t QmmAhead(const Qmm& q) {  // a direct tile's prefetch distance in bytes
  return q.packed ? kQmmAheadBytes : kQmmAheadRows * q.n;
}
// Where group g's scale (and zero point) of column c is in its plane: [G', N] row-major,
// or packed as the values are (a tile's scales one sequential stream).
JS_INLINE int64_t QmmScaleAt(const Qmm& q, int64_t g, int64_t c) {
  if (!q.packed) return g * q.n + c;
  return (c / kQmmCols) * QmmGroups(q) * kQmmCols + g * kQmmCols + c % kQmmCols;
}
template <typename B>
JS_INLINE const B* QmmColumn(const Qmm& q, int64_t c) {
  const B* w = static_cast<const B*>(q.w);
  if (!q.packed) return w + c;
  return w + (c / kQmmCols) * QmmByteRows(q) * kQmmCols + c % kQmmCols;
}

// The stored integer of row kk (within group g's rows) and column c, and its offset.
JS_INLINE float QmmValue(const Qmm& q, int64_t kk, int64_t c) {
  if (!q.int4) return static_cast<float>(QmmColumn<int8_t>(q, c)[kk * QmmStride(q)]);
  const int64_t g = kk / q.group, r = kk % q.group, half = q.group / 2;
  // Two's complement nibbles; ^ 8 makes each the unsigned u = q + 8 (fp4: as stored).
  const uint8_t b = QmmColumn<uint8_t>(q, c)[(g * half + r % half) * QmmStride(q)] ^
                    static_cast<uint8_t>(QmmFlip(q));
  const int u = r < half ? (b & 0xF) : (b >> 4);
  return q.fp4 ? kE2m1[u] : static_cast<float>(u);
}

template <typename T>
JS_INLINE void QmmStore(const Qmm& q, int64_t row, int64_t c0, const float* acc, int64_t nc) {
  T* y = static_cast<T*>(q.y) + row * q.n + c0;
  for (int64_t c = 0; c < nc; ++c) y[c] = FromF32<T>(acc[c]);
}

// Generic loops: any column count (the tail of N, and CPUs without AVX2).
template <typename T>
void GenericQmmCols(const Qmm& q, int64_t c0, int64_t nc) {
  const float offset = QmmOffset(q);
  for (int64_t m = 0; m < q.m; ++m) {
    float acc[kQmmTaskCols] = {};
    const float* x = q.x + m * q.k;
    for (int64_t g = 0; g < QmmGroups(q); ++g) {
      float part[kQmmTaskCols] = {};
      for (int64_t kk = g * q.group; kk < (g + 1) * q.group; ++kk)
        for (int64_t c = 0; c < nc; ++c) part[c] += x[kk] * QmmValue(q, kk, c0 + c);
      const float sum = q.sx[m * QmmGroups(q) + g];
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t at = QmmScaleAt(q, g, c0 + c);
        const float z = offset + (q.z ? q.z[at] : 0.0f);
        acc[c] += (part[c] - z * sum) * QmmScale(q, at);
      }
    }
    QmmStore<T>(q, m, c0, acc, nc);
  }
}

#if JS_X86
// ---------------------------------------------------------------- AVX2
JS_AVX2 JS_INLINE __m256 Avx2QmmScales(const Qmm& q, int64_t at) {
  if (!q.s_bf16) return _mm256_loadu_ps(static_cast<const float*>(q.s) + at);
  const __m128i h = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(q.s) + at));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// A tile: 2 rows of x by kQmmCols columns, 8 accumulators, the group's partial sums; the
// rows' running totals live in memory (one update per group).

// e2m1 codes (0-15 an int32 lane) as floats: the magnitude from the table's first 8 by
// the code's low 3 bits, the sign bit from its bit 3.
JS_AVX2 JS_INLINE __m256 E2m1Avx2(__m256i codes) {
  const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_load_ps(kE2m1), codes);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
  return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
}

// Low 8 bytes -> floats: as integers, or (fp4) as e2m1 codes.
JS_AVX2 JS_INLINE __m256 QmmCvt(__m128i bytes8, bool is_signed, bool fp4) {
  if (fp4) return E2m1Avx2(_mm256_cvtepu8_epi32(bytes8));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8)
                                      : _mm256_cvtepu8_epi32(bytes8));
}

// The 32 bytes' 4 groups of 8 as floats.
JS_AVX2 JS_INLINE void QmmWiden(__m256i v, bool is_signed, __m256* out, bool fp4 = false) {
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  out[0] = QmmCvt(lo, is_signed, fp4);
  out[1] = QmmCvt(_mm_srli_si128(lo, 8), is_signed, fp4);
  out[2] = QmmCvt(hi, is_signed, fp4);
  out[3] = QmmCvt(_mm_srli_si128(hi, 8), is_signed, fp4);
}

template <int R>
JS_AVX2 void Avx2QmmTile(const Qmm& q, int64_t m0, int64_t c0, float (*acc)[kQmmCols]) {
  const int64_t groups = QmmGroups(q), half = q.group / 2, ld = QmmStride(q);
  const int64_t ahead = QmmAhead(q);
  const __m256 offset = _mm256_set1_ps(QmmOffset(q));
  const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(QmmFlip(q));
  const float* x[R];
  JS_UNROLL for (int r = 0; r < R; ++r) x[r] = q.x + (m0 + r) * q.k;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 p[R][4];
    JS_UNROLL for (int r = 0; r < R; ++r)
      JS_UNROLL for (int c = 0; c < 4; ++c) p[r][c] = _mm256_setzero_ps();
    if (q.int4) {
      const uint8_t* w = QmmColumn<uint8_t>(q, c0) + g * half * ld;
      const int64_t k0 = g * q.group;
      for (int64_t j = 0; j < half; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(w + j * ld + ahead), _MM_HINT_T0);
        const __m256i v = _mm256_xor_si256(  // two's complement nibbles -> u = q + 8
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * ld)), flip);
        __m256 lo[4], hi[4];
        QmmWiden(_mm256_and_si256(v, nibble), false, lo, q.fp4);
        QmmWiden(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), false, hi, q.fp4);
        JS_UNROLL for (int r = 0; r < R; ++r) {
          const __m256 xl = _mm256_set1_ps(x[r][k0 + j]), xh = _mm256_set1_ps(x[r][k0 + half + j]);
          JS_UNROLL for (int c = 0; c < 4; ++c)
            p[r][c] = _mm256_fmadd_ps(xh, hi[c], _mm256_fmadd_ps(xl, lo[c], p[r][c]));
        }
      }
    } else {
      const int8_t* w = QmmColumn<int8_t>(q, c0) + g * q.group * ld;
      const int64_t k0 = g * q.group;
      for (int64_t kk = 0; kk < q.group; ++kk) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kk * ld + ahead), _MM_HINT_T0);
        __m256 wv[4];
        QmmWiden(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kk * ld)), true, wv);
        JS_UNROLL for (int r = 0; r < R; ++r) {
          const __m256 xb = _mm256_set1_ps(x[r][k0 + kk]);
          JS_UNROLL for (int c = 0; c < 4; ++c) p[r][c] = _mm256_fmadd_ps(xb, wv[c], p[r][c]);
        }
      }
    }
    JS_UNROLL for (int c = 0; c < 4; ++c) {
      const int64_t col = QmmScaleAt(q, g, c0 + 8 * c);  // 8 in a row, packed or not
      const __m256 s = Avx2QmmScales(q, col);
      const __m256 z = q.z ? _mm256_add_ps(offset, _mm256_loadu_ps(q.z + col)) : offset;
      JS_UNROLL for (int r = 0; r < R; ++r) {
        const __m256 sum = _mm256_set1_ps(q.sx[(m0 + r) * groups + g]);
        const __m256 part = _mm256_fnmadd_ps(z, sum, p[r][c]);
        _mm256_storeu_ps(acc[r] + 8 * c,
                         _mm256_fmadd_ps(part, s, _mm256_loadu_ps(acc[r] + 8 * c)));
      }
    }
  }
}

// More rows: each chunk of K (whole groups of up to kQmmPanelRows rows together, or
// kQmmPanelRows rows of a larger group) is dequantized once into a float32 panel in L1,
// w = u * scale - (offset + z) * scale, then every few rows of x run their FMAs over it,
// their sums running over all of K in memory between chunks: no per-group epilogue (at
// 32 rows of x and groups of 16 it cost two scalar operations a weight).
// A chunk's panel rows are one or two runs of consecutive K rows (int4's halves of a large
// group): (first panel row, rows, first K row).
struct QmmRun {
  int64_t at, rows, k;
};

JS_INLINE int64_t QmmChunks(const Qmm& q, int64_t panel_rows) {
  const int64_t groups = QmmGroups(q);
  if (q.group <= panel_rows) {
    const int64_t per = panel_rows / q.group;
    return (groups + per - 1) / per;
  }
  const int64_t span = q.int4 ? q.group / 2 : q.group, step = q.int4 ? panel_rows / 2
                                                                        : panel_rows;
  return groups * ((span + step - 1) / step);
}

// Byte rows j0 .. j0 + rows of group g, columns c0 + [0, kQmmCols), dequantized into
// panel rows (ldp floats apart; int4: the low nibbles' rows, then the high ones').
JS_AVX2 JS_INLINE void Avx2QmmDequantize(const Qmm& q, int64_t g, int64_t j0, int64_t rows,
                                         int64_t c0, float* panel, int64_t ldp) {
  const int64_t ld = QmmStride(q), at = QmmScaleAt(q, g, c0);  // kQmmCols scales in a row
  const __m256 offset = _mm256_set1_ps(QmmOffset(q));
  __m256 scale[4], bias[4];
  JS_UNROLL for (int c = 0; c < 4; ++c) {
    scale[c] = Avx2QmmScales(q, at + 8 * c);
    const __m256 z = q.z ? _mm256_add_ps(offset, _mm256_loadu_ps(q.z + at + 8 * c)) : offset;
    bias[c] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(z, scale[c]));
  }
  if (q.int4) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(QmmFlip(q));
    const uint8_t* w = QmmColumn<uint8_t>(q, c0) + (g * (q.group / 2) + j0) * ld;
    for (int64_t j = 0; j < rows; ++j) {
      const __m256i v = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * ld)), flip);
      __m256 lo[4], hi[4];
      QmmWiden(_mm256_and_si256(v, nibble), false, lo, q.fp4);
      QmmWiden(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), false, hi, q.fp4);
      JS_UNROLL for (int c = 0; c < 4; ++c) {
        _mm256_storeu_ps(panel + j * ldp + 8 * c, _mm256_fmadd_ps(lo[c], scale[c], bias[c]));
        _mm256_storeu_ps(panel + (rows + j) * ldp + 8 * c,
                         _mm256_fmadd_ps(hi[c], scale[c], bias[c]));
      }
    }
  } else {
    const int8_t* w = QmmColumn<int8_t>(q, c0) + (g * q.group + j0) * ld;
    for (int64_t j = 0; j < rows; ++j) {
      __m256 wv[4];
      QmmWiden(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * ld)), true, wv);
      JS_UNROLL for (int c = 0; c < 4; ++c)
        _mm256_storeu_ps(panel + j * ldp + 8 * c, _mm256_fmadd_ps(wv[c], scale[c], bias[c]));
    }
  }
}

// Chunk i (of panels of panel_rows rows) of columns c0 .. c0 + kQmmCols into the panel
// (ldp floats a row); its runs into `runs`, their count returned.
JS_AVX2 JS_INLINE int Avx2QmmChunk(const Qmm& q, int64_t i, int64_t panel_rows, int64_t c0,
                                   float* panel, int64_t ldp, QmmRun* runs) {
  if (q.group <= panel_rows) {  // whole groups, in K's order
    const int64_t per = panel_rows / q.group, g0 = i * per;
    const int64_t ng = std::min(per, QmmGroups(q) - g0), span = q.int4 ? q.group / 2 : q.group;
    for (int64_t g = g0; g < g0 + ng; ++g)
      Avx2QmmDequantize(q, g, 0, span, c0, panel + (g - g0) * q.group * ldp, ldp);
    runs[0] = {0, ng * q.group, g0 * q.group};
    return 1;
  }
  const int64_t span = q.int4 ? q.group / 2 : q.group, step = q.int4 ? panel_rows / 2
                                                                        : panel_rows;
  const int64_t steps = (span + step - 1) / step, g = i / steps, j0 = (i % steps) * step;
  const int64_t rows = std::min(step, span - j0), k0 = g * q.group;
  Avx2QmmDequantize(q, g, j0, rows, c0, panel, ldp);
  runs[0] = {0, rows, k0 + j0};
  if (!q.int4) return 1;
  runs[1] = {rows, rows, k0 + span + j0};  // the high nibbles: the group's second half
  return 2;
}

// part[r] += sum over the panel's rows i of x[r][xk + i] * panel[i] for R rows of x.
template <int R>
JS_AVX2 JS_INLINE void Avx2QmmPanelRows(const float* const* x, const float (*panel)[kQmmCols],
                                        int64_t rows, int64_t xk, float (*part)[kQmmCols]) {
  __m256 p[R][4];
  JS_UNROLL for (int r = 0; r < R; ++r)
    JS_UNROLL for (int c = 0; c < 4; ++c) p[r][c] = _mm256_loadu_ps(part[r] + 8 * c);
  for (int64_t i = 0; i < rows; ++i) {
    __m256 w[4];
    JS_UNROLL for (int c = 0; c < 4; ++c) w[c] = _mm256_loadu_ps(panel[i] + 8 * c);
    JS_UNROLL for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_set1_ps(x[r][xk + i]);
      JS_UNROLL for (int c = 0; c < 4; ++c) p[r][c] = _mm256_fmadd_ps(xb, w[c], p[r][c]);
    }
  }
  JS_UNROLL for (int r = 0; r < R; ++r)
    JS_UNROLL for (int c = 0; c < 4; ++c) _mm256_storeu_ps(part[r] + 8 * c, p[r][c]);
}

JS_AVX2 void Avx2QmmPanels(const Qmm& q, int64_t c0, float (*acc)[kQmmCols]) {
  alignas(32) float panel[kQmmPanelRows][kQmmCols];
  QmmRun runs[2];
  for (int64_t i = 0; i < QmmChunks(q, kQmmPanelRows); ++i) {
    const int n = Avx2QmmChunk(q, i, kQmmPanelRows, c0, &panel[0][0], kQmmCols, runs);
    for (int r = 0; r < n; ++r)
      for (int64_t m0 = 0; m0 < q.m; m0 += 2) {
        const float* x[2] = {q.x + m0 * q.k, q.x + std::min(m0 + 1, q.m - 1) * q.k};
        if (q.m - m0 >= 2) {
          Avx2QmmPanelRows<2>(x, panel + runs[r].at, runs[r].rows, runs[r].k, acc + m0);
        } else {
          Avx2QmmPanelRows<1>(x, panel + runs[r].at, runs[r].rows, runs[r].k, acc + m0);
        }
      }
  }
}

template <typename T>
JS_AVX2 void Avx2QmmCols(const Qmm& q, int64_t c0) {  // kQmmCols columns, every row
  if (q.m > kQmmDirectRows) {
    float acc[kQmmMaxRows][kQmmCols];
    std::memset(acc, 0, sizeof(float) * kQmmCols * q.m);
    Avx2QmmPanels(q, c0, acc);
    for (int64_t m = 0; m < q.m; ++m) QmmStore<T>(q, m, c0, acc[m], kQmmCols);
    return;
  }
  float acc[2][kQmmCols] = {};
  if (q.m == 2) {
    Avx2QmmTile<2>(q, 0, c0, acc);
  } else if (q.m == 1) {
    Avx2QmmTile<1>(q, 0, c0, acc);
  }
  for (int64_t r = 0; r < q.m; ++r) QmmStore<T>(q, r, c0, acc[r], kQmmCols);
}

// ---------------------------------------------------------------- AVX-512
JS_AVX512 JS_INLINE __m512 Avx512QmmScales(const Qmm& q, int64_t at) {
  if (!q.s_bf16) return _mm512_loadu_ps(static_cast<const float*>(q.s) + at);
  const __m256i h = _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(q.s) + at));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The direct tile (up to kQmmDirectRows rows) with 16 lanes: each 16 stored bytes widen
// to 16 int32 in one instruction (AVX2 spends four shuffles on 32: its widening port bounds
// its tile, packed int8 18-19 and int4 14-15 GB/s on a 2-core Xeon, AVX-512 19-21 and
// 18-21). int4 keeps the low and the high nibbles' products in accumulators of their own.

template <int R>
JS_AVX512 void Avx512QmmTile(const Qmm& q, int64_t m0, int64_t c0, float (*acc)[kQmmCols]) {
  const int64_t groups = QmmGroups(q), half = q.group / 2, ld = QmmStride(q);
  const int64_t ahead = QmmAhead(q);
  const __m512 offset = _mm512_set1_ps(QmmOffset(q));
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  const __m128i flip = _mm_set1_epi8(QmmFlip(q));
  const __m512 table = _mm512_load_ps(kE2m1);  // fp4: a code's value by permute
  const float* x[R];
  JS_UNROLL for (int r = 0; r < R; ++r) x[r] = q.x + (m0 + r) * q.k;
  __m512 total[R][2];
  JS_UNROLL for (int r = 0; r < R; ++r)
    JS_UNROLL for (int c = 0; c < 2; ++c) total[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 p[R][2], ph[R][2];
    JS_UNROLL for (int r = 0; r < R; ++r)
      JS_UNROLL for (int c = 0; c < 2; ++c) p[r][c] = ph[r][c] = _mm512_setzero_ps();
    const int64_t k0 = g * q.group;
    if (q.int4) {
      const uint8_t* w = QmmColumn<uint8_t>(q, c0) + g * half * ld;
      for (int64_t j = 0; j < half; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(w + j * ld + ahead), _MM_HINT_T0);
        __m512 lo[2], hi[2];
        JS_UNROLL for (int c = 0; c < 2; ++c) {  // u = q + 8 in each nibble (fp4: its code)
          const __m512i u = _mm512_cvtepu8_epi32(_mm_xor_si128(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * ld + 16 * c)), flip));
          const __m512i low = _mm512_and_si512(u, nibble), high = _mm512_srli_epi32(u, 4);
          lo[c] = q.fp4 ? _mm512_permutexvar_ps(low, table) : _mm512_cvtepi32_ps(low);
          hi[c] = q.fp4 ? _mm512_permutexvar_ps(high, table) : _mm512_cvtepi32_ps(high);
        }
        JS_UNROLL for (int r = 0; r < R; ++r) {
          const __m512 xl = _mm512_set1_ps(x[r][k0 + j]), xh = _mm512_set1_ps(x[r][k0 + half + j]);
          JS_UNROLL for (int c = 0; c < 2; ++c) {
            p[r][c] = _mm512_fmadd_ps(xl, lo[c], p[r][c]);
            ph[r][c] = _mm512_fmadd_ps(xh, hi[c], ph[r][c]);
          }
        }
      }
    } else {
      const int8_t* w = QmmColumn<int8_t>(q, c0) + g * q.group * ld;
      for (int64_t kk = 0; kk < q.group; ++kk) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kk * ld + ahead), _MM_HINT_T0);
        __m512 wv[2];
        JS_UNROLL for (int c = 0; c < 2; ++c)
          wv[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kk * ld + 16 * c))));
        JS_UNROLL for (int r = 0; r < R; ++r) {
          const __m512 xb = _mm512_set1_ps(x[r][k0 + kk]);
          JS_UNROLL for (int c = 0; c < 2; ++c) {
            // two chains, even and odd rows (as int4's two nibbles)
            if (kk & 1) ph[r][c] = _mm512_fmadd_ps(xb, wv[c], ph[r][c]);
            else p[r][c] = _mm512_fmadd_ps(xb, wv[c], p[r][c]);
          }
        }
      }
    }
    JS_UNROLL for (int c = 0; c < 2; ++c) {
      const int64_t col = QmmScaleAt(q, g, c0 + 16 * c);  // 16 in a row, packed or not
      const __m512 s = Avx512QmmScales(q, col);
      const __m512 z = q.z ? _mm512_add_ps(offset, _mm512_loadu_ps(q.z + col)) : offset;
      JS_UNROLL for (int r = 0; r < R; ++r) {
        const __m512 sum = _mm512_set1_ps(q.sx[(m0 + r) * groups + g]);
        const __m512 part = _mm512_fnmadd_ps(z, sum, _mm512_add_ps(p[r][c], ph[r][c]));
        total[r][c] = _mm512_fmadd_ps(part, s, total[r][c]);
      }
    }
  }
  JS_UNROLL for (int r = 0; r < R; ++r)
    JS_UNROLL for (int c = 0; c < 2; ++c) _mm512_storeu_ps(acc[r] + 16 * c, total[r][c]);
}

// The panels with 16 lanes: two strips (64 columns) at once, so that R = 6 rows of x by
// 64 columns hold 24 of the 32 registers, the float matmul's tile: 24 FMAs to 4 loads of
// the panel and 6 broadcasts of x (AVX2's 16 registers hold 2 rows by 32 columns).
constexpr int64_t kQmmWide = 2 * kQmmCols;
constexpr int64_t kQmmWideRows = 64;  // panel rows: 16 KiB, as AVX2's

template <int R>
JS_AVX512 JS_INLINE void Avx512QmmPanelRows(const float* x, int64_t ldx, const float* panel,
                                            int64_t rows, int64_t xk, float (*part)[kQmmWide]) {
  __m512 p[R][4];
  JS_UNROLL for (int r = 0; r < R; ++r)
    JS_UNROLL for (int v = 0; v < 4; ++v) p[r][v] = _mm512_loadu_ps(part[r] + 16 * v);
  int64_t i = 0;
  do {  // rows >= 1; a do-while keeps GCC from spilling p every iteration (as F32KnTile)
    __m512 w[4];
    JS_UNROLL for (int v = 0; v < 4; ++v) w[v] = _mm512_loadu_ps(panel + i * kQmmWide + 16 * v);
    JS_UNROLL for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + xk + i]);
      JS_UNROLL for (int v = 0; v < 4; ++v) p[r][v] = _mm512_fmadd_ps(xb, w[v], p[r][v]);
    }
  } while (++i < rows);
  JS_UNROLL for (int r = 0; r < R; ++r)
    JS_UNROLL for (int v = 0; v < 4; ++v) _mm512_storeu_ps(part[r] + 16 * v, p[r][v]);
}

template <typename T>
JS_AVX512 void Avx512QmmWideCols(const Qmm& q, int64_t c0) {  // kQmmWide columns, > 2 rows
  alignas(64) float panel[kQmmWideRows * kQmmWide];
  float acc[kQmmMaxRows][kQmmWide];
  std::memset(acc, 0, sizeof(float) * kQmmWide * q.m);
  QmmRun runs[2];
  for (int64_t i = 0; i < QmmChunks(q, kQmmWideRows); ++i) {
    Avx2QmmChunk(q, i, kQmmWideRows, c0 + kQmmCols, panel + kQmmCols, kQmmWide, runs);
    const int n = Avx2QmmChunk(q, i, kQmmWideRows, c0, panel, kQmmWide, runs);
    for (int r = 0; r < n; ++r) {
      const float* at = panel + runs[r].at * kQmmWide;
      const int64_t rows = runs[r].rows, xk = runs[r].k;
      int64_t m0 = 0;
      for (; m0 + 6 <= q.m; m0 += 6)
        Avx512QmmPanelRows<6>(q.x + m0 * q.k, q.k, at, rows, xk, acc + m0);
      const int64_t left = q.m - m0;  // 0-5: 4 + 1, 2 + 1
      if (left >= 4) Avx512QmmPanelRows<4>(q.x + m0 * q.k, q.k, at, rows, xk, acc + m0);
      if (left >= 4) m0 += 4;
      if (q.m - m0 >= 2) Avx512QmmPanelRows<2>(q.x + m0 * q.k, q.k, at, rows, xk, acc + m0);
      if (q.m - m0 >= 2) m0 += 2;
      if (q.m - m0 == 1) Avx512QmmPanelRows<1>(q.x + m0 * q.k, q.k, at, rows, xk, acc + m0);
    }
  }
  for (int64_t m = 0; m < q.m; ++m) QmmStore<T>(q, m, c0, acc[m], kQmmWide);
}

template <typename T>
JS_AVX512 void Avx512QmmCols(const Qmm& q, int64_t c0) {  // kQmmCols columns, <= 2 rows
  float acc[2][kQmmCols];
  if (q.m == 2) {
    Avx512QmmTile<2>(q, 0, c0, acc);
  } else {
    Avx512QmmTile<1>(q, 0, c0, acc);
  }
  for (int64_t r = 0; r < q.m; ++r) QmmStore<T>(q, r, c0, acc[r], kQmmCols);
}
#endif  // JS_X86

template <typename T>
void QmmTask(const Qmm& q, int64_t task) {
  const int64_t c0 = task * kQmmTaskCols, nc = std::min(kQmmTaskCols, q.n - c0);
#if JS_X86
  if (CurrentIsa() >= kAvx512 && q.m >= 1) {
    int64_t c = 0;
    if (q.m > kQmmDirectRows) {
      for (; c + kQmmWide <= nc; c += kQmmWide) Avx512QmmWideCols<T>(q, c0 + c);
      for (; c + kQmmCols <= nc; c += kQmmCols) Avx2QmmCols<T>(q, c0 + c);
    } else {
      for (; c + kQmmCols <= nc; c += kQmmCols) Avx512QmmCols<T>(q, c0 + c);
    }
    if (c < nc) GenericQmmCols<T>(q, c0 + c, nc - c);
    return;
  }
  if (CurrentIsa() >= kAvx2) {
    int64_t c = 0;
    for (; c + kQmmCols <= nc; c += kQmmCols) Avx2QmmCols<T>(q, c0 + c);
    if (c < nc) GenericQmmCols<T>(q, c0 + c, nc - c);
    return;
  }
#endif
  GenericQmmCols<T>(q, c0, nc);
}

// x_raw [m, k] in x's dtype -> q.x (float32) and each group's sums q.sx; then the tasks,
// over blocks of at most kQmmMaxRows rows (a prefill chunk: each block dequantizes its
// panels again, a few operations per 16 weights against 64 rows' FMAs).
inline void QuantizedMatmul(Runner& run, const void* x_raw, Qmm q, std::vector<float>& xf,
                            std::vector<float>& sums) {
  const int64_t groups = QmmGroups(q);
  const float* x = static_cast<const float*>(x_raw);
  if (q.bf16) {
    xf.resize(q.m * q.k);
    for (int64_t i = 0; i < q.m * q.k; ++i)
      xf[i] = Bf16ToF32(static_cast<const uint16_t*>(x_raw)[i]);
    x = xf.data();
  }
  // Tasks: kQmmTaskCols columns by a block of rows. Where the columns alone would leave
  // threads idle (a small model's k / v: 3 tasks of 64 columns), the rows split further,
  // in multiples of 6 (the AVX-512 panel tile), each block dequantizing its panels anew.
  const int64_t col_tasks = (q.n + kQmmTaskCols - 1) / kQmmTaskCols, want = 4 * run.threads();
  int64_t block = kQmmMaxRows;
  if (q.m > kQmmDirectRows && col_tasks < want) {
    const int64_t splits = std::min((want + col_tasks - 1) / col_tasks, (q.m + 5) / 6);
    block = std::min(kQmmMaxRows, ((q.m + splits - 1) / splits + 5) / 6 * 6);
  }
  const int64_t blocks = (q.m + block - 1) / block;
  const int64_t y_row = q.n * (q.bf16 ? 2 : 4);  // bytes
  // Each group's sum of x, for the rows the direct tiles and the generic loops take (blocks
  // of one or two rows; every row for a tail of N past whole strips, or without AVX2); the
  // panels do without.
  const bool all_rows = q.n % kQmmCols != 0 || CurrentIsa() < kAvx2;
  sums.assign(q.m * groups, 0.0f);
  for (int64_t m = 0; m < q.m; ++m) {
    if (!all_rows && std::min(block, q.m - m / block * block) > kQmmDirectRows) continue;
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t kk = g * q.group; kk < (g + 1) * q.group; ++kk) s += x[m * q.k + kk];
      sums[m * groups + g] = s;
    }
  }
  auto task = [&](int64_t t, auto out) {
    const int64_t m0 = (t / col_tasks) * block;
    Qmm b = q;
    b.m = std::min(block, q.m - m0);
    b.x = x + m0 * q.k;
    b.sx = sums.data() + m0 * groups;
    b.y = static_cast<char*>(q.y) + m0 * y_row;
    QmmTask<decltype(out)>(b, t % col_tasks);
  };
  if (q.bf16) {
    run.For(col_tasks * blocks, [&](int64_t t) { task(t, uint16_t{}); });
  } else {
    run.For(col_tasks * blocks, [&](int64_t t) { task(t, float{}); });
  }
}

}  // namespace
}  // namespace jaxserve
