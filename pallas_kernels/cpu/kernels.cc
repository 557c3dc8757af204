// Native CPU kernels for jaxserve, called from jitted JAX code through the XLA FFI.
//
//   jaxserve_matmul                  y_i[M, N_i] = x[M, K] @ W_i for one or more weights
//                                    W_i [K, N_i] (or [N_i, K] with transpose_w), f32 x f32 or
//                                    bf16 x bf16, f32 accumulation, rows >= num_rows left
//                                    unwritten (no cost); few rows stream all weights at once.
//   jaxserve_ragged_paged_attention  the semantics of
//                                    pallas_kernels/ragged_paged_attention/reference.py.
//   jaxserve_write_kv                new tokens' K/V into the paged cache, in place
//                                    (kv_cache.write_kv).
//   jaxserve_rms_norm                RMSNorm of the real rows, optionally after adding the
//                                    residual (pallas_kernels/rows.py).
//   jaxserve_gated_act               act(gate) * up of the real rows (silu, tanh gelu).
//   jaxserve_lora                    y_i += x @ A_i[slot] @ B_i[slot] per token, in place
//                                    (LoRA adapters of a mixed batch).
//   jaxserve_quantized_matmul        y = x @ W for a few rows, W int8 or int4 (groups, zero
//                                    points) as pallas_kernels/quantized_matmul stores it.
//   jaxserve_top_k_top_p_cut         each row's top-k / top-p threshold on its logits /
//                                    temp (the sampler's filter_cut), without sorting the
//                                    rows.
//   jaxserve_argmax                  each row's greedy pick (the sampler's first_argmax).
//   jaxserve_draw                    each sampled row's draw from its weights (the
//                                    sampler's draw_from).
//
// One translation unit: this file holds the FFI handlers and includes each kernel's
// header (common.h, matmul.h, rows.h, attention.h, lora.h, quantized.h, sampling.h), so the kernels share
// one thread pool.
// The benchmarks' diagnostics are a library of their own (diagnostics.cc).
//
// See pallas_kernels/cpu/__init__.py for how it is built and loaded.

#include "common.h"
#include "matmul.h"
#include "rows.h"
#include "attention.h"
#include "lora.h"
#include "quantized.h"
#include "sampling.h"

namespace jaxserve {
namespace {

// ==========================================================================================
// FFI handlers
// ==========================================================================================

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> num_rows,
                      ffi::RemainingArgs ws, ffi::RemainingRets ys, bool transpose_w,
                      bool packed_w) {
  const auto xd = x.dimensions();
  const ffi::DataType dt = x.element_type();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("jaxserve_matmul: x must be 2-D");
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("jaxserve_matmul: x must be float32 or bfloat16");
  if (num_rows.element_count() != 1)
    return ffi::Error::InvalidArgument("jaxserve_matmul: num_rows must be a scalar");
  if (ws.size() == 0 || ws.size() != ys.size())
    return ffi::Error::InvalidArgument("jaxserve_matmul: one result per weight, at least one");
  const int64_t m_all = xd[0], k = xd[1];
  const int64_t m = std::clamp<int64_t>(num_rows.typed_data()[0], 0, m_all);
  std::vector<Mm> mms;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("jaxserve_matmul: bad weight or result");
    const auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != 2 || yd.size() != 2)
      return ffi::Error::InvalidArgument("jaxserve_matmul: w and y must be 2-D");
    if (w->element_type() != dt || (*y)->element_type() != dt)
      return ffi::Error::InvalidArgument(
          "jaxserve_matmul: x, w and y must all be float32 or all bfloat16");
    const int64_t n = transpose_w ? wd[0] : wd[1];
    if ((transpose_w ? wd[1] : wd[0]) != k || yd[0] != m_all || yd[1] != n)
      return ffi::Error::InvalidArgument("jaxserve_matmul: shapes do not match");
    if (packed_w && (!transpose_w || n % 64 != 0 || (dt == ffi::DataType::BF16 && k % 2 != 0)))
      return ffi::Error::InvalidArgument(
          "jaxserve_matmul: a packed w is [N, K] (transpose_w) with N a multiple of 64 "
          "and, in bfloat16, K even");
    mms.push_back(Mm{x.untyped_data(), w->untyped_data(), (*y)->untyped_data(), m, k, n,
                     transpose_w, dt == ffi::DataType::BF16, packed_w});
  }
  Runner run(&pool);
  Matmuls(run, mms.data(), static_cast<int64_t>(mms.size()));
  return ffi::Error::Success();
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                         ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> kv_lens,
                         ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                         ffi::Buffer<ffi::S32> num_seqs, ffi::AnyBuffer k_scales,
                         ffi::AnyBuffer v_scales, ffi::Buffer<ffi::S32> tree_start,
                         ffi::Buffer<ffi::S32> tree_mask, ffi::Buffer<ffi::F32> sinks,
                         ffi::Result<ffi::AnyBuffer> out, float sm_scale,
                         int64_t sliding_window, float soft_cap, int64_t queries_per_block) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("jaxserve_ragged_paged_attention: " + what);
  };
  const auto qd = q.dimensions(), kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4) return bad("q must be 3-D and the pages 4-D");
  if (k_pages.dimensions().size() != v_pages.dimensions().size() ||
      k_pages.element_type() != v_pages.element_type())
    return bad("k_pages and v_pages differ");
  for (size_t i = 0; i < 4; ++i)
    if (k_pages.dimensions()[i] != v_pages.dimensions()[i])
      return bad("k_pages and v_pages differ");
  const ffi::DataType qt = q.element_type(), kt = k_pages.element_type();
  if (qt != ffi::DataType::F32 && qt != ffi::DataType::BF16) return bad("q must be f32 or bf16");
  if (out->element_type() != qt || out->element_count() != q.element_count())
    return bad("out must match q");
  Attn a{};
  switch (kt) {
    case ffi::DataType::F32: a.kv = kKvF32; a.kv_esize = 4; break;
    case ffi::DataType::BF16:
    case ffi::DataType::U16:  // a bf16 pool kept as its bits (kv_cache.pool_dtype)
      a.kv = kKvBf16;
      a.kv_esize = 2;
      break;
    case ffi::DataType::S8: a.kv = kKvS8; a.kv_esize = 1; break;
    case ffi::DataType::F8E4M3FN: a.kv = kKvF8; a.kv_esize = 1; break;
    default: return bad("pages must be f32, bf16 (or its uint16 bits), int8 or float8_e4m3fn");
  }
  a.T = qd[0];
  a.hq = qd[1];
  a.d = qd[2];
  a.hkv = kd[0];
  a.num_pages = kd[1];
  a.page_size = kd[2];
  if (kd[3] != a.d) return bad("head_dim of q and pages differ");
  if (a.hkv <= 0 || a.hq % a.hkv != 0) return bad("q heads must be a multiple of kv heads");
  a.group = a.hq / a.hkv;
  const auto pd = page_indices.dimensions();
  if (pd.size() != 2) return bad("page_indices must be 2-D");
  a.max_seqs = pd[0];
  a.pps = pd[1];
  if (kv_lens.element_count() != static_cast<size_t>(a.max_seqs) ||
      cu_q_lens.element_count() != static_cast<size_t>(a.max_seqs + 1) ||
      num_seqs.element_count() != 1)
    return bad("kv_lens, cu_q_lens or num_seqs has the wrong size");
  const bool quant = a.kv == kKvS8 || a.kv == kKvF8;
  if (quant) {
    const size_t n = static_cast<size_t>(a.hkv * a.num_pages * a.page_size);
    if (k_scales.element_type() != ffi::DataType::F32 ||
        v_scales.element_type() != ffi::DataType::F32 || k_scales.element_count() != n ||
        v_scales.element_count() != n)
      return bad("an 8-bit cache needs f32 k_scales and v_scales [kv_heads, pages, page_size]");
    a.ks = static_cast<const float*>(k_scales.untyped_data());
    a.vs = static_cast<const float*>(v_scales.untyped_data());
  }
  a.q = q.untyped_data();
  a.q_bf16 = qt == ffi::DataType::BF16;
  a.k = k_pages.untyped_data();
  a.v = v_pages.untyped_data();
  a.kv_lens = kv_lens.typed_data();
  a.pages = page_indices.typed_data();
  a.cu = cu_q_lens.typed_data();
  a.out = out->untyped_data();
  a.sm_scale = sm_scale;
  a.soft_cap = soft_cap > 0.0f ? soft_cap : 0.0f;
  a.window = sliding_window > 0 ? sliding_window : 0;
  if (tree_start.element_count() > 0 || tree_mask.element_count() > 0) {
    if (tree_start.element_count() != static_cast<size_t>(a.max_seqs) ||
        tree_mask.element_count() != static_cast<size_t>(a.T))
      return bad("tree_start must be [S] and tree_mask [T] (both empty: no trees)");
    a.tree_start = tree_start.typed_data();
    a.tree_mask = tree_mask.typed_data();
  }
  if (sinks.element_count() > 0) {
    if (sinks.element_count() != static_cast<size_t>(a.hq))
      return bad("sinks must be f32 [q_heads] (empty: no sinks)");
    a.sinks = sinks.typed_data();
  }
  if (a.T == 0 || a.hq == 0 || a.d == 0) return ffi::Error::Success();
  if (a.num_pages == 0 || a.page_size == 0 || a.pps == 0) {
    std::memset(a.out, 0, out->size_bytes());
    return ffi::Error::Success();
  }
  Runner run(&pool);
  Attention(run, a, num_seqs.typed_data()[0], queries_per_block);
  return ffi::Error::Success();
}

// K/V write: token t's [num_kv_heads, head_dim] rows of k and v go to flat slot
// slot_mapping[t] (page * page_size + row) of every head's pages, in place (the results
// alias the pages); slots outside the pool (padding) are skipped. Bytes are copied as they
// are: the caller casts the new rows to the pool's dtype first.
ffi::Error WriteKvImpl(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("jaxserve_write_kv: " + what);
  };
  const auto pd = k_pages.dimensions(), xd = k.dimensions();
  if (pd.size() != 4 || xd.size() != 3) return bad("pages must be 4-D and new K/V 3-D");
  for (size_t i = 0; i < 4; ++i)
    if (v_pages.dimensions()[i] != pd[i]) return bad("k_pages and v_pages differ");
  for (size_t i = 0; i < 3; ++i)
    if (v.dimensions()[i] != xd[i]) return bad("k and v differ");
  // New K/V in the pages' dtype, or bf16 into a pool of their uint16 bits (copied as bits).
  const ffi::DataType dt = k_pages.element_type();
  auto fits = [dt](ffi::DataType x) {
    return x == dt || (dt == ffi::DataType::U16 && x == ffi::DataType::BF16);
  };
  if (v_pages.element_type() != dt || !fits(k.element_type()) ||
      v.element_type() != k.element_type())
    return bad("pages and new K/V must share one dtype (or bf16 K/V into uint16 pages)");
  const int64_t heads = pd[0], slots = pd[1] * pd[2], d = pd[3], T = xd[0];
  if (xd[1] != heads || xd[2] != d) return bad("new K/V must be [T, num_kv_heads, head_dim]");
  if (slot_mapping.element_count() != static_cast<size_t>(T))
    return bad("slot_mapping must hold one slot per token");
  const size_t row = static_cast<size_t>(d) * (k_pages.size_bytes() / k_pages.element_count());
  const std::pair<const ffi::AnyBuffer*, ffi::AnyBuffer*> pairs[2] = {
      {&k_pages, &*k_out}, {&v_pages, &*v_out}};
  const ffi::AnyBuffer* news[2] = {&k, &v};
  const int32_t* slot = slot_mapping.typed_data();
  for (int i = 0; i < 2; ++i) {
    char* dst = static_cast<char*>(pairs[i].second->untyped_data());
    if (dst != pairs[i].first->untyped_data())  // not aliased: start from the pages
      std::memcpy(dst, pairs[i].first->untyped_data(), pairs[i].first->size_bytes());
    const char* src = static_cast<const char*>(news[i]->untyped_data());
    for (int64_t t = 0; t < T; ++t) {
      if (slot[t] < 0 || slot[t] >= slots) continue;
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(dst + (h * slots + slot[t]) * row, src + (t * heads + h) * row, row);
    }
  }
  return ffi::Error::Success();
}

// Row-wise ops: shapes and dtypes of [M, K] operands and results, the rows past num_rows
// left unwritten. `a` is x (norm) or the gate; `b` the residual (norm; empty: none) or up.
ffi::Error RowsImpl(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer w,
                    ffi::Buffer<ffi::S32> num_rows, ffi::RemainingRets outs, bool norm,
                    const char* name, RowsOp o) {
  auto bad = [&](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(name) + ": " + what);
  };
  const auto ad = a.dimensions();
  const ffi::DataType dt = a.element_type();
  if (ad.size() != 2) return bad("operands must be 2-D");
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16) return bad("f32 or bf16 only");
  if (num_rows.element_count() != 1) return bad("num_rows must be a scalar");
  const bool with_b = !norm || b.element_count() > 0;
  if (with_b && (b.element_type() != dt || b.element_count() != a.element_count()))
    return bad("the second operand must match the first");
  if (norm && (w.element_type() != dt || w.element_count() != static_cast<size_t>(ad[1])))
    return bad("the weight must be [K] in the operands' dtype");
  const size_t want = norm && with_b ? 2 : 1;
  if (outs.size() != want) return bad("wrong number of results");
  void* ys[2] = {nullptr, nullptr};
  for (size_t i = 0; i < want; ++i) {
    auto y = outs.get<ffi::AnyBuffer>(i);
    if (!y.has_value() || (*y)->element_type() != dt ||
        (*y)->element_count() != a.element_count())
      return bad("results must match the operands");
    ys[i] = (*y)->untyped_data();
  }
  const int64_t m_all = ad[0];
  o.k = ad[1];
  o.m = std::clamp<int64_t>(num_rows.typed_data()[0], 0, m_all);
  o.a = a.untyped_data();
  o.b = with_b ? b.untyped_data() : nullptr;
  o.w = w.untyped_data();
  o.y = ys[0];
  o.sum = ys[1];
  Runner run(&pool);
  Rows(run, o, norm, dt == ffi::DataType::BF16);
  return ffi::Error::Success();
}

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                       ffi::AnyBuffer w, ffi::Buffer<ffi::S32> num_rows, ffi::RemainingRets outs,
                       float eps, bool offset) {
  RowsOp o{};
  o.eps = eps;
  o.offset = offset;
  return RowsImpl(pool, x, residual, w, num_rows, outs, true, "jaxserve_rms_norm", o);
}

ffi::Error GatedActImpl(ffi::ThreadPool pool, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                        ffi::Buffer<ffi::S32> num_rows, ffi::RemainingRets outs, int64_t act) {
  if (act != kActSilu && act != kActGeluTanh)
    return ffi::Error::InvalidArgument("jaxserve_gated_act: act must be 0 (silu) or 1 (gelu)");
  RowsOp o{};
  o.act = static_cast<int>(act);
  return RowsImpl(pool, gate, up, gate, num_rows, outs, false, "jaxserve_gated_act", o);
}

ffi::Error RopeImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                    ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                    ffi::Buffer<ffi::S32> num_rows, ffi::Result<ffi::AnyBuffer> q_out,
                    ffi::Result<ffi::AnyBuffer> k_out) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("jaxserve_rope: " + what);
  };
  const auto qd = q.dimensions(), kd = k.dimensions();
  const ffi::DataType dt = q.element_type();
  if (qd.size() != 3 || kd.size() != 3) return bad("q and k must be [T, heads, D]");
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16) return bad("f32 or bf16 only");
  if (k.element_type() != dt || kd[0] != qd[0] || kd[2] != qd[2] || qd[2] % 2)
    return bad("k must match q's dtype, tokens and (even) head size");
  const int64_t m_all = qd[0], d = qd[2];
  if (cos.element_count() != static_cast<size_t>(m_all * d / 2) ||
      sin.element_count() != cos.element_count())
    return bad("cos and sin must be [T, D / 2]");
  if (num_rows.element_count() != 1) return bad("num_rows must be a scalar");
  if (q_out->element_type() != dt || q_out->element_count() != q.element_count() ||
      k_out->element_type() != dt || k_out->element_count() != k.element_count())
    return bad("results must match q and k");
  RopeOp o{};
  o.x[0] = q.untyped_data();
  o.x[1] = k.untyped_data();
  o.y[0] = q_out->untyped_data();
  o.y[1] = k_out->untyped_data();
  o.heads[0] = qd[1];
  o.heads[1] = kd[1];
  o.cos = cos.typed_data();
  o.sin = sin.typed_data();
  o.d = d;
  o.m = std::clamp<int64_t>(num_rows.typed_data()[0], 0, m_all);
  Runner run(&pool);
  Rope(run, o, dt == ffi::DataType::BF16);
  return ffi::Error::Success();
}

ffi::Error TopKTopPCutImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                           ffi::Buffer<ffi::F32> temp, ffi::Buffer<ffi::S32> top_k,
                           ffi::Buffer<ffi::F32> top_p, ffi::Result<ffi::Buffer<ffi::F32>> cut) {
  const auto d = logits.dimensions();
  if (d.size() != 2 || d[1] < 1)
    return ffi::Error::InvalidArgument("jaxserve_top_k_top_p_cut: logits must be [S, V]");
  const int64_t s = d[0];
  if (temp.element_count() != static_cast<size_t>(s) ||
      top_k.element_count() != static_cast<size_t>(s) ||
      top_p.element_count() != static_cast<size_t>(s) ||
      cut->element_count() != static_cast<size_t>(s))
    return ffi::Error::InvalidArgument("jaxserve_top_k_top_p_cut: temp, top_k, top_p, cut [S]");
  Runner run(&pool);
  TopKTopPCuts(run, logits.typed_data(), s, d[1], temp.typed_data(), top_k.typed_data(),
               top_p.typed_data(), cut->typed_data());
  return ffi::Error::Success();
}

// Greedy picks: logits [S, V] (f32 or bf16) -> the first index of each row's maximum [S].
ffi::Error ArgmaxImpl(ffi::ThreadPool pool, ffi::AnyBuffer logits,
                      ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const auto d = logits.dimensions();
  const ffi::DataType dt = logits.element_type();
  if (d.size() != 2 || d[1] < 1 || (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16) ||
      out->element_count() != static_cast<size_t>(d[0]))
    return ffi::Error::InvalidArgument("jaxserve_argmax: logits [S, V] f32 or bf16, out [S]");
  Runner run(&pool);
  if (dt == ffi::DataType::F32) {
    ArgmaxRows(run, static_cast<const float*>(logits.untyped_data()), d[0], d[1],
               out->typed_data());
  } else {
    ArgmaxRows(run, static_cast<const uint16_t*>(logits.untyped_data()), d[0], d[1],
               out->typed_data());
  }
  return ffi::Error::Success();
}

// Sampled picks: logits [S, V] f32 and each row's temp, top, cut and u [S] -> [S].
ffi::Error DrawImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                    ffi::Buffer<ffi::F32> temp, ffi::Buffer<ffi::F32> top,
                    ffi::Buffer<ffi::F32> cut, ffi::Buffer<ffi::F32> u,
                    ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const auto d = logits.dimensions();
  const size_t s = d.size() == 2 ? static_cast<size_t>(d[0]) : 0;
  if (d.size() != 2 || d[1] < 1 || temp.element_count() != s || top.element_count() != s ||
      cut.element_count() != s || u.element_count() != s || out->element_count() != s)
    return ffi::Error::InvalidArgument(
        "jaxserve_draw: logits [S, V]; temp, top, cut, u and out [S]");
  Runner run(&pool);
  DrawRows(run, logits.typed_data(), d[0], d[1], temp.typed_data(), top.typed_data(),
           cut.typed_data(), u.typed_data(), out->typed_data());
  return ffi::Error::Success();
}

// LoRA: x [T, K], slots [T] (1-based; 0: no adapter), then (y_i [T, N_i], A_i [G, K, R],
// B_i [G, R, N_i]) per module; results y_i (aliased to the inputs y_i).
ffi::Error LoraImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> slots,
                    ffi::RemainingArgs args, ffi::RemainingRets ys) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("jaxserve_lora: " + what);
  };
  const auto xd = x.dimensions();
  const ffi::DataType dt = x.element_type();
  if (xd.size() != 2) return bad("x must be 2-D");
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16) return bad("x must be f32 or bf16");
  const int64_t t_all = xd[0], k = xd[1];
  if (slots.element_count() != static_cast<size_t>(t_all)) return bad("one slot per token");
  if (args.size() % 3 != 0 || args.size() / 3 != ys.size() || ys.size() == 0)
    return bad("arguments are (y, A, B) per module, one result per module");
  int64_t g = -1, r = -1;
  std::vector<LoraModule> mods;
  for (size_t i = 0; i < ys.size(); ++i) {
    auto y = args.get<ffi::AnyBuffer>(3 * i), a = args.get<ffi::AnyBuffer>(3 * i + 1),
         b = args.get<ffi::AnyBuffer>(3 * i + 2);
    auto out = ys.get<ffi::AnyBuffer>(i);
    if (!y.has_value() || !a.has_value() || !b.has_value() || !out.has_value())
      return bad("bad argument or result");
    const auto yd = y->dimensions(), ad = a->dimensions(), bd = b->dimensions();
    if (yd.size() != 2 || ad.size() != 3 || bd.size() != 3)
      return bad("y must be 2-D, A and B 3-D");
    if (y->element_type() != dt || a->element_type() != dt || b->element_type() != dt ||
        (*out)->element_type() != dt)
      return bad("x, y, A and B must share one dtype");
    if (g < 0) g = ad[0], r = ad[2];
    if (ad[0] != g || bd[0] != g || ad[2] != r || bd[1] != r || ad[1] != k || yd[0] != t_all ||
        bd[2] != yd[1] || (*out)->element_count() != y->element_count())
      return bad("shapes do not match: x [T, K], y [T, N], A [G, K, R], B [G, R, N]");
    void* dst = (*out)->untyped_data();
    if (dst != y->untyped_data())  // not aliased: start from y
      std::memcpy(dst, y->untyped_data(), y->size_bytes());
    mods.push_back(LoraModule{a->untyped_data(), b->untyped_data(), dst, yd[1]});
  }
  Runner run(&pool);
  LoraAdd(run, x.untyped_data(), t_all, k, r, g, dt == ffi::DataType::BF16, slots.typed_data(),
          mods.data(), static_cast<int64_t>(mods.size()));
  return ffi::Error::Success();
}

// Quantized matmul: x [M, K] (f32 / bf16), num_rows, expert, values (int8 [K, N] or uint8
// [K/2, N]), scales f32 ([G', N], or [2, G', N] with zero points; fp4's may be bf16, read
// as stored), both in strips of 32 columns when `packed` (quantized.h); y [M, N] in x's
// dtype, rows >= num_rows unwritten. Values and scales may be stacks of experts' weights
// ([E, ...] each, not packed): `expert` then picks the one multiplied, read in place (a
// grouped matmul's visit: no copy of the expert's weight).
ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                               ffi::Buffer<ffi::S32> num_rows, ffi::Buffer<ffi::S32> expert,
                               ffi::AnyBuffer values, ffi::AnyBuffer scales,
                               ffi::Result<ffi::AnyBuffer> y, bool packed, bool fp4) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("jaxserve_quantized_matmul: " + what);
  };
  const auto xd = x.dimensions();
  const bool stack = values.dimensions().size() == 3;
  // One expert's dimensions (the stack's without its leading one).
  const std::vector<int64_t> vd(values.dimensions().begin() + stack, values.dimensions().end()),
      sd(scales.dimensions().begin() + stack, scales.dimensions().end());
  const ffi::DataType dt = x.element_type();
  if (xd.size() != 2 || vd.size() != 2) return bad("x must be 2-D, values 2-D or a 3-D stack");
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16) return bad("x must be f32 or bf16");
  if (y->element_type() != dt) return bad("y must have x's dtype");
  const bool int4 = values.element_type() == ffi::DataType::U8;
  if (!int4 && values.element_type() != ffi::DataType::S8)
    return bad("values must be int8 or uint8 (int4, fp4)");
  if (fp4 && !int4) return bad("fp4 values are uint8, two e2m1 codes a byte");
  const bool zeros = sd.size() == 3;
  if (fp4 && zeros) return bad("fp4 has no zero points");
  const bool s_bf16 = scales.element_type() == ffi::DataType::BF16;
  if (!s_bf16 && scales.element_type() != ffi::DataType::F32)
    return bad("scales must be f32 (or bf16)");
  if (s_bf16 && zeros) return bad("bf16 scales take no zero points");
  if (sd.size() != 2 && !(zeros && sd[0] == 2))
    return bad("scales must be [G, N] (or [2, G, N] with zero points)");
  const int64_t k = xd[1], n = vd[1], groups = sd[sd.size() - 2];
  if ((int4 ? 2 * vd[0] : vd[0]) != k || sd[sd.size() - 1] != n || groups < 1 ||
      k % groups || (int4 && (k / groups) % 2))
    return bad("shapes do not match");
  if (num_rows.element_count() != 1 || expert.element_count() != 1)
    return bad("num_rows and expert must be scalars");
  const int64_t m = std::clamp<int64_t>(num_rows.typed_data()[0], 0, xd[0]);
  if (packed && (n % kQmmCols || stack)) return bad("packed values need N a multiple of 32 "
                                                     "and one weight, not a stack");
  int64_t e = 0;
  if (stack) {
    const int64_t experts = values.dimensions()[0];
    if (scales.dimensions().size() != sd.size() + 1 || scales.dimensions()[0] != experts)
      return bad("a stack's values and scales must have its experts first");
    e = std::clamp<int64_t>(expert.typed_data()[0], 0, experts - 1);
  }
  const int64_t s_size = static_cast<int64_t>(sd.size() == 3 ? 2 : 1) * groups * n;
  const char* w = static_cast<const char*>(values.untyped_data()) + e * vd[0] * vd[1];
  const char* s = static_cast<const char*>(scales.untyped_data()) +
                  e * s_size * (s_bf16 ? 2 : 4);
  const float* z = zeros ? reinterpret_cast<const float*>(s) + groups * n : nullptr;
  Qmm q{nullptr, nullptr, w, s, z, y->untyped_data(),
        m, k, n, k / groups, int4, dt == ffi::DataType::BF16, packed, fp4, s_bf16};
  std::vector<float> xf, sums;
  Runner run(&pool);
  QuantizedMatmul(run, x.untyped_data(), q, xf, sums);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedMatmul, jaxserve::QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("packed")
                                  .Attr<bool>("fp4"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, jaxserve::MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<bool>("transpose_w")
                                  .Attr<bool>("packed_w"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttention, jaxserve::AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("queries_per_block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKv, jaxserve::WriteKvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRmsNorm, jaxserve::RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<float>("eps")
                                  .Attr<bool>("offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGatedAct, jaxserve::GatedActImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<int64_t>("act"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRope, jaxserve::RopeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveLora, jaxserve::LoraImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveTopKTopPCut, jaxserve::TopKTopPCutImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveArgmax, jaxserve::ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDraw, jaxserve::DrawImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// Instruction-set control for tests: the level the kernels run at (0 scalar, 1 AVX2+FMA,
// 2 AVX-512, 3 AVX-512 + BF16), capped at what the CPU has. Returns the level now in force.
extern "C" int jaxserve_cpu_set_max_isa(int level) {
  jaxserve::g_max_isa.store(level, std::memory_order_relaxed);
  return jaxserve::CurrentIsa();
}

extern "C" int jaxserve_cpu_isa() { return jaxserve::CurrentIsa(); }
