"""The encoder cache's bookkeeping (plain Python): rows by image hash, held while a
sequence's prompt needs them, idle ones evicted least recently used first."""

from __future__ import annotations

import numpy as np

from jaxserve.engine.multimodal.encoder_cache import PAGE, EncoderCache
from jaxserve.engine.multimodal.inputs import ImageInput, ImageSpan
from jaxserve.engine.request import Sequence


def _image(name: str, tokens: int) -> ImageInput:
    return ImageInput(np.zeros(1, np.float32), name.encode(), tokens)


def _seq(rid: str, *images: ImageInput) -> Sequence:
    seq = Sequence(rid, [0] * (1 + sum(i.num_tokens for i in images)))
    start = 1
    for image in images:
        seq.images.append(ImageSpan(image, start))
        start += image.num_tokens
    return seq


def test_rows_are_shared_held_and_evicted_least_recently_used_first():
    cache = EncoderCache(4 * PAGE)  # 4 pages
    a, b, c = _image("a", PAGE + 1), _image("b", PAGE), _image("c", 2 * PAGE)
    s1, s2 = _seq("1", a, a), _seq("2", b)
    assert cache.can_acquire(s1)
    cache.acquire(s1)  # a twice: encoded once, 2 pages
    cache.acquire(s2)
    uploads = cache.take_uploads()
    assert [i.hash for i, _ in uploads] == [b"a", b"b"]
    rows_a = uploads[0][1]
    assert len(rows_a) == PAGE + 1 and len(set(rows_a.tolist())) == PAGE + 1
    assert s1.images[0].slots is s1.images[1].slots is rows_a
    assert not set(rows_a.tolist()) & set(uploads[1][1].tolist())
    assert (cache.num_encoded, cache.num_hits) == (2, 1)
    s3 = _seq("3", c)  # 2 pages wanted, 1 free, everything held
    assert not cache.can_acquire(s3)
    cache.release(s2)  # b idle now (1 page)
    assert s2.images[0].slots is None
    assert cache.can_acquire(s3)
    cache.acquire(s3)  # evicts b
    assert [i.hash for i, _ in cache.take_uploads()] == [b"c"]
    s4 = _seq("4", b)
    assert not cache.can_acquire(s4)  # a and c held, all 4 pages used
    cache.release(s1)
    cache.release(s1)  # twice: nothing more happens
    cache.acquire(s4)  # evicts a; b is encoded again
    assert [i.hash for i, _ in cache.take_uploads()] == [b"b"]
    assert cache.num_encoded == 4 and cache.num_used_slots == 3 * PAGE
    cache.release(s3)
    cache.release(s4)
    s5 = _seq("5", c)
    cache.acquire(s5)  # c idle, still cached: a hit, nothing to encode
    assert cache.take_uploads() == [] and cache.num_hits == 2
    cache.release(s5)
    cache.forget_idle()
    assert cache.num_used_slots == 0


def test_a_request_larger_than_the_cache_does_not_fit():
    cache = EncoderCache(2 * PAGE)
    assert cache.fits([_image("a", PAGE), _image("a", PAGE), _image("b", PAGE)])
    assert not cache.fits([_image("a", PAGE), _image("b", PAGE + 1)])
