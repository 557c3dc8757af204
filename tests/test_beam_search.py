"""jaxserve/beam_search.py's rules on hand-made logprobs (vLLM's beam search): EOS ends a
beam, the ended and live beams ranked by cum_logprob / length ** length_penalty, the
parameters checked. tests/test_engine.py runs it on a model against transformers."""

from __future__ import annotations

import math

import pytest

from jaxserve.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams
from jaxserve.outputs import Logprob

EOS = 2


def lp(**probs) -> dict[int, Logprob]:
    """{token: Logprob} from t<id>=probability."""
    return {int(k[1:]): Logprob(math.log(v)) for k, v in probs.items()}


def test_eos_ends_a_beam_and_ranks_by_length_penalty():
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0)
    search = BeamSearch([7, 8], params, (EOS,))
    search.advance([lp(t2=0.5, t5=0.3, t6=0.2)])  # EOS first: one beam ends at once
    assert [b.tokens for b in search.ended] == [[7, 8]] and search.ended[0].stop_reason == EOS
    assert [b.tokens for b in search.live] == [[7, 8, 5], [7, 8, 6]]
    search.advance([lp(t9=0.9, t2=0.1), lp(t9=0.6, t4=0.4)])
    assert [b.tokens for b in search.live] == [[7, 8, 5, 9], [7, 8, 6, 9]]
    assert not search.done
    search.advance([lp(t3=0.99), lp(t3=0.99)])
    assert search.done
    best = search.best()
    # Scores over the prompt's and the beam's tokens (an ending EOS not counted):
    # [7, 8] + EOS: log 0.5 / 2 = -0.35; [7, 8, 5, 9, 3]: log(0.3 * 0.9 * 0.99) / 5 =
    # -0.26; [7, 8, 6, 9, 3]: log(0.2 * 0.6 * 0.99) / 5 = -0.43.
    scores = {tuple(b.tokens): search.score(b) for b in search.ended + search.live}
    assert scores[(7, 8)] == pytest.approx(math.log(0.5) / 2)
    assert scores[(7, 8, 5, 9, 3)] == pytest.approx(math.log(0.3 * 0.9 * 0.99) / 5)
    assert [b.tokens for b in best] == [[7, 8, 5, 9, 3], [7, 8]]
    assert [b.finish_reason for b in best] == ["length", "stop"]
    # Without the length penalty, the plain cumulative log-probability: the short one wins.
    search.params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0)
    assert search.best()[0].tokens == [7, 8]
    assert search.best()[0].finish_reason == "stop"


def test_include_stop_str_and_ignore_eos():
    kept = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=2,
                                            include_stop_str_in_output=True), (EOS,))
    kept.advance([lp(t2=0.9, t4=0.1)])
    assert [b.tokens for b in kept.ended] == [[1, EOS]]
    assert search_generated(kept) == [[EOS], [4]]
    ignored = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True),
                         (EOS,))
    ignored.advance([lp(t2=0.9, t4=0.1)])
    assert not ignored.ended and [b.tokens for b in ignored.live] == [[1, EOS]]


def search_generated(search: BeamSearch) -> list[list[int]]:
    return [search.generated(b) for b in search.ended + search.live]


@pytest.mark.parametrize("kw, needle", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=MAX_BEAM_WIDTH + 1, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
])
def test_bad_params(kw, needle):
    with pytest.raises(ValueError, match=needle):
        BeamSearchParams(**kw)
