// The float matmul (jaxserve_matmul): see its FFI handler in kernels.cc.
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

#pragma once

#include "common.h"
#include "simd.h"

namespace jaxserve {
namespace {

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
// (benchmarks/history/2026-11-21-to-29.md, stop 49).
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

// acc[r][0:16] (+)= x[r, 0:kn] . panel[0:kn] for RB rows of x (row stride ldx) and of acc
// (row stride ldacc).
template <int RB>
JS_AVX2 JS_INLINE void Avx2PanelTile(const float* x, int64_t ldx, const float* panel,
                                     int64_t kn, float* acc_rows, int64_t ldacc,
                                     bool first) {
  __m256 acc[RB][2];
  JS_UNROLL for (int r = 0; r < RB; ++r) {
    acc[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_rows + r * ldacc);
    acc[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_rows + r * ldacc + 8);
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
    _mm256_storeu_ps(acc_rows + r * ldacc, acc[r][0]);
    _mm256_storeu_ps(acc_rows + r * ldacc + 8, acc[r][1]);
  }
}

// K in blocks whose slice of the panel (256 x 16 float32: 16 KiB) and of 6 rows of x
// (6 KiB) stay in L1; partial sums of a block of rows in a float32 buffer. A float32
// matmul whose K is one block and whose panel is 16 whole columns writes its tiles into y
// (no buffer, no scalar copy): with K 64 the copy was a large share of a tile ([256, 64] x
// [2048, 64] on a 2-core AVX2 EPYC, 10th percentile of 40 runs, 3 alternations: 0.61-1.13
// -> 0.42-0.70 ms; XLA's dot 0.48-0.76).
constexpr int64_t kAvx2PanelDepth = 256;

template <typename T>
JS_AVX2 void Avx2NkPanels(const Mm& a, const float* xf, int64_t n0, int64_t nn) {
  thread_local std::vector<float> buf;
  const size_t need = (a.k + kAvx2RowBlock) * kAvx2PanelCols;
  if (buf.size() < need) buf.resize(need);
  float* panel = buf.data();
  const T* w = static_cast<const T*>(a.w);
  T* y = static_cast<T*>(a.y);
  const int64_t K = a.k;
  for (int64_t c0 = n0; c0 < n0 + nn; c0 += kAvx2PanelCols) {
    const int64_t cols = std::min<int64_t>(kAvx2PanelCols, n0 + nn - c0);
    PackAvx2Panel<T>(w + c0 * K, K, cols, panel);
    bool direct = false;  // tiles written into y
    if constexpr (std::is_same_v<T, float>)
      direct = K <= kAvx2PanelDepth && cols == kAvx2PanelCols;
    for (int64_t m0 = 0; m0 < a.m; m0 += kAvx2RowBlock) {
      const int64_t rows = std::min(kAvx2RowBlock, a.m - m0);
      float* acc = panel + a.k * kAvx2PanelCols;  // [kAvx2RowBlock][16]
      int64_t ld = kAvx2PanelCols;
      if constexpr (std::is_same_v<T, float>) {
        if (direct) {
          acc = y + m0 * a.n + c0;
          ld = a.n;
        }
      }
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
          Avx2PanelTile<kAvx2TileRows>(x + r * K, K, p, kn, acc + r * ld, ld, k0 == 0);
        while (r < rows) {
          const int64_t left = rows - r;
          const int64_t take = left >= 7 ? 4 : left;
          float* ar = acc + r * ld;
          switch (take) {
            case 1: Avx2PanelTile<1>(x + r * K, K, p, kn, ar, ld, k0 == 0); break;
            case 2: Avx2PanelTile<2>(x + r * K, K, p, kn, ar, ld, k0 == 0); break;
            case 3: Avx2PanelTile<3>(x + r * K, K, p, kn, ar, ld, k0 == 0); break;
            case 4: Avx2PanelTile<4>(x + r * K, K, p, kn, ar, ld, k0 == 0); break;
            default: Avx2PanelTile<5>(x + r * K, K, p, kn, ar, ld, k0 == 0); break;
          }
          r += take;
        }
      }
      if (direct) continue;
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


}  // namespace
}  // namespace jaxserve
