// Ragged paged attention (jaxserve_ragged_paged_attention).
//
// Attention: one task per (sequence, KV head, block of queries), largest first; keys in
// chunks of 32, software-prefetched two chunks ahead, and a thread's likely next task's
// first chunks while the current one runs (into L2 on AVX-512); scores as 4 x 4 (1 x 16,
// 2 x 8) tiles of dot products for few rows (decode; vdpbf16ps for bf16 q and pages) or
// from K^T for many (prefill); online softmax and P.V in f32. The plan is written once
// (attention_tiles.inc) over a vector of 16 lanes (AVX-512) or 8 (AVX2: 4 x 2, 1 x 8,
// 2 x 4 tiles); each instruction set supplies its primitives here. A generic loop in
// plain C++ runs elsewhere. See pallas_kernels/ragged_paged_attention/cpu.py.

#pragma once

#include "common.h"
#include "simd.h"

namespace jaxserve {
namespace {

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
  const float* sinks;         // [Hq]: attention sinks (gpt-oss), else null
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
// the time; benchmarks/history/2026-11-21-to-29.md). Where rows are converted, the
// conversion spreads them.
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
// for its rows padded to the vector tiles: from the row's attention sink when there are
// sinks (running max = the sink, sum = 1), else empty.
JS_INLINE void StartTask(const Attn& a, const AttnTask& t, const SeqInfo& si, Work* w,
                         int64_t* lo, int64_t* hi, bool padded) {
  *w = MakeWork((t.q1 - t.q0) * a.group, a.d);
  LoadQueries(a, t, si, *w);
  KeyRange(a, si, t.q0, t.q1, lo, hi);
  const int64_t rows = padded ? w->rows_pad : w->rows;
  for (int64_t r = 0; r < rows; ++r) {
    w->m[r] = a.sinks ? a.sinks[t.head * a.group + r % a.group] : kMasked;
    w->l[r] = a.sinks ? 1.0f : 0.0f;
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
// Each instruction set's primitives for attention_tiles.inc (which lists them), then the
// tiles and the task written once over them.

// ---------------------------------------------------------------- AVX2 attention

namespace avx2 {
#define JS_SIMD JS_AVX2

using V = __m256;
using KeyMask = __m256;  // all ones in the lanes of visible keys
constexpr int kLanes = 8;
constexpr bool kTilePrefetch = false;  // the gather loop prefetches the ahead chunk into L1
constexpr int kRowsT = 6;  // 12 accumulators of 16 keys
constexpr int MaxNv(int rb) { return rb == 1 ? 8 : rb == 2 ? 4 : 2; }  // at most 12 acc.
constexpr int kPvRows = 6;
constexpr bool kPvOneRow = true;

JS_SIMD JS_INLINE V Zero() { return _mm256_setzero_ps(); }
JS_SIMD JS_INLINE V Set1(float x) { return _mm256_set1_ps(x); }
JS_SIMD JS_INLINE V Load(const float* p) { return _mm256_loadu_ps(p); }
JS_SIMD JS_INLINE void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
JS_SIMD JS_INLINE V Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
JS_SIMD JS_INLINE V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
JS_SIMD JS_INLINE V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
JS_SIMD JS_INLINE V Add(V a, V b) { return _mm256_add_ps(a, b); }
JS_SIMD JS_INLINE V Sub(V a, V b) { return _mm256_sub_ps(a, b); }
JS_SIMD JS_INLINE V Max(V a, V b) { return _mm256_max_ps(a, b); }
JS_SIMD JS_INLINE float ReduceAdd(V v) { return Avx2Sum(v); }
JS_SIMD JS_INLINE V Exp(V x) { return Exp8(x); }

JS_SIMD JS_INLINE float ReduceMax(V v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// cap * tanh(s / cap), as avx512::SoftCap.
JS_SIMD JS_INLINE V SoftCap(V s, float cap) {
  const __m256 c = _mm256_set1_ps(cap);
  const __m256 x = _mm256_div_ps(s, c);
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 e = Exp8(_mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(-2.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_mul_ps(c, _mm256_or_ps(t, sign));
}

// Lane i of the result: the sum of the 8 lanes of acc[i].
JS_SIMD JS_INLINE V ReduceLanes(const V* acc) {
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The tile's sums (lane r * JB + j) into s[r * lds + j].
template <int RB, int JB>
JS_SIMD JS_INLINE void StoreTile(float* s, int64_t lds, V sum) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  JS_UNROLL for (int r = 0; r < RB; ++r)
    JS_UNROLL for (int j = 0; j < JB; ++j) s[r * lds + j] = lanes[r * JB + j];
}

// 8 bf16 or int8 (unscaled) elements as f32.
JS_SIMD JS_INLINE V Widen(const uint16_t* p) { return Avx2Load8(p); }
JS_SIMD JS_INLINE V Widen(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// One K/V row -> f32 (D a multiple of 8).
JS_SIMD JS_INLINE void ConvertRow(const Attn& a, const char* src, float* dst) {
  switch (a.kv) {
    case kKvBf16:
      for (int64_t e = 0; e < a.d; e += 8)
        Store(dst + e, Widen(reinterpret_cast<const uint16_t*>(src) + e));
      break;
    case kKvS8:
      for (int64_t e = 0; e < a.d; e += 8)
        Store(dst + e, Widen(reinterpret_cast<const int8_t*>(src) + e));
      break;
    default: ConvertRowGeneric(a, src, dst); break;
  }
}

// dst[c][r] = src[r][c] for a block of kLanes x kLanes floats.
JS_SIMD JS_INLINE void TransposeBlock(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8];
  JS_UNROLL for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  Transpose8(r);
  JS_UNROLL for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + i * ldd, r[i]);
}

// Lanes of keys 8g..8g+7 visible in `bits` (bit j: key j of the chunk).
JS_SIMD JS_INLINE KeyMask LaneMask(uint32_t bits, int g) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits >> 8 * g)),
                                     lane_bit);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, lane_bit));
}
JS_SIMD JS_INLINE V Select(KeyMask m, V yes, V no) { return _mm256_blendv_ps(no, yes, m); }
JS_SIMD JS_INLINE V KeepMasked(KeyMask m, V x) { return _mm256_and_ps(m, x); }

template <typename KV>
JS_SIMD void Scores(const Work& w, const void* const* krow, int64_t nk_pad, int64_t D,
                    const Ahead& ah);

// bf16 K rows in place: widened in the tiles.
JS_SIMD JS_INLINE void ScoresBf16(const Attn& a, const Work& w, const void* const* krow,
                                  int64_t nk_pad, const Ahead& ah) {
  Scores<uint16_t>(w, krow, nk_pad, a.d, ah);
}

JS_SIMD JS_INLINE void StoreRows(const Attn& a, const AttnTask& t, const SeqInfo& si,
                                 const Work& w) {
  StoreOutputs(a, t, si, w);
}

#include "attention_tiles.inc"
#undef JS_SIMD
}  // namespace avx2

// ---------------------------------------------------------------- AVX-512 attention

namespace avx512 {
#define JS_SIMD JS_AVX512

using V = __m512;
using KeyMask = __mmask16;
constexpr int kLanes = 16;
constexpr bool kTilePrefetch = true;  // the tiles prefetch the ahead chunk into L2
constexpr int kRowsT = 12;  // 24 accumulators of 32 keys
constexpr int MaxNv(int rb) { return rb <= 2 ? 8 : rb <= 4 ? 4 : 2; }  // at most 16 acc.
constexpr int kPvRows = 8;
constexpr bool kPvOneRow = false;  // a last row alone runs as two (the second p = 0)

JS_SIMD JS_INLINE V Zero() { return _mm512_setzero_ps(); }
JS_SIMD JS_INLINE V Set1(float x) { return _mm512_set1_ps(x); }
JS_SIMD JS_INLINE V Load(const float* p) { return _mm512_loadu_ps(p); }
JS_SIMD JS_INLINE void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
JS_SIMD JS_INLINE V Broadcast(const float* p) { return _mm512_set1_ps(*p); }
JS_SIMD JS_INLINE V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
JS_SIMD JS_INLINE V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
JS_SIMD JS_INLINE V Add(V a, V b) { return _mm512_add_ps(a, b); }
JS_SIMD JS_INLINE V Sub(V a, V b) { return _mm512_sub_ps(a, b); }
JS_SIMD JS_INLINE V Max(V a, V b) { return _mm512_max_ps(a, b); }
JS_SIMD JS_INLINE float ReduceAdd(V v) { return _mm512_reduce_add_ps(v); }
JS_SIMD JS_INLINE float ReduceMax(V v) { return _mm512_reduce_max_ps(v); }
JS_SIMD JS_INLINE V ReduceLanes(const V* acc) { return Reduce16(acc); }

JS_SIMD JS_INLINE V Exp(V x) { return Exp16(x); }

// cap * tanh(s / cap) = cap * sign(s) * (1 - e) / (1 + e), e = exp(-2 |s| / cap).
JS_SIMD JS_INLINE V SoftCap(V s, float cap) {
  const __m512 c = _mm512_set1_ps(cap);
  const __m512 x = _mm512_div_ps(s, c);
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 e = Exp(_mm512_mul_ps(ax, _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  // copy the sign of x
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x80000000));
  t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
  return _mm512_mul_ps(c, t);
}

// 16 bf16 or int8 (unscaled) elements as f32.
JS_SIMD JS_INLINE V Widen(const uint16_t* p) { return LoadBf16(p); }
JS_SIMD JS_INLINE V Widen(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

// One K/V row -> f32 (D a multiple of 16).
JS_SIMD JS_INLINE void ConvertRow(const Attn& a, const char* src, float* dst) {
  const int64_t D = a.d;
  switch (a.kv) {
    case kKvF32: std::memcpy(dst, src, sizeof(float) * D); break;
    case kKvBf16:
      for (int64_t e = 0; e < D; e += 16)
        Store(dst + e, Widen(reinterpret_cast<const uint16_t*>(src) + e));
      break;
    case kKvS8:
      for (int64_t e = 0; e < D; e += 16)
        Store(dst + e, Widen(reinterpret_cast<const int8_t*>(src) + e));
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


// The tile's sums (lane r * JB + j) into s[r * lds + j].
template <int RB, int JB>
JS_SIMD JS_INLINE void StoreTile(float* s, int64_t lds, V sum) {
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

JS_SIMD JS_INLINE void TransposeBlock(const float* src, int64_t lds, float* dst, int64_t ldd) {
  Transpose16(reinterpret_cast<const uint32_t*>(src), lds, 16, 16,
              reinterpret_cast<uint32_t*>(dst), ldd);
}

// Lanes of keys 16g..16g+15 visible in `bits` (bit j: key j of the chunk).
JS_SIMD JS_INLINE KeyMask LaneMask(uint32_t bits, int g) {
  return static_cast<__mmask16>((bits >> 16 * g) & 0xffff);
}
JS_SIMD JS_INLINE V Select(KeyMask m, V yes, V no) { return _mm512_mask_mov_ps(no, m, yes); }
JS_SIMD JS_INLINE V KeepMasked(KeyMask m, V x) { return _mm512_maskz_mov_ps(m, x); }

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
  StoreTile<RB, JB>(s, lds, _mm512_mul_ps(Reduce16(acc), _mm512_set1_ps(scale)));
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

template <typename KV>
JS_SIMD void Scores(const Work& w, const void* const* krow, int64_t nk_pad, int64_t D,
                    const Ahead& ah);

// bf16 K rows in place: vdpbf16ps against bf16 q where the CPU has it, else widened.
JS_SIMD JS_INLINE void ScoresBf16(const Attn& a, const Work& w, const void* const* krow,
                                  int64_t nk_pad, const Ahead& ah) {
  if (a.bf16_dot) {
    ScoresDp(w, krow, nk_pad, a.d, a.sm_scale, ah);
  } else {
    Scores<uint16_t>(w, krow, nk_pad, a.d, ah);
  }
}

// Normalised and stored in q's dtype.
JS_SIMD JS_INLINE void StoreRows(const Attn& a, const AttnTask& t, const SeqInfo& si,
                                 const Work& w) {
  const int64_t D = a.d;
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

#include "attention_tiles.inc"
#undef JS_SIMD
}  // namespace avx512
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
  // keys 1.3-1.6x, 8 x 1024 1.3x the time; benchmarks/history/2026-11-21-to-29.md).
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
    return run_tasks([&](const AttnTask& t) { avx512::AttnTask(b, t); });
  }
  if (isa >= kAvx2 && a.d % 8 == 0)
    return run_tasks([&](const AttnTask& t) { avx2::AttnTask(a, t); });
#endif
  (void)isa;
  run.For(static_cast<int64_t>(tasks.size()), [&](int64_t i) { ScalarAttnTask(a, tasks[i]); });
}


}  // namespace
}  // namespace jaxserve
