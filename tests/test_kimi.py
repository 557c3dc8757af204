"""Kimi K2: DeepSeek-V3's architecture under `model_type: kimi_k2`, and its tokenizer, a
tiktoken file that remote code reads (loading/tiktoken_files.py), against the `tiktoken`
package itself with the same ranks, pattern and special tokens."""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil

import pytest
import tiktoken

from conftest import hf_greedy
from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.loading.tiktoken_files import KIMI_PATTERN
from jaxserve.loading.tokenizer import Tokenizer

CORPUS = ("Hello world! It's 2026, and the model's answer: 12345 tokens. "
          "我们今天去北京看长城，天气很好。 Mixed 中文 and English, numbers 3.14159 and "
          "CamelCaseWords with   spaces\n\n\tand tabs. don't WON'T they'll I'M ")
SPECIALS = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
            "<|im_middle|>": 5}
TEXTS = [CORPUS, "  leading spaces and trailing   ", "数字123456789和符号!?…", "émoji 😀 and ß",
         "<|im_user|>user<|im_middle|>Hi there<|im_end|><|im_assistant|>", "\n\n\n", "a'S b'LL"]


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory):
    """A Kimi-style tokenizer directory: tiktoken.model trained on CORPUS by tiktoken's own
    trainer (whole words and runs of spaces, so merges reach across what Kimi's pattern
    splits too), its specials after the ranks, as Kimi numbers them."""
    from tiktoken._educational import bpe_train

    ranks = bpe_train(CORPUS * 3, 400, r"\S+|\s+", visualise=None)
    path = tmp_path_factory.mktemp("kimi_tok")
    (path / "tiktoken.model").write_text("".join(
        f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    base = len(ranks)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]",
        "added_tokens_decoder": {str(base + i): {"content": t, "special": True}
                                 for t, i in SPECIALS.items()}}))
    oracle = tiktoken.Encoding("kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                               special_tokens={t: base + i for t, i in SPECIALS.items()})
    return path, oracle


def test_tiktoken_file_encodes_as_tiktoken(kimi_tokenizer):
    path, oracle = kimi_tokenizer
    tok = Tokenizer.from_pretrained(path)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == oracle.encode(text, allowed_special="all"), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    base = oracle.n_vocab - len(SPECIALS)
    assert tok.bos_token_id == base and tok.eos_token_id == base + 1
    assert tok.vocab_size == base + 256  # Kimi reserves 256 special ids
    assert tok.decode([base + 2, base + 200], skip_special_tokens=False) == "<|im_end|><|reserved_token_200|>"
    assert base + 2 in tok.all_special_ids


def test_kimi_k2_config_is_deepseek_v3(checkpoints, tmp_path, prompts):
    """A DeepSeek-V3 checkpoint named kimi_k2 (as Kimi K2's config.json is) serves the
    transformers DeepseekV3 model's tokens."""
    path, hf_model = checkpoints("deepseek_v3")
    kimi = tmp_path / "kimi"
    shutil.copytree(path, kimi)
    config = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    cfg = ModelConfig.from_file(kimi)
    assert cfg.model_type == "kimi_k2"
    assert cfg == dataclasses.replace(ModelConfig.from_file(path), model_type="kimi_k2")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(kimi), dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(16, 64))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], greedy)]
    assert got == [hf_greedy(hf_model, p, 8) for p in prompts[:2]]
