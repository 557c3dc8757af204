"""On-device sampling: exact filter masks, the sampling distribution, seeds, penalties."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llguidance.numpy import apply_token_bitmask_inplace

import jaxserve.engine.sampler as sampler
from jaxserve.engine.sampler import (SampledDrafts, SamplingArrays, TokenHistory,
                                     apply_grammar_mask, apply_penalties, draw_drafts,
                                     filter_logits, first_argmax, inverse_cdf, sample,
                                     two_level_argmax)
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS


def arrays(n, **kw) -> SamplingArrays:
    base = dict(temperature=np.ones(n, np.float32), top_k=np.zeros(n, np.int32),
                top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32),
                presence_penalty=np.zeros(n, np.float32), frequency_penalty=np.zeros(n, np.float32),
                repetition_penalty=np.ones(n, np.float32), seed=np.arange(n, dtype=np.uint32),
                output_index=np.zeros(n, np.int32),
                banned_ids=np.full((n, MAX_STOP_TOKEN_IDS), -1, np.int32),
                logprobs=np.ones(n, np.bool_),
                bias_ids=np.full((n, MAX_LOGIT_BIAS), -1, np.int32),
                bias_values=np.zeros((n, MAX_LOGIT_BIAS), np.float32),
                grammar_mask=np.full((n, 32), -1, np.int32),  # vocabularies up to 1024
                draft_index=np.full(n, -1, np.int32), shift_row=np.full(n, -1, np.int32),
                group_drafts=np.zeros(n, np.int32))
    for k, v in kw.items():
        base[k] = np.asarray(v, base[k].dtype)
    return SamplingArrays(**base)


PROBS = np.array([0.5, 0.3, 0.15, 0.05])  # distinct, sums to 1


def kept(logits, **params) -> list[list[int]]:
    out = np.asarray(jax.jit(filter_logits)(jnp.asarray(logits, jnp.float32),
                                            arrays(len(logits), **params)))
    return [np.flatnonzero(np.isfinite(row)).tolist() for row in out]


def test_top_k_top_p_min_p_masks_are_exact():
    logits = np.log(np.tile(PROBS, (6, 1)))
    got = kept(logits,
               top_k=[0, 3, 1, 0, 0, 2],
               top_p=[1.0, 1.0, 1.0, 0.7, 0.85, 0.9],
               min_p=[0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    # row 3: mass before token 2 is 0.8 >= 0.7, so the nucleus is {0, 1};
    # row 5: top-2 renormalised is [0.625, 0.375]: both stay under top_p=0.9.
    assert got == [[0, 1, 2, 3], [0, 1, 2], [0], [0, 1], [0, 1, 2], [0, 1]]
    # min_p: keep probs >= min_p * max prob (0.5): floors 0.1 and 0.35.
    assert kept(np.log(np.tile(PROBS, (2, 1))), min_p=[0.2, 0.7]) == [[0, 1, 2], [0]]


def test_temperature_sampling_follows_softmax():
    """Chi-square of 8000 seeded draws against softmax(logits / T): df=7, 0.1% level 24.32."""
    n, temp = 8000, 0.7
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0], np.float32)
    out = jax.jit(sample)(jnp.tile(logits, (n, 1)), arrays(n, temperature=np.full(n, temp)), None)
    counts = np.bincount(np.asarray(out.token_ids), minlength=8)
    expected = n * np.exp(logits / temp) / np.exp(logits / temp).sum()
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 24.32, (counts, expected.round())
    # The same draws against the untempered softmax must be rejected (the test has power).
    wrong = n * np.exp(logits) / np.exp(logits).sum()
    assert ((counts - wrong) ** 2 / wrong).sum() > 100


@pytest.mark.parametrize("argmax", [first_argmax, two_level_argmax])
def test_argmax_is_numpys_first_index_of_the_maximum(argmax):
    """Across block edges (128 tokens), a vocabulary that is not a multiple of the block,
    ties (the first wins, as np.argmax), -inf everywhere but one token. first_argmax is
    the native kernel on a CPU (test_cpu_kernels.py tests it at every instruction set)."""
    rng = np.random.default_rng(7)
    v = 300
    logits = rng.integers(-3, 3, size=(8, v)).astype(np.float32)  # many ties
    logits[1, :] = -np.inf
    logits[1, 299] = 0.0  # in the padded last block
    logits[2, [127, 128]] = 9.0  # a tie across a block edge
    logits[3, :] = -np.inf
    logits[3, [5, 256]] = [-1.0, 2.0]
    got = np.asarray(jax.jit(argmax)(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert got[2] == 127


def test_inverse_cdf_draws_by_weight_and_never_a_zero_weight_token():
    """Chi-square of 6000 draws over 300 tokens (3 blocks, the last padded) whose weight
    sits on 8 tokens at block edges (0, 127, 128, 255, 256, 299 ...): df=7, 0.1% level
    24.32; every draw has positive weight; uniform weights over the 8 are rejected."""
    n, v = 6000, 300
    support = np.array([0, 1, 127, 128, 200, 255, 256, 299])
    w = np.zeros(v, np.float32)
    w[support] = [8.0, 1.0, 4.0, 2.0, 0.5, 6.0, 3.0, 5.5]
    u = np.random.default_rng(3).uniform(size=n).astype(np.float32)
    u = np.maximum(u, np.finfo(np.float32).tiny)
    got = np.asarray(jax.jit(inverse_cdf)(jnp.tile(jnp.asarray(w), (n, 1)), jnp.asarray(u)))
    assert set(got.tolist()) <= set(support.tolist())
    counts = np.array([(got == t).sum() for t in support])
    expected = n * w[support] / w.sum()
    assert ((counts - expected) ** 2 / expected).sum() < 24.32, (counts, expected.round())
    uniform = np.full(8, n / 8)
    assert ((counts - uniform) ** 2 / uniform).sum() > 100
    # u at the extremes picks the first and the last token of positive weight.
    ends = jax.jit(inverse_cdf)(jnp.tile(jnp.asarray(w), (2, 1)),
                                jnp.asarray([np.finfo(np.float32).tiny, 1.0], np.float32))
    assert np.asarray(ends).tolist() == [0, 299]


def test_seeded_draw_independent_of_batch():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 50)).astype(np.float32)
    params = dict(temperature=[0.9, 1.2, 0.0, 0.5, 1.0], top_p=[0.9, 1, 1, 0.8, 1],
                  seed=[11, 22, 33, 44, 55], output_index=[3, 0, 1, 7, 2])
    batch = np.asarray(jax.jit(sample)(jnp.asarray(logits), arrays(5, **params), None).token_ids)
    for i in range(5):
        alone = arrays(1, **{k: [v[i]] for k, v in params.items()})
        got = jax.jit(sample)(jnp.asarray(logits[i:i + 1]), alone, None).token_ids
        assert int(got[0]) == batch[i]
    # A different output index (the next position) gives an independent draw stream.
    draws = {int(jax.jit(sample)(jnp.asarray(logits[:1]), arrays(
        1, temperature=[1.0], seed=[11], output_index=[k]), None).token_ids[0]) for k in range(20)}
    assert len(draws) > 3


@pytest.mark.parametrize("num_rows,chunk_above", [(1, None), (5, None), (20, None), (20, 0)])
def test_only_the_real_rows_are_sampled(num_rows, chunk_above, monkeypatch):
    """A 32-row batch with `num_rows` real sequences samples them in a tier of 1 or 8 rows
    (all 32 past 8; 8 at a time where the logits pass CHUNK_ABOVE_BYTES): the real rows'
    tokens and logprobs are those of sampling every row at once (logprobs to float32
    rounding); padding rows are not sampled when a tier holds the real ones (zeros, where
    sampling them gives other tokens)."""
    if chunk_above is not None:
        monkeypatch.setattr(sampler, "CHUNK_ABOVE_BYTES", chunk_above)
    rng = np.random.default_rng(num_rows)
    logits = jnp.asarray(rng.standard_normal((32, 300)).astype(np.float32) * 3)
    p = arrays(32, temperature=rng.choice([0.0, 0.7, 1.3], 32), seed=rng.integers(0, 99, 32),
               top_p=rng.choice([1.0, 0.9], 32))
    every = jax.jit(sampler._sample)(logits, p, None)
    tiered = jax.jit(lambda *a: sample(*a))(logits, p, None, jnp.int32(num_rows))  # traced anew
    for name in ("token_ids", "top_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(tiered, name))[:num_rows],
                                      np.asarray(getattr(every, name))[:num_rows])
    for name in ("logprob", "top_logprobs"):  # log_softmax vectorised over fewer rows: 1 ulp
        np.testing.assert_allclose(np.asarray(getattr(tiered, name))[:num_rows],
                                   np.asarray(getattr(every, name))[:num_rows], rtol=1e-6)
    padding = np.asarray(tiered.token_ids)[8 if num_rows > 1 else 1:]
    assert (padding == 0).all() == (num_rows <= 8)
    assert np.asarray(every.token_ids)[8:].any()


@pytest.mark.parametrize("touched", [None, "bias", "ban", "grammar", "logprobs"])
def test_a_greedy_batch_past_the_chunk_size(touched, monkeypatch):
    """Logits past CHUNK_ABOVE_BYTES: a greedy batch of untouched rows without logprobs is
    sampled in one piece, any other in chunks of 8 rows; either way each row's token is
    numpy's argmax of its logits after the one row's bias, ban or grammar mask, and a
    row's logprob (when asked) is its log-softmax's."""
    monkeypatch.setattr(sampler, "CHUNK_ABOVE_BYTES", 0)
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((32, 300)).astype(np.float32)
    want = logits.argmax(axis=1)
    kw = dict(temperature=np.zeros(32), logprobs=np.zeros(32, bool))
    if touched == "bias":
        kw["bias_ids"] = np.full((32, MAX_LOGIT_BIAS), -1)
        kw["bias_ids"][3, 0], kw["bias_values"] = 7, np.zeros((32, MAX_LOGIT_BIAS))
        kw["bias_values"][3, 0] = 100.0
        want[3] = 7
    elif touched == "ban":
        kw["banned_ids"] = np.full((32, MAX_STOP_TOKEN_IDS), -1)
        kw["banned_ids"][3, 0] = want[3]
        want[3] = np.argsort(logits[3])[-2]
    elif touched == "grammar":
        kw["grammar_mask"] = np.full((32, 32), -1)
        kw["grammar_mask"][3] = 0
        kw["grammar_mask"][3, 5] = 1 << 9  # token 169 only
        want[3] = 169
    elif touched == "logprobs":
        kw["logprobs"][3] = True
    out = jax.jit(lambda *a: sample(*a))(jnp.asarray(logits), arrays(32, **kw), None,
                                         jnp.int32(32))
    np.testing.assert_array_equal(np.asarray(out.token_ids), want)
    if touched == "logprobs":
        logp = jax.nn.log_softmax(logits[3])
        np.testing.assert_allclose(float(out.logprob[3]), logp[want[3]], rtol=1e-6)


def test_greedy_bans_and_logprobs():
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 0.0, 0.0]], np.float32)
    banned = np.full((2, MAX_STOP_TOKEN_IDS), -1, np.int32)
    banned[0, 0] = 1  # row 0 may not pick its argmax
    out = jax.jit(sample)(jnp.asarray(logits), arrays(2, temperature=[0, 0], banned_ids=banned), None)
    assert np.asarray(out.token_ids).tolist() == [3, 0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(out.logprob, [logp[0, 3], logp[1, 0]], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.top_ids)[0, :4], [1, 3, 2, 0])
    np.testing.assert_allclose(np.asarray(out.top_logprobs)[0, :4], np.sort(logp[0])[::-1], rtol=1e-6)
    # Logprobs are computed when any row asks (for every row), and skipped when none does:
    # the tokens do not change.
    one = jax.jit(sample)(jnp.asarray(logits), arrays(2, temperature=[0, 0], banned_ids=banned,
                                                     logprobs=[False, True]), None)
    np.testing.assert_allclose(one.logprob, out.logprob, rtol=1e-6)
    none = jax.jit(sample)(jnp.asarray(logits), arrays(2, temperature=[0, 0], banned_ids=banned,
                                                      logprobs=[False, False]), None)
    assert np.asarray(none.token_ids).tolist() == [3, 0]
    assert not np.asarray(none.logprob).any() and not np.asarray(none.top_ids).any()


def test_logit_bias_moves_the_pick_but_not_the_logprobs():
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 0.0, 0.0]], np.float32)
    ids = np.full((2, MAX_LOGIT_BIAS), -1, np.int32)
    values = np.zeros((2, MAX_LOGIT_BIAS), np.float32)
    ids[0, :2], values[0, :2] = [2, 1], [2.5, -1.0]  # row 0: 1 -> 2.0, 2 -> 3.5: picks 2
    ids[1, 0], values[1, 0] = 3, 100.0  # row 1: token 3 wins
    out = jax.jit(sample)(jnp.asarray(logits), arrays(2, temperature=[0, 0], bias_ids=ids,
                                                     bias_values=values), None)
    assert np.asarray(out.token_ids).tolist() == [2, 3]
    logp = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(out.logprob, [logp[0, 2], logp[1, 3]], rtol=1e-6)
    # -100 on every likely token of a sampled row leaves the rest
    values[1, 0] = -100.0
    ids[1, 1:3], values[1, 1:3] = [0, 1], [-100.0, -100.0]
    out = jax.jit(sample)(jnp.asarray(logits), arrays(2, temperature=[1, 1], bias_ids=ids,
                                                     bias_values=values), None)
    assert int(out.token_ids[1]) == 2


def test_grammar_mask_wins_over_logit_bias_and_bans():
    """A +100 bias never lets a token the grammar rules out be picked or drawn; bias and
    bans act on the allowed tokens; logprobs are the masked distribution's (no bias)."""
    v = 8
    logits = np.array([[4.0, 0.0, 1.0, 3.0, 0.5, 2.0, 0.0, 1.5]] * 2, np.float32)
    bits = np.zeros((2, 32), bool)
    bits[:, [2, 4, 5, 7]] = True  # allowed; 0 (the raw argmax) and 3 are not
    mask = np.packbits(bits[:, ::-1], axis=-1).view(">u4").astype(np.uint32).view(np.int32)
    mask = np.pad(mask.reshape(2, 1), ((0, 0), (0, 31)), constant_values=-1)
    ids = np.full((2, MAX_LOGIT_BIAS), -1, np.int32)
    values = np.zeros((2, MAX_LOGIT_BIAS), np.float32)
    ids[:, :2], values[:, :2] = [3, 4], [100.0, 2.0]  # 3 is ruled out; 4 -> 2.5
    banned = np.full((2, MAX_STOP_TOKEN_IDS), -1, np.int32)
    banned[:, 0] = 5  # the best allowed token
    params = dict(grammar_mask=mask, bias_ids=ids, bias_values=values, banned_ids=banned,
                  seed=[0, 1])
    greedy = jax.jit(sample)(jnp.asarray(logits), arrays(2, temperature=[0, 0], **params), None)
    assert np.asarray(greedy.token_ids).tolist() == [4, 4]  # not 3 (103), 5 (banned), 7
    masked = np.where(bits[:, :v], logits, -np.inf)
    logp = masked - np.log(np.exp(masked - masked.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - masked.max(-1, keepdims=True)
    np.testing.assert_allclose(greedy.logprob, logp[:, 4], rtol=1e-6)
    drawn = set()
    for seed in range(40):
        out = jax.jit(sample)(jnp.asarray(logits), arrays(
            2, temperature=[1, 1], **{**params, "seed": [2 * seed, 2 * seed + 1]}), None)
        drawn |= set(np.asarray(out.token_ids).tolist())
    assert drawn <= {2, 4, 7} and len(drawn) > 1


def test_penalties_exact():
    logits = jnp.array([[2.0, -2.0, 1.0, 0.5, 3.0]])
    # prompt = [0, 1]; generated = [2, 2, 3]
    hist = TokenHistory(tokens=jnp.array([[0, 1, 2, 2, 3, -1]]), prompt_lens=jnp.array([2]))
    p = arrays(1, repetition_penalty=[2.0], frequency_penalty=[0.5], presence_penalty=[0.25])
    got = np.asarray(apply_penalties(logits, p, hist))[0]
    want = [2.0 / 2, -2.0 * 2, 1.0 / 2 - 0.5 * 2 - 0.25, 0.5 / 2 - 0.5 - 0.25, 3.0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_grammar_mask_against_numpy():
    """The packed [S, ceil(V/32)] bitmask, unpacked on device, rules out exactly the tokens
    llguidance's own numpy reference does; greedy picks the best allowed token, sampling
    draws only allowed ones, and logprobs are the masked distribution's."""
    rng = np.random.default_rng(0)
    s, v = 6, 100  # 100 tokens: the last word of each row is partly past the vocabulary
    logits = rng.normal(size=(s, v)).astype(np.float32) * 3
    words = (v + 31) // 32
    bits = rng.random((s, words * 32)) < 0.3
    bits[0] = True  # a row without a grammar
    bits[1] = False
    bits[1, 57] = True  # one allowed token, not the row's best
    bits[2, :v] = False
    bits[2, [3, 99]] = True  # the last token of the vocabulary
    mask = np.packbits(bits.reshape(s, words, 32)[:, :, ::-1], axis=-1).view(">u4")
    mask = mask.reshape(s, words).astype(np.uint32).view(np.int32)
    want = logits.copy()
    apply_token_bitmask_inplace(want, mask)
    got = np.asarray(jax.jit(apply_grammar_mask)(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(want[0]).all() and np.flatnonzero(np.isfinite(want[1])).tolist() == [57]
    # No row masked: the logits pass through untouched.
    open_mask = np.full((s, words), -1, np.int32)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(apply_grammar_mask)(jnp.asarray(logits), jnp.asarray(open_mask))),
        logits)

    allowed = np.isfinite(want)
    mask = np.pad(mask, ((0, 0), (0, 32 - words)), constant_values=-1)  # arrays()' width
    greedy = jax.jit(sample)(jnp.asarray(logits), arrays(s, temperature=np.zeros(s),
                                                        grammar_mask=mask), None)
    np.testing.assert_array_equal(np.asarray(greedy.token_ids), want.argmax(-1))
    ref_logprobs = want - np.log(np.exp(want - want.max(-1, keepdims=True)).sum(-1,
                                 keepdims=True)) - want.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(greedy.logprob),
                               ref_logprobs[np.arange(s), want.argmax(-1)], atol=1e-5)
    top = np.asarray(greedy.top_ids)
    for row in range(s):
        k = min(allowed[row].sum(), top.shape[1])
        assert allowed[row, top[row, :k]].all()
    for seed in range(20):
        drawn = jax.jit(sample)(jnp.asarray(logits), arrays(s, seed=np.full(s, seed),
                                                            grammar_mask=mask), None)
        assert allowed[np.arange(s), np.asarray(drawn.token_ids)].all()


def _chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the tokens' counts against `probs` (each token of positive probability
    expected >= 5 times); 0 if a token of probability 0 comes up."""
    import scipy.stats

    counts = np.bincount(tokens, minlength=len(probs))
    some = np.asarray(probs) > 0
    if counts[~some].any():
        return 0.0
    expected = np.asarray(probs, np.float64)[some]
    return scipy.stats.chisquare(counts[some], expected / expected.sum() * len(tokens)).pvalue


# A target distribution p and a draft distribution q far from it (q's favourite is p's
# least likely; a token only q has, one only p has).
P = np.array([0.30, 0.25, 0.20, 0.10, 0.10, 0.05, 0.0, 0.0])
Q_LOGITS = np.log(np.array([0.05, 0.10, 0.10, 0.15, 0.02, 0.40, 0.18, 1e-12]))


def _verify(n: int, temperature: float = 1.0):
    """n rows of p (at `temperature`, top-k 6: p's tokens 6, 7 out, q's 4, 7), each
    verifying a draft drawn from q for the same output number (the same parameters and
    seed, its own key): (drafts, q rows, tokens)."""
    params = dict(temperature=np.full(n, temperature), top_k=np.full(n, 6),
                  output_index=np.full(n, 3))
    q_logits = jnp.tile(jnp.asarray(Q_LOGITS, jnp.float32), (n, 1))
    drafts, q = draw_drafts(q_logits, arrays(n, **{**params, "output_index": np.full(n, 1)}),
                            2)
    logits = jnp.tile(jnp.asarray(np.log(P + 1e-30) * temperature, jnp.float32), (n, 1))
    out = sample(logits, arrays(n, **params, draft_index=np.arange(n)), None,
                 drafts=SampledDrafts(drafts, q))
    return np.asarray(drafts), np.asarray(q), np.asarray(out.token_ids)


def test_drafts_drawn_from_q_and_verified_by_rejection_sampling_follow_p():
    """Drafts follow q (with the request's temperature and top-k applied to it, as its
    returned rows say); the verified tokens follow p whatever q is, a draft kept exactly
    when the token equals it, at the rate sum(min(p, q)) the rule promises."""
    n = 20000
    drafts, q, tokens = _verify(n, temperature=0.5)
    want_q = np.exp(Q_LOGITS / 0.5) * [1, 1, 1, 1, 0, 1, 1, 0]  # q's top 6
    want_q /= want_q.sum()
    np.testing.assert_allclose(q[0], want_q, rtol=1e-5, atol=1e-7)
    assert _chi_square(drafts, q[0]) > 1e-3
    assert _chi_square(tokens, P) > 1e-3
    assert not np.isin(tokens, [6, 7]).any()
    kept = (tokens == drafts).mean()
    assert abs(kept - np.minimum(P, q[0]).sum()) < 0.015, kept


def test_drafts_distribution_takes_the_rows_bias_and_bans():
    """q applies the row's logit bias and banned tokens as the target's row does, also for
    a proposer with a vocabulary of its own (its columns, target tokens 1, 3, 5, 6)."""
    n = 2
    bias_ids = np.full((n, MAX_LOGIT_BIAS), -1)
    bias_values = np.zeros((n, MAX_LOGIT_BIAS))
    bias_ids[:, :2], bias_values[:, :2] = [3, 6], [1.5, -2.0]
    banned = np.full((n, MAX_STOP_TOKEN_IDS), -1)
    banned[:, 0] = 5
    params = arrays(n, bias_ids=bias_ids, bias_values=bias_values, banned_ids=banned)
    adjusted = Q_LOGITS + np.array([0, 0, 0, 1.5, 0, -np.inf, -2.0, 0])

    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    q_logits = jnp.tile(jnp.asarray(Q_LOGITS, jnp.float32), (n, 1))
    _, q = draw_drafts(q_logits, params, 0)
    np.testing.assert_allclose(np.asarray(q[0]), softmax(adjusted), rtol=1e-5, atol=1e-7)
    columns = np.array([1, 3, 5, 6])
    _, q = draw_drafts(q_logits[:, :4], params, 0, jnp.asarray(columns), len(Q_LOGITS))
    np.testing.assert_allclose(np.asarray(q[0]), softmax(Q_LOGITS[:4] + adjusted[columns]
                                                         - Q_LOGITS[columns]),
                               rtol=1e-5, atol=1e-7)


def test_a_wrong_residual_fails_the_rejection_sampling_test(monkeypatch):
    """Drawing a rejected draft's replacement from p instead of max(0, p - q): the tokens
    no longer follow p, and the same test says so."""
    def wrong(weights, q, drafts, u, u_residual):
        p = weights / weights.sum(axis=-1, keepdims=True)
        p_d = jnp.take_along_axis(p, drafts[:, None], axis=-1)[:, 0]
        q_d = jnp.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
        return jnp.where(u * q_d < p_d, drafts, inverse_cdf(p, u_residual))

    monkeypatch.setattr(sampler, "verify_drafts", wrong)
    _, _, tokens = _verify(20000, temperature=0.5)
    assert _chi_square(tokens, P) < 1e-6


def test_greedy_rows_ignore_their_drafts_distributions():
    """A greedy row takes the argmax, whatever draft it verifies; draw_drafts' greedy
    guesses are argmaxes too."""
    n = 4
    logits = jnp.tile(jnp.asarray(np.log(P + 1e-30), jnp.float32), (n, 1))
    drafts, q = draw_drafts(jnp.tile(jnp.asarray(Q_LOGITS, jnp.float32), (n, 1)),
                            arrays(n, temperature=np.zeros(n)), 0)
    assert np.asarray(drafts).tolist() == [5] * n
    out = sample(logits, arrays(n, temperature=np.zeros(n), draft_index=np.arange(n)), None,
                 drafts=SampledDrafts(drafts, q))
    assert np.asarray(out.token_ids).tolist() == [0] * n


def _branches(fn, *args) -> int:
    """How many lax.cond / lax.switch the program of `fn(*args)` holds (StableHLO)."""
    text = jax.jit(fn).lower(*args).as_text()
    return text.count("stablehlo.case") + text.count("stablehlo.if")


@pytest.mark.parametrize("asks", [False, True])
def test_static_sampling_picks_what_the_device_branches_pick(asks):
    """sampler.Static, a GPU's programs (ModelRunner.branch_free): no lax.cond (XLA:GPU
    waits on the host for each), and the tokens and logprobs of the lax.cond path: FULL
    for any rows (top-k, top-p and logprobs asked or not), FAST for rows that ask for
    none of those three; greedy rows take numpy's argmax of their adjusted logits."""
    n, v = 16, 300
    rng = np.random.default_rng(11)
    logits = jnp.asarray(rng.standard_normal((n, v)).astype(np.float32) * 2)
    bias_ids = np.full((n, MAX_LOGIT_BIAS), -1)
    bias_values = np.zeros((n, MAX_LOGIT_BIAS))
    bias_ids[2, 0], bias_values[2, 0] = 17, 50.0
    banned = np.full((n, MAX_STOP_TOKEN_IDS), -1)
    banned[4, 0] = int(np.argmax(np.asarray(logits)[4]))
    mask = np.full((n, 32), -1)
    mask[5] = 0
    mask[5, 3] = 0b1010  # tokens 97 and 99
    kw = dict(temperature=rng.choice([0.0, 0.7, 1.3], n), seed=rng.integers(0, 99, n),
              min_p=rng.choice([0.0, 0.05], n), bias_ids=bias_ids, bias_values=bias_values,
              banned_ids=banned, grammar_mask=mask)
    kw["temperature"][[2, 4, 5]] = 0.0  # greedy rows with a bias, a ban, a grammar
    if asks:
        kw.update(top_k=rng.choice([0, 5], n), top_p=rng.choice([1.0, 0.8], n),
                  logprobs=rng.choice([False, True], n))
    else:
        kw.update(logprobs=np.zeros(n, bool))
    p = arrays(n, **kw)
    want = jax.jit(sample)(logits, p, None, jnp.int32(n))
    static = sampler.FULL if asks else sampler.FAST
    got = jax.jit(lambda *a: sample(*a, static=static))(logits, p, None, jnp.int32(n))
    for name in ("token_ids", "top_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                      np.asarray(getattr(want, name)))
    for name in ("logprob", "top_logprobs"):
        np.testing.assert_allclose(np.asarray(getattr(got, name)),
                                   np.asarray(getattr(want, name)), rtol=1e-6)
    adjusted = np.asarray(logits).copy()
    adjusted[2, 17] += 50.0
    adjusted[4, banned[4, 0]] = -np.inf
    adjusted[5, [t for t in range(v) if t not in (97, 99)]] = -np.inf
    greedy = np.asarray(kw["temperature"]) == 0
    np.testing.assert_array_equal(np.asarray(got.token_ids)[greedy],
                                  adjusted.argmax(axis=1)[greedy])
    assert np.asarray(got.logprob).any() == asks
    assert _branches(lambda *a: sample(*a, static=static), logits, p, None, jnp.int32(n)) == 0
    assert _branches(sample, logits, p, None, jnp.int32(n)) > 0


@pytest.mark.parametrize("asks", [False, True], ids=["fast", "sorts"])
def test_drafts_drawn_without_branches_are_the_branching_ones(asks):
    """draw_drafts with `sorts` settled by the host (a GPU's proposers: no lax.cond): the
    sampled rows' guesses and distributions of the lax.cond path (top-k and top-p rows
    with `sorts`, none without); greedy rows' guesses the argmax. A batch of greedy rows
    only draws the same guesses."""
    n, v = 12, 300
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.standard_normal((n, v)).astype(np.float32) * 2)
    kw = dict(temperature=rng.choice([0.0, 0.7, 1.3], n), seed=rng.integers(0, 99, n),
              min_p=rng.choice([0.0, 0.05], n), output_index=rng.integers(0, 9, n))
    if asks:
        kw.update(top_k=rng.choice([0, 5], n), top_p=rng.choice([1.0, 0.8], n))
    for p in (arrays(n, **kw), arrays(n, **{**kw, "temperature": np.zeros(n)})):
        want_ids, want_q = jax.jit(draw_drafts, static_argnums=2)(logits, p, 1)
        got_ids, got_q = jax.jit(lambda *a: draw_drafts(*a, 1, sorts=asks))(logits, p)
        np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
        sampled = np.asarray(p.temperature) > 0
        np.testing.assert_allclose(np.asarray(got_q)[sampled], np.asarray(want_q)[sampled],
                                   rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(got_ids)[~sampled],
                                      np.asarray(logits).argmax(axis=1)[~sampled])
    assert sampled.sum() == 0 and np.asarray(arrays(n, **kw).temperature).sum() > 0
    assert _branches(lambda *a: draw_drafts(*a, 1, sorts=asks), logits, p) == 0
    assert _branches(lambda *a: draw_drafts(*a, 1), logits, p) > 0


def test_native_top_p_cut_of_rows_without_a_finite_maximum():
    """A row the grammar masked whole (every logit -inf), one with an inf and one with a
    NaN: the native cut returns (no bin index from a NaN distance), -inf for the masked
    row (every token kept: nothing to choose between), and a finite row beside them
    keeps its cut."""
    from pallas_kernels import cpu as native

    if not native.available():
        pytest.skip(f"native CPU kernels unavailable: {native.unavailable_reason()}")
    v = 300
    logits = np.tile(np.linspace(0.0, -20.0, v, dtype=np.float32), (4, 1))
    logits[0] = -np.inf
    logits[1, 5] = np.inf
    logits[2, 7] = np.nan
    top_k, top_p = np.zeros(4, np.int32), np.full(4, 0.5, np.float32)
    call = jax.ffi.ffi_call("jaxserve_top_k_top_p_cut", jax.ShapeDtypeStruct((4,), jnp.float32))
    got = np.asarray(jax.jit(call)(logits, np.ones(4, np.float32), top_k, top_p))
    want = np.asarray(sampler.top_k_top_p_by_sort(logits[3:], top_k[3:], top_p[3:]))
    assert got[0] == -np.inf and got[3] == want[0] > -20.0


@pytest.mark.parametrize("v", [700, 20000])
def test_native_top_k_top_p_cut_is_the_sorts(v):
    """The CPU's native threshold (jaxserve_top_k_top_p_cut: without top-k, the mass of
    value bins then a quickselect in one bin; with it, a quickselect over the top k; no
    sort; the logits scaled by 1 / the row's temperature as they are read) equals the one
    from each row divided by XLA (which computes x * (1 / temp)) and sorted, over flat
    and peaked rows, ties, masked (-inf) tokens, temperatures and every kind of top-k and
    top-p, at every instruction-set level this CPU has; with top_p 1 (off, as a padding
    row's) it is numpy's k-th largest value. Large rows: a flat row's nucleus crosses
    many tokens per bin."""
    from pallas_kernels import cpu as native
    from test_cpu_kernels import machine_isas

    if not native.available():
        pytest.skip(f"native CPU kernels unavailable: {native.unavailable_reason()}")
    rng = np.random.default_rng(3)
    n = 240 if v < 1000 else 24
    logits = (rng.standard_normal((n, v)) * rng.choice([0.3, 3.0, 12.0], n)[:, None]
              ).astype(np.float32)
    logits[::7] = np.round(logits[::7])  # many ties
    logits[::5, rng.integers(0, v, v // 2)] = -np.inf  # a grammar's or a ban's masked tokens
    top_k = rng.choice([0, 0, 1, 2, 5, 50, v - 1, v, v + 3], n).astype(np.int32)
    top_p = rng.choice([1.0, 0.999, 0.9, 0.5, 0.1, 0.01], n).astype(np.float32)
    temp = rng.choice([1.0, 1.0, 0.7, 0.05, 2.5], n).astype(np.float32)
    call = jax.jit(jax.ffi.ffi_call("jaxserve_top_k_top_p_cut",
                                    jax.ShapeDtypeStruct((n,), jnp.float32)))
    scaled = np.asarray(jax.jit(lambda x, t: x / t[:, None])(logits, temp))  # as the sampler
    want = np.asarray(jax.jit(sampler.top_k_top_p_by_sort)(scaled, top_k, top_p))
    nucleus = top_p < 1.0
    k = np.where((top_k > 0) & (top_k < v), top_k, v)
    kth = -np.sort(-scaled, axis=1)[np.arange(n), k - 1]
    isas = machine_isas()
    try:
        for isa in isas:
            assert native.set_max_isa(isa) == isa
            got = np.asarray(call(logits, temp, top_k, top_p))
            np.testing.assert_array_equal(got[nucleus], want[nucleus], err_msg=isa)
            # top_p 1 is off: the k-th value. (The sort's float32 cumulative sum reaches
            # 1.0 before a peaked row's tail, whose tokens, each below float32's
            # resolution of the mass, it then drops.)
            np.testing.assert_array_equal(got[~nucleus], kth[~nucleus], err_msg=isa)
            assert len(np.unique(got)) > n // 2  # the rows' cuts differ
    finally:
        native.set_max_isa(isas[0])
    assert {"scalar", "avx2"} <= set(isas) or not native.isa().startswith("avx")


@pytest.mark.parametrize("v", [300, 5000])
def test_native_draw_is_the_inverse_cdf_of_the_weights(v):
    """The CPU's native draw (jaxserve_draw, `draw_from`) picks, for each row, the first
    token whose cumulative weight reaches u times the row's total, as numpy's float64
    cumsum and searchsorted over the sampler's Weights do, wherever u * total is not
    within 1e-5 of a boundary (rounding); at u = 1 one at or past the last token of a
    weight float32 resolves beside the row's total (the tail's smaller ones); never a
    token of weight 0 (below the cut, masked, NaN, or under e^-87 of the row's top); at
    every instruction-set level."""
    from pallas_kernels import cpu as native
    from test_cpu_kernels import machine_isas

    if not native.available():
        pytest.skip(f"native CPU kernels unavailable: {native.unavailable_reason()}")
    rng = np.random.default_rng(5)
    n = 200
    logits = (rng.standard_normal((n, v)) * rng.choice([0.2, 2.0, 20.0], n)[:, None]
              ).astype(np.float32)
    logits[::4, rng.integers(0, v, v // 2)] = -np.inf
    logits[1::9, 3] = np.nan
    logits[2::11, 0] = logits[3::11, 256] = 80.0  # most of the weight on a block's first
    temp = rng.choice([0.05, 0.7, 1.0, 3.0], n).astype(np.float32)
    top = np.nanmax(logits, axis=1) / temp
    cut = np.where(rng.random(n) < 0.5, -np.inf, top - rng.uniform(0, 6, n)).astype(np.float32)
    u = np.maximum(rng.random(n), np.finfo(np.float32).tiny).astype(np.float32)
    u[::10] = 1.0
    q = np.asarray(jax.jit(lambda x, t: x / t[:, None])(logits, temp))  # as the sampler's
    d = (q - top[:, None]).astype(np.float64)
    weights = np.where((q >= cut[:, None]) & (d >= -87.0), np.exp(d), 0.0)  # e^-87: none
    cdf = np.cumsum(weights, axis=1)
    target = u * cdf[:, -1]
    want = np.array([np.searchsorted(c, t) for c, t in zip(cdf, target)])
    edges = np.concatenate([np.zeros((n, 1)), cdf], axis=1)
    margin = np.abs(edges - target[:, None]).min(axis=1) / cdf[:, -1]
    ends = u == 1.0
    clear = (margin > 1e-5) & ~ends
    assert clear.sum() > 0.8 * n
    # u = 1: at or past the last token of a weight float32 resolves beside the total.
    heavy = weights > 1e-6 * cdf[:, -1:]
    last_heavy = v - 1 - np.argmax(heavy[:, ::-1], axis=1)
    draw = jax.jit(lambda x, t, tp, c, u: sampler.draw_from(x, sampler.Weights(t, tp, c), u))
    isas = machine_isas()
    try:
        for isa in isas:
            assert native.set_max_isa(isa) == isa
            got = np.asarray(draw(logits, temp, top.astype(np.float32), cut, u))
            assert (weights[np.arange(n), got] > 0).all(), isa
            np.testing.assert_array_equal(got[clear], want[clear], err_msg=isa)
            assert (got[ends] >= last_heavy[ends]).all(), isa
    finally:
        native.set_max_isa(isas[0])
