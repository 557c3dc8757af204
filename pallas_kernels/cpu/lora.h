// The LoRA delta of a mixed batch (jaxserve_lora): see its FFI handler in kernels.cc.
//
// y_i[t] += (x[t] @ A_i[s(t)]) @ B_i[s(t)] for every module i sharing x and every token t
// whose slot s(t) = slots[t] is in 1..G (0, or out of range: no adapter, no work). The
// tokens with an adapter are sorted by slot (a counting sort) and cut into blocks of up
// to kLoraBlock tokens of one slot; the shrink (x by A, into float32 h) runs one task per
// (module, block), each A row read once for the block's tokens, and the expand (h by B,
// added to y) one task per (module, block, strip of kLoraCols output columns). Only the
// slots the batch uses are read; a batch without adapter tokens returns at once. x, A, B
// and y share a dtype (f32 or bf16, read as float32); h stays float32 and y is rounded
// once. With AVX2 (and on AVX-512 CPUs) register tiles of 8-lane FMAs, ranks in 8s;
// otherwise (no AVX2, or a rank that is not a multiple of 8) generic loops.

#pragma once

#include "common.h"
#include "matmul.h"  // ToF32, FromF32
#include "rows.h"    // Store8

namespace jaxserve {
namespace {

constexpr int64_t kLoraBlock = 4;    // tokens of one slot per task
constexpr int64_t kLoraCols = 256;   // output columns per expand task
constexpr int64_t kLoraRanks = 16;   // ranks per register tile of the shrink

struct LoraModule {
  const void* a;  // [G, K, R]
  const void* b;  // [G, R, N]
  void* y;        // [T, N], updated in place
  int64_t n;
};

struct Lora {
  const void* x;         // [T, K]
  int64_t k, r, g;
  bool bf16;
  const int32_t* order;  // the adapter tokens, by slot
  int64_t blocks;
  const int64_t* block_start;  // into order
  const int64_t* block_len;
  const int32_t* block_slot;   // 0-based
  float* h;                    // [modules][tokens with an adapter][R]
  int64_t active;              // tokens with an adapter
};

// Block blk's kLoraBlock places: its tokens (indices into order and h's rows), then its
// last one again (tiles compute whole blocks; the repeats are not stored). x_rows: their
// rows of x.
JS_INLINE int64_t BlockToken(const Lora& l, int64_t blk, int64_t t) {
  return l.block_start[blk] + std::min(t, l.block_len[blk] - 1);
}

template <typename T>
JS_INLINE void BlockXRows(const Lora& l, int64_t blk, const T** x_rows) {
  for (int64_t t = 0; t < kLoraBlock; ++t)
    x_rows[t] = static_cast<const T*>(l.x) + l.order[BlockToken(l, blk, t)] * l.k;
}

template <typename T>
JS_INLINE void LoraShrinkTask(const Lora& l, const LoraModule& mod, int64_t mi, int64_t blk) {
  const T* a = static_cast<const T*>(mod.a) + l.block_slot[blk] * l.k * l.r;
  const int64_t s0 = l.block_start[blk], nt = l.block_len[blk];
  const T* xr[kLoraBlock];
  BlockXRows(l, blk, xr);
  for (int64_t r0 = 0; r0 < l.r; r0 += kLoraRanks) {
    const int64_t rc = std::min(kLoraRanks, l.r - r0);
    float acc[kLoraBlock][kLoraRanks] = {};
    for (int64_t kk = 0; kk < l.k; ++kk) {
      float af[kLoraRanks];
      const T* ak = a + kk * l.r + r0;
      if (rc == kLoraRanks) {
        for (int c = 0; c < kLoraRanks; ++c) af[c] = ToF32<T>(ak[c]);
      } else {
        for (int c = 0; c < kLoraRanks; ++c) af[c] = c < rc ? ToF32<T>(ak[c]) : 0.0f;
      }
      for (int t = 0; t < kLoraBlock; ++t) {
        const float xv = ToF32<T>(xr[t][kk]);
        for (int c = 0; c < kLoraRanks; ++c) acc[t][c] += xv * af[c];
      }
    }
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t c = 0; c < rc; ++c) l.h[(mi * l.active + s0 + t) * l.r + r0 + c] = acc[t][c];
  }
}

template <typename T>
JS_INLINE void LoraExpandTask(const Lora& l, const LoraModule& mod, int64_t mi, int64_t blk,
                              int64_t strip) {
  const T* b = static_cast<const T*>(mod.b) + l.block_slot[blk] * l.r * mod.n;
  T* y = static_cast<T*>(mod.y);
  const int64_t n0 = strip * kLoraCols, nc = std::min(kLoraCols, mod.n - n0);
  const int64_t s0 = l.block_start[blk], nt = l.block_len[blk];
  for (int64_t t = 0; t < nt; ++t) {
    const float* h = l.h + (mi * l.active + s0 + t) * l.r;
    float acc[kLoraCols] = {};
    for (int64_t rr = 0; rr < l.r; ++rr) {
      const float hv = h[rr];
      if (hv == 0.0f) continue;  // ranks past the adapter's own (zero padding)
      const T* br = b + rr * mod.n + n0;
      for (int64_t c = 0; c < nc; ++c) acc[c] += hv * ToF32<T>(br[c]);
    }
    T* yr = y + l.order[s0 + t] * mod.n + n0;
    for (int64_t c = 0; c < nc; ++c) yr[c] = FromF32<T>(ToF32<T>(yr[c]) + acc[c]);
  }
}

#if JS_X86
// ---------------------------------------------------------------- AVX2 (ranks in 8s)
// Register tiles: the shrink keeps a block's 4 tokens x V vectors of 8 ranks in registers
// while it walks K (one A row of V vectors read per step for all 4 tokens); the expand,
// 4 tokens x 16 columns while it walks the ranks. Tokens past the block's own repeat its
// last one (BlockToken) and are not stored.

template <typename T, int V>
JS_AVX2 JS_INLINE void Avx2ShrinkTile(const Lora& l, const T* const* xr, const T* a,
                                      int64_t r0, float* const* h, int64_t nt) {
  __m256 acc[kLoraBlock][V];
  JS_UNROLL for (int t = 0; t < kLoraBlock; ++t)
    JS_UNROLL for (int v = 0; v < V; ++v) acc[t][v] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < l.k; ++kk) {
    __m256 av[V];
    JS_UNROLL for (int v = 0; v < V; ++v) av[v] = Avx2Load8(a + kk * l.r + r0 + 8 * v);
    JS_UNROLL for (int t = 0; t < kLoraBlock; ++t) {
      const __m256 xb = _mm256_set1_ps(ToF32<T>(xr[t][kk]));
      JS_UNROLL for (int v = 0; v < V; ++v) acc[t][v] = _mm256_fmadd_ps(xb, av[v], acc[t][v]);
    }
  }
  JS_UNROLL for (int t = 0; t < kLoraBlock; ++t)
    if (t < nt)
      JS_UNROLL for (int v = 0; v < V; ++v) _mm256_storeu_ps(h[t] + r0 + 8 * v, acc[t][v]);
}

template <typename T>
JS_AVX2 void Avx2ShrinkTask(const Lora& l, const LoraModule& mod, int64_t mi, int64_t blk) {
  const T* a = static_cast<const T*>(mod.a) + l.block_slot[blk] * l.k * l.r;
  const int64_t nt = l.block_len[blk];
  const T* xr[kLoraBlock];
  float* h[kLoraBlock];
  BlockXRows(l, blk, xr);
  for (int64_t t = 0; t < kLoraBlock; ++t)
    h[t] = l.h + (mi * l.active + BlockToken(l, blk, t)) * l.r;
  for (int64_t r0 = 0; r0 < l.r; r0 += kLoraRanks) {
    if (l.r - r0 >= 16) {
      Avx2ShrinkTile<T, 2>(l, xr, a, r0, h, nt);
    } else {  // 8 ranks left (r is a multiple of 8 here)
      Avx2ShrinkTile<T, 1>(l, xr, a, r0, h, nt);
    }
  }
}

template <typename T>
JS_AVX2 void Avx2ExpandTask(const Lora& l, const LoraModule& mod, int64_t mi, int64_t blk,
                            int64_t strip) {
  const T* b = static_cast<const T*>(mod.b) + l.block_slot[blk] * l.r * mod.n;
  const int64_t n0 = strip * kLoraCols, n1 = std::min(mod.n, n0 + kLoraCols);
  const int64_t nt = l.block_len[blk];
  const float* h[kLoraBlock];
  T* y[kLoraBlock];
  for (int64_t t = 0; t < kLoraBlock; ++t) {
    const int64_t u = BlockToken(l, blk, t);
    h[t] = l.h + (mi * l.active + u) * l.r;
    y[t] = static_cast<T*>(mod.y) + l.order[u] * mod.n;
  }
  int64_t c = n0;
  for (; c + 16 <= n1; c += 16) {
    __m256 acc[kLoraBlock][2];
    JS_UNROLL for (int t = 0; t < kLoraBlock; ++t)
      acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t rr = 0; rr < l.r; ++rr) {
      const __m256 b0 = Avx2Load8(b + rr * mod.n + c), b1 = Avx2Load8(b + rr * mod.n + c + 8);
      JS_UNROLL for (int t = 0; t < kLoraBlock; ++t) {
        const __m256 hb = _mm256_set1_ps(h[t][rr]);
        acc[t][0] = _mm256_fmadd_ps(hb, b0, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(hb, b1, acc[t][1]);
      }
    }
    for (int64_t t = 0; t < nt; ++t) {
      Store8(y[t] + c, _mm256_add_ps(Avx2Load8(y[t] + c), acc[t][0]));
      Store8(y[t] + c + 8, _mm256_add_ps(Avx2Load8(y[t] + c + 8), acc[t][1]));
    }
  }
  for (int64_t t = 0; t < nt && c < n1; ++t)  // columns past the last 16
    for (int64_t cc = c; cc < n1; ++cc) {
      float s = 0.0f;
      for (int64_t rr = 0; rr < l.r; ++rr) s += h[t][rr] * ToF32<T>(b[rr * mod.n + cc]);
      y[t][cc] = FromF32<T>(ToF32<T>(y[t][cc]) + s);
    }
}
#endif

template <typename T, bool kAvx2>
JS_INLINE void LoraTask(const Lora& l, const LoraModule* mods, int64_t count, bool expand,
                        int64_t task) {
  if (!expand) {
    const int64_t mi = task / l.blocks;
#if JS_X86
    if constexpr (kAvx2) {
      if (l.r % 8 == 0) return Avx2ShrinkTask<T>(l, mods[mi], mi, task % l.blocks);
    }
#endif
    return LoraShrinkTask<T>(l, mods[mi], mi, task % l.blocks);
  }
  for (int64_t mi = 0; mi < count; ++mi) {
    const int64_t strips = CeilDiv(mods[mi].n, kLoraCols), tasks = strips * l.blocks;
    if (task < tasks) {
#if JS_X86
      if constexpr (kAvx2) return Avx2ExpandTask<T>(l, mods[mi], mi, task / strips,
                                                    task % strips);
#endif
      return LoraExpandTask<T>(l, mods[mi], mi, task / strips, task % strips);
    }
    task -= tasks;
  }
}

void ScalarLoraTask(const Lora& l, const LoraModule* mods, int64_t count, bool expand,
                    int64_t task) {
  l.bf16 ? LoraTask<uint16_t, false>(l, mods, count, expand, task)
         : LoraTask<float, false>(l, mods, count, expand, task);
}
#if JS_X86
JS_AVX2 void Avx2LoraTask(const Lora& l, const LoraModule* mods, int64_t count, bool expand,
                          int64_t task) {
  l.bf16 ? LoraTask<uint16_t, true>(l, mods, count, expand, task)
         : LoraTask<float, true>(l, mods, count, expand, task);
}
#endif

// The delta of every module, added to its y in place. slots: [T], 1-based (0: none).
void LoraAdd(const Runner& run, const void* x, int64_t t_all, int64_t k, int64_t r, int64_t g,
             bool bf16, const int32_t* slots, const LoraModule* mods, int64_t count) {
  std::vector<int64_t> start(g + 1, 0);  // counting sort of the adapter tokens by slot
  for (int64_t t = 0; t < t_all; ++t)
    if (slots[t] >= 1 && slots[t] <= g) ++start[slots[t]];
  for (int64_t s = 1; s <= g; ++s) start[s] += start[s - 1];
  const int64_t active = start[g];
  if (active == 0 || count == 0 || r == 0) return;
  std::vector<int32_t> order(active);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < t_all; ++t)
    if (slots[t] >= 1 && slots[t] <= g) order[next[slots[t] - 1]++] = static_cast<int32_t>(t);
  std::vector<int64_t> block_start, block_len;
  std::vector<int32_t> block_slot;
  for (int64_t s = 0; s < g; ++s)
    for (int64_t i = start[s]; i < start[s + 1]; i += kLoraBlock) {
      block_start.push_back(i);
      block_len.push_back(std::min(kLoraBlock, start[s + 1] - i));
      block_slot.push_back(static_cast<int32_t>(s));
    }
  std::vector<float> h(static_cast<size_t>(count * active * r));
  const Lora l{x, k, r, g, bf16, order.data(), static_cast<int64_t>(block_start.size()),
               block_start.data(), block_len.data(), block_slot.data(), h.data(), active};
  int64_t expand_tasks = 0;
  for (int64_t i = 0; i < count; ++i) expand_tasks += CeilDiv(mods[i].n, kLoraCols) * l.blocks;
  const int isa = CurrentIsa();
  for (const bool expand : {false, true}) {
    const int64_t tasks = expand ? expand_tasks : count * l.blocks;
#if JS_X86
    if (isa >= kAvx2) {  // AVX-512 machines too: the tiles are small, 8 lanes serve them
      run.For(tasks, [&](int64_t i) { Avx2LoraTask(l, mods, count, expand, i); });
      continue;
    }
#endif
    (void)isa;
    run.For(tasks, [&](int64_t i) { ScalarLoraTask(l, mods, count, expand, i); });
  }
}

}  // namespace
}  // namespace jaxserve
