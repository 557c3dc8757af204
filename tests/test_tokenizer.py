"""Tests for jaxserve.loading.tokenizer: loading, encode/decode, streaming detokenization.

Every tokenizer is built here (no network): a byte-level BPE trained with `tokenizers`, and
sentencepiece BPE / unigram models trained with `sentencepiece`, Llama-style (byte fallback,
identity normalization, dummy prefix), plus the tokenizer.json files transformers and Llama 2
make from the sentencepiece model.

Oracles, none written here:
- `transformers.AutoTokenizer` on the same directory, for encode, decode and the special ids.
- sentencepiece itself where transformers 5 departs from it. transformers 5 loads a
  tokenizer.model into a `tokenizers` BPE with a Metaspace pre-tokenizer that does not
  prepend "▁" to text already starting with a space, so " hello" differs from sentencepiece
  (likewise text starting with a literal "▁"), and a unigram model is not reproduced at
  all. It also rebuilds `LlamaTokenizer`'s normalizer/pre-tokenizer instead of using the
  ones in tokenizer.json. We follow the model files (sentencepiece / tokenizer.json as
  written), so those cases are checked against sentencepiece.

The streaming oracle: output text is what decode(prompt + output) adds to decode(prompt),
both decoded by the oracle in full. Not decode(output): sentencepiece decoders drop the
leading space of whatever they decode first ("▁world" alone is "world", after "hello" it is
" world"). When the prompt ends inside a character, decode(prompt) ends in U+FFFD and is no
prefix of the full text; that character then counts as output, after the text of the
prompt's longest head that is a prefix (`_expected_stream`). Also checked: no chunk of a
valid text contains U+FFFD, and the decoded window stays short.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
tokenizers = pytest.importorskip("tokenizers")

from jaxserve.engine.output_text import OutputText  # noqa: E402
from jaxserve.loading.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402

TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello world! hello there, world. "
    "Tokenizers split text into pieces, and pieces join back into text. "
    "你好，世界！我们今天去公园散步。中文文本测试。"
    "Emoji time 😀🎉🚀 naïve café résumé — “quotes” and numbers 12345 67890. "
) * 4

# Held-out strings: unseen characters (byte fallback), whitespace runs, special tokens in text.
STRINGS = [
    "hello world",
    "Hello\n\nworld  two   spaces",
    "你好，世界！",
    "emoji 😀🎉 and unseen 🦀 ñ ß Ω 中文字",
    "naïve café 12345",
    "",
    "trailing space ",
    "<s>hello</s> world<unk>x",
    "x <s> y",
    " leading space",
    "  two leading",
]
DETOK_TEXTS = [
    "Hello world, hello there!",
    "你好，世界！我们去公园。",
    "emoji 😀🎉 unseen 🦀 Ω and café",
    "Tokenizers split  text\n\ninto pieces 12345",
]
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"


def _has_special_text(text: str) -> bool:
    return any(t in text for t in ("<s>", "</s>", "<unk>", "<pad>"))


# --------------------------------------------------------------------------------------
# Building the tokenizers
# --------------------------------------------------------------------------------------


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False), encoding="utf-8")


def _build_bytelevel(directory: Path, **config) -> Path:
    """GPT-2-style byte-level BPE with <s>, </s>, <pad> and a post-processor adding BOS."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT], trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"content": "<s>", "special": True, "__type": "AddedToken"},
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        **config,
    })
    return directory


def _build_sentencepiece(directory: Path, model_type: str) -> Path:
    """A Llama-style sentencepiece model written as tokenizer.model (no tokenizer.json)."""
    directory.mkdir(parents=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING_TEXT.split(". ")),
        model_prefix=str(directory / "tokenizer"),
        model_type=model_type, vocab_size=340, hard_vocab_limit=False, character_coverage=0.98,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, allow_whitespace_only_pieces=True, split_digits=True, minloglevel=2,
    )
    (directory / "tokenizer.vocab").unlink()
    _write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": {"content": "<s>", "__type": "AddedToken"},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
    })
    return directory


def _build_llama2_json(directory: Path, converted: Path) -> Path:
    """A tokenizer.json shaped like Llama 2's: Prepend("▁") + Replace(" ", "▁") normalizer.

    That normalizer reproduces sentencepiece exactly (unlike transformers 5's Metaspace).
    """
    spec = json.loads((converted / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
    ]}
    spec["pre_tokenizer"] = None
    directory.mkdir(parents=True)
    _write_json(directory / "tokenizer.json", spec)
    _write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "clean_up_tokenization_spaces": False,
    })
    return directory


@dataclass
class Case:
    """One tokenizer directory, our tokenizer for it, and the oracle to check it against."""

    name: str
    directory: Path
    ours: Tokenizer
    oracle_decode: Callable[[list[int], bool], str]
    hf: object | None = None   # transformers tokenizer, where it is a faithful oracle
    sp: object | None = None   # sentencepiece processor, for sentencepiece-based cases
    skip_only: bool = False    # the oracle can only decode with skip_special_tokens=True
    # Ids for random sequences checked against the oracle. Where the oracle is another
    # library, byte-fallback ids are left out: on invalid UTF-8 sentencepiece replaces each
    # bad byte, tokenizers' ByteFallback every byte of the run. sentencepiece also renders
    # <unk> as " ⁇ " where transformers treats it as a special token.
    oracle_pool: list[int] | None = None
    # Ids for random streams. tokenizers' ByteFallback is left out: there a later byte can
    # turn earlier, valid bytes of the same run into U+FFFD, which no stream can emit
    # without taking text back. (Valid byte runs are covered by the split-point tests.)
    stream_pool: list[int] | None = None


def _hf_decode(hf) -> Callable[[list[int], bool], str]:
    def decode(ids: list[int], skip: bool) -> str:
        return hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    return decode


def _sp_decode(sp) -> Callable[[list[int], bool], str]:
    # sentencepiece drops control tokens itself; it cannot render them (skip only).
    return lambda ids, skip: sp.decode(list(ids))


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("tokenizers")
    auto = transformers.AutoTokenizer.from_pretrained
    built: dict[str, Case] = {}

    flags = {"add_bos_token": True, "add_eos_token": True}
    for name, config in [("bytelevel", {}), ("bytelevel_bos_eos", flags)]:
        directory = _build_bytelevel(root / name, **config)
        hf = auto(directory)
        ours = Tokenizer.from_pretrained(directory)
        built[name] = Case(name, directory, ours, _hf_decode(hf), hf=hf)

    sp_dir = _build_sentencepiece(root / "sp_bpe", "bpe")
    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    not_byte = [i for i in range(sp.get_piece_size()) if not sp.is_byte(i)]
    text_ids = [i for i in not_byte if not sp.is_unknown(i)]
    hf = auto(sp_dir)
    built["sp_bpe"] = Case("sp_bpe", sp_dir, Tokenizer.from_pretrained(sp_dir), _hf_decode(hf),
                           hf=hf, sp=sp, oracle_pool=not_byte)

    # transformers 5 writes a Metaspace tokenizer.json for the same model; both read it alike.
    converted = root / "llama_json"
    hf.save_pretrained(converted)
    assert (converted / "tokenizer.json").is_file()
    hf_converted = auto(converted)
    built["llama_json"] = Case("llama_json", converted, Tokenizer.from_pretrained(converted),
                               _hf_decode(hf_converted), hf=hf_converted, sp=sp,
                               stream_pool=not_byte)

    llama2 = _build_llama2_json(root / "llama2_json", converted)
    built["llama2_json"] = Case("llama2_json", llama2, Tokenizer.from_pretrained(llama2),
                                _sp_decode(sp), sp=sp, skip_only=True, oracle_pool=text_ids,
                                stream_pool=not_byte)

    uni_dir = _build_sentencepiece(root / "sp_unigram", "unigram")
    uni = spm.SentencePieceProcessor(model_file=str(uni_dir / "tokenizer.model"))
    known = [i for i in range(uni.get_piece_size()) if not uni.is_unknown(i)]
    built["sp_unigram"] = Case("sp_unigram", uni_dir, Tokenizer.from_pretrained(uni_dir),
                               _sp_decode(uni), sp=uni, skip_only=True, oracle_pool=known)
    return built


HF_CASES = ["bytelevel", "bytelevel_bos_eos", "sp_bpe", "llama_json"]
SP_CASES = ["sp_bpe", "sp_unigram", "llama2_json"]
ALL_CASES = HF_CASES + ["llama2_json", "sp_unigram"]
SKIP_ONLY = {"llama2_json", "sp_unigram"}  # sentencepiece oracles cannot render special tokens


# --------------------------------------------------------------------------------------
# Loading, encode, decode
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HF_CASES)
def test_encode_matches_transformers(cases, name):
    case = cases[name]
    for text in STRINGS:
        if case.sp is not None and (text[:1].isspace() or text.startswith("▁")):
            continue  # transformers 5's Metaspace departs from sentencepiece here; see below
        for add in (True, False):
            expected = case.hf.encode(text, add_special_tokens=add)
            assert case.ours.encode(text, add_special_tokens=add) == expected, (text, add)


def test_post_processor_of_tokenizer_json_wins_over_config_flags(cases):
    """tokenizer.json's post-processor adds BOS; add_eos_token in the config is ignored.

    This is transformers 5's rule (it drops add_bos_token / add_eos_token when a
    tokenizer.json exists); transformers 4's LlamaTokenizerFast honoured them instead.
    """
    for name in ("bytelevel", "bytelevel_bos_eos"):
        tok = cases[name].ours
        body = tok.encode("hello", add_special_tokens=False)
        assert tok.encode("hello") == [tok.bos_token_id, *body]


@pytest.mark.parametrize("name", SP_CASES)
def test_sentencepiece_models_encode_like_sentencepiece(cases, name):
    """Plain text (no special-token strings) encodes exactly as sentencepiece does.

    For llama2_json this is the tokenizer.json path (the Llama 2 normalizer reproduces
    sentencepiece); transformers 5 gives [▁, he, llo] for " hello" where sentencepiece
    and the file give [▁, ▁, he, llo].
    """
    case = cases[name]
    for text in STRINGS:
        if not _has_special_text(text):
            assert case.ours.encode(text, add_special_tokens=False) == case.sp.encode(text), text
    bos = case.ours.bos_token_id
    assert case.ours.encode(" hello") == [bos, *case.sp.encode(" hello")]


def test_sentencepiece_splits_special_tokens_out_of_text(cases):
    tok, sp = cases["sp_bpe"].ours, cases["sp_bpe"].sp
    ids = tok.encode("hi<s> there</s>", add_special_tokens=False)
    head = sp.encode("hi")
    assert ids[: len(head)] == head and ids[len(head)] == tok.bos_token_id
    assert ids[-1] == tok.eos_token_id
    assert tok.bos_token_id not in ids[len(head) + 1 : -1]
    assert tok.decode(ids) == "hi there"
    assert tok.decode(ids, skip_special_tokens=False) == "hi<s> there</s>"


@pytest.mark.parametrize("name", HF_CASES)
def test_special_attributes_match_transformers(cases, name):
    case = cases[name]
    ours, hf = case.ours, case.hf
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.vocab_size == len(hf)
    assert ours.all_special_ids == set(hf.all_special_ids)
    ids = list(range(ours.vocab_size))
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.convert_ids_to_tokens([ours.vocab_size])


@pytest.mark.parametrize(("name", "skip"), [
    (name, skip) for name in ALL_CASES for skip in (True, False) if skip or name not in SKIP_ONLY
])
def test_decode_matches_oracle_on_random_ids(cases, name, skip):
    case = cases[name]
    rng = random.Random(0)
    pool = case.oracle_pool or list(range(case.ours.vocab_size))
    for _ in range(40):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
        assert case.ours.decode(ids, skip_special_tokens=skip) == case.oracle_decode(ids, skip), ids


def test_chat_template_sources(cases, tmp_path):
    assert cases["bytelevel"].ours.chat_template == CHAT_TEMPLATE
    assert cases["sp_bpe"].ours.chat_template is None

    directory = tmp_path / "tpl"
    shutil.copytree(cases["bytelevel"].directory, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"},
    ]
    _write_json(directory / "tokenizer_config.json", config)
    assert Tokenizer.from_pretrained(directory).chat_template == "D"
    # The transformers 5 layout wins over the config.
    (directory / "chat_template.jinja").write_text("J", encoding="utf-8")
    assert Tokenizer.from_pretrained(directory).chat_template == "J"


def test_bos_eos_from_model_configs_when_tokenizer_files_are_silent(cases, tmp_path):
    directory = tmp_path / "bare"
    directory.mkdir()
    shutil.copy(cases["bytelevel"].directory / "tokenizer.json", directory)
    _write_json(directory / "config.json", {"bos_token_id": 0, "eos_token_id": 2})
    _write_json(directory / "generation_config.json", {"eos_token_id": [1, 2]})
    tok = Tokenizer.from_pretrained(directory)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)  # generation_config before config
    assert tok.eos_token_ids == (1, 2)
    assert tok.chat_template is None

    # special_tokens_map.json names the tokens when tokenizer_config.json does not.
    special_map = {"bos_token": "<s>", "eos_token": {"content": "<pad>"}}
    _write_json(directory / "special_tokens_map.json", special_map)
    tok = Tokenizer.from_pretrained(directory)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 2)
    assert tok.eos_token_ids == (2, 1)


def test_missing_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError) as err:
        Tokenizer.from_pretrained(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and "tokenizer.json" in message and "tokenizer.model" in message
    assert "config.json" in message  # says what it found instead

    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")


def test_corrupt_files_give_value_errors(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="tokenizer.model"):
        Tokenizer.from_pretrained(tmp_path)


# --------------------------------------------------------------------------------------
# Incremental detokenization
# --------------------------------------------------------------------------------------


def _expected_stream(decode: Callable[[list[int], bool], str], prompt: list[int], output: list[int],
                     skip: bool) -> str:
    """The text decode(prompt + output) adds to the prompt's text (see the module docstring).

    The prompt's text is decode(prompt) when that is a prefix of the full decode. When the
    prompt ends inside a character its decode ends in U+FFFD (tokenizers' ByteFallback even
    turns the whole run of byte tokens into U+FFFDs), and that character belongs to the
    output that completes it: the prompt's text is then that of its longest head that
    decodes to a prefix of the full text.
    """
    full = decode(prompt + output, skip)
    for cut in range(len(prompt), -1, -1):
        head = decode(prompt[:cut], skip)
        if full.startswith(head):
            return full[len(head):]
    raise AssertionError("unreachable: the empty prompt decodes to a prefix")


def _stream(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    chunks = [detok.add(t) for t in output]
    assert detok.text == "".join(chunks)
    return chunks


@pytest.mark.parametrize("name", ALL_CASES)
def test_stream_matches_full_decode_at_every_split_point(cases, name):
    """Prompt/output split at every token, including inside multi-byte characters."""
    case = cases[name]
    for text in DETOK_TEXTS:
        ids = case.ours.encode(text)
        for split in range(len(ids) + 1):
            prompt, output = ids[:split], ids[split:]
            chunks = _stream(case.ours, prompt, output)
            assert not any("\ufffd" in c for c in chunks), (text, split, chunks)
            expected = _expected_stream(case.oracle_decode, prompt, output, True)
            assert "".join(chunks) == expected, (text, split)
        assert "".join(_stream(case.ours, [], ids)) == text  # round trip from an empty prompt


@pytest.mark.parametrize("name", ALL_CASES)
@pytest.mark.parametrize("skip", [True, False])
def test_a_whole_output_at_once_decodes_as_the_oracle(cases, name, skip):
    """`finish` with a whole output (how a request decoded at its end gets its text:
    OutputText with stream False), and `extend` then `flush`: the text decode(prompt +
    output) adds to the prompt's, split inside characters and with special tokens, as the
    oracle decodes it."""
    case = cases[name]
    tok = case.ours
    specials = [tok.bos_token_id, tok.eos_token_id]
    if name in ("llama2_json", "sp_unigram"):  # as in the special-token stream test below
        if not skip:
            pytest.skip("the oracle decodes this tokenizer's special tokens differently")
        specials = []
    for text in DETOK_TEXTS:
        ids = tok.encode(text)
        for split in range(len(ids) + 1):
            for output in (ids[split:], ids[split:] + specials):
                if not output:
                    continue
                expected = _expected_stream(case.oracle_decode, ids[:split], output, skip)
                detok = IncrementalDetokenizer(tok, ids[:split], skip_special_tokens=skip)
                got = detok.finish(output)
                assert got == expected == detok.text, (text, split)
                detok = IncrementalDetokenizer(tok, ids[:split], skip_special_tokens=skip)
                assert detok.extend(output) + detok.flush() == expected, (text, split)


@pytest.mark.parametrize("name", ALL_CASES)
def test_a_stream_in_groups_of_tokens_decodes_as_the_oracle(cases, name):
    """`extend` with a few tokens at a time (how OutputText takes an output of several
    tokens: a server's stream interval, multi-step decoding), the groups cut anywhere,
    inside characters too: the joined chunks are the oracle's text, none holds a U+FFFD of
    a character still to be completed, and after each group the text is what the tokens
    one at a time give (a group ending inside a character holds back only that one)."""
    case = cases[name]
    rng = random.Random(2)
    for text in DETOK_TEXTS:
        ids = case.ours.encode(text)
        for split in range(len(ids) + 1):
            detok = IncrementalDetokenizer(case.ours, ids[:split])
            one_by_one = IncrementalDetokenizer(case.ours, ids[:split])
            chunks, i = [], split
            while i < len(ids):
                n = rng.randint(1, 5)
                chunks.append(detok.extend(ids[i:i + n]))
                for token in ids[i:i + n]:
                    one_by_one.add(token)
                assert detok.text == one_by_one.text, (text, split, i, n)
                i += n
            assert not any("\ufffd" in c for c in chunks), (text, split, chunks)
            expected = _expected_stream(case.oracle_decode, ids[:split], ids[split:], True)
            assert "".join(chunks) == expected == detok.text, (text, split)


@pytest.mark.parametrize("name", [n for n in ALL_CASES if n not in ("llama2_json", "sp_unigram")])
@pytest.mark.parametrize("skip", [True, False])
def test_stream_with_special_tokens_in_the_output(cases, name, skip):
    case = cases[name]
    tok = case.ours
    bos, eos = tok.bos_token_id, tok.eos_token_id
    pieces = [tok.encode("Hello", False), [eos], tok.encode(" world 你好", False), [bos, eos],
              tok.encode("😀 done", False), [eos]]
    output = [i for piece in pieces for i in piece]
    for prompt in ([], [bos], tok.encode("Say hi:"), tok.encode("Say hi:") + [eos]):
        chunks = _stream(tok, prompt, output, skip)
        assert not any("\ufffd" in c for c in chunks)
        assert "".join(chunks) == _expected_stream(case.oracle_decode, prompt, output, skip), prompt


@pytest.mark.parametrize("name", ALL_CASES)
@pytest.mark.parametrize("skip", [True, False])
def test_stream_matches_full_decode_on_random_ids(cases, name, skip):
    """Random prompts and outputs: lone bytes, special tokens, pieces in any order.

    The reference is our full `decode` (tied to the oracle by the decode tests), because
    on invalid UTF-8 the libraries differ. The stream holds back text ending in U+FFFD, so
    when the full text ends in one the stream may stop short of it.
    """
    case = cases[name]
    rng = random.Random(1)
    pool = case.stream_pool or list(range(case.ours.vocab_size))
    for _ in range(40):
        prompt = [rng.choice(pool) for _ in range(rng.randint(0, 10))]
        output = [rng.choice(pool) for _ in range(rng.randint(1, 20))]
        text = "".join(_stream(case.ours, prompt, output, skip))
        expected = _expected_stream(case.ours.decode, prompt, output, skip)
        if expected.endswith("\ufffd"):
            assert expected.startswith(text), (prompt, output)
        else:
            assert text == expected, (prompt, output)


def _output_text(tok: Tokenizer, prompt: list[int], output: list[int], groups: list[int],
                 stop: list[str], min_tokens: int = 0, ends_in_eos: bool = False
                 ) -> tuple[str, str | None, int]:
    """OutputText fed `output` in groups of `groups[i]` tokens (cycled; the last ends it:
    "length", or "stop" by the EOS it ends with): (its text, the stop string that ended
    it, the tokens it took)."""
    text = OutputText(tok, prompt, SamplingParams(stop=stop, min_tokens=min_tokens),
                      [tok.eos_token_id])
    chunks, used, i, g = [], 0, 0, 0
    while i < len(output):
        group = output[i:i + groups[g % len(groups)]]
        i, g = i + len(group), g + 1
        end = None if i < len(output) else "stop" if ends_in_eos else "length"
        chunk, matched, took = text.add(group, end)
        chunks.append(chunk)
        used += took
        if matched is not None:
            return "".join(chunks), matched, used
    return "".join(chunks), None, used


@pytest.mark.parametrize("name", ["bytelevel", "llama_json"])
def test_output_text_in_groups_stops_where_the_oracle_text_first_holds_the_stop(cases, name):
    """An output handed to OutputText a few tokens at a time (as the servers' stream
    interval and multi-step decoding hand it over) ends at the first token after which the
    oracle's text holds the stop string, with the text before it; without a match, with the
    oracle's whole text (an ending EOS adds none). Min-tokens: the same as one token at a
    time."""
    case = cases[name]
    tok, rng = case.ours, random.Random(3)
    eos = tok.eos_token_id
    for text in DETOK_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        prompt, output = ids[:2], ids[2:]
        full = _expected_stream(case.oracle_decode, prompt, output, True)
        for _ in range(6):
            groups = [rng.randint(1, 6) for _ in range(4)]
            k = rng.randrange(len(full) - 2)
            stop = full[k:k + rng.randint(1, 3)]
            first = next(t for t in range(1, len(output) + 1)
                         if stop in _expected_stream(case.oracle_decode, prompt, output[:t], True))
            got = _output_text(tok, prompt, output, groups, [stop, "\x00never"])
            assert got == (full[:full.index(stop)], stop, first), (text, groups, stop)
            assert _output_text(tok, prompt, output + [eos], groups, ["\x00never"],
                                ends_in_eos=True) == (full, None, len(output) + 1)
            for min_tokens in (0, 3, 7):
                assert (_output_text(tok, prompt, output, groups, [stop], min_tokens)
                        == _output_text(tok, prompt, output, [1], [stop], min_tokens))


def _word_piece(tok: Tokenizer) -> tuple[int, str]:
    """Some "▁word" piece of the vocabulary, and its word."""
    for token_id, token in enumerate(tok.convert_ids_to_tokens(range(tok.vocab_size))):
        if token.startswith("▁") and token[1:].isalpha():
            return token_id, token[1:]
    raise AssertionError("no ▁word piece")


def test_sentencepiece_leading_space_and_split_bytes(cases):
    tok, sp = cases["sp_bpe"].ours, cases["sp_bpe"].sp
    hello = tok.encode("hello")
    word_id, word = _word_piece(tok)
    assert _stream(tok, hello, [word_id]) == [" " + word]
    assert _stream(tok, [], [word_id]) == [word]  # as decode(["▁word"]) has it
    assert _stream(tok, [tok.bos_token_id], [word_id]) == [word]

    emoji = sp.encode("😀")  # the dummy ▁, then four byte-fallback pieces
    assert tok.convert_ids_to_tokens(emoji[-4:]) == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert _stream(tok, hello, emoji) == [" ", "", "", "", "😀"]


def test_bytelevel_split_character_waits_for_its_last_byte(cases):
    tok = cases["bytelevel"].ours
    ids = tok.encode("你好", add_special_tokens=False)
    assert len(ids) > 2  # the two characters' bytes are spread over several tokens
    chunks = _stream(tok, tok.encode("Say:"), ids)
    assert "".join(chunks) == "你好" and "" in chunks


def test_prompt_ending_in_many_special_tokens_keeps_the_leading_space(cases):
    """A prompt tail of skipped specials longer than the window still gives " world"."""
    tok = cases["sp_bpe"].ours
    word_id, word = _word_piece(tok)
    prompt = tok.encode("hello") + [tok.eos_token_id] * 12
    assert _stream(tok, prompt, [word_id]) == [" " + word]
    assert _expected_stream(cases["sp_bpe"].oracle_decode, prompt, [word_id], True) == " " + word


@pytest.mark.parametrize("name", ["bytelevel", "sp_bpe"])
def test_stream_decodes_a_bounded_window(cases, name, monkeypatch):
    """Each token costs O(window) decoding, however long the output gets."""
    tok = cases[name].ours
    output = tok.encode(" ".join(DETOK_TEXTS) * 4, add_special_tokens=False)
    longest = 0
    decode = Tokenizer.decode

    def spy(self, ids, skip_special_tokens=True):
        nonlocal longest
        longest = max(longest, len(ids))
        return decode(self, ids, skip_special_tokens)

    monkeypatch.setattr(Tokenizer, "decode", spy)
    text = "".join(_stream(tok, tok.encode("prompt"), output))
    assert len(output) > 200 and longest <= 12
    monkeypatch.undo()
    assert text == _expected_stream(cases[name].oracle_decode, tok.encode("prompt"), output, True)
