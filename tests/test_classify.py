"""Classification, scoring and reranking (vLLM's LLM.classify / LLM.score, /classify, /score,
/rerank): a checkpoint's classification head on the last token's final hidden state,
against transformers' *ForSequenceClassification and *ForCausalLM on the same weights."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
import transformers as tf

from conftest import _hf_config
from jaxserve import LLM, PoolingParams, SamplingParams
from jaxserve.demo import write_byte_tokenizer
from jaxserve.loading.classifier import read_classifier
from serverproc import running_server
from test_embeddings import hf_last_hidden

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=16, token_buckets=(16,))
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
QUERY = "what do cats eat?"
DOCS = ["Cats eat fish and meat.", "The stock market rose today.", "cats",
        "A cat's diet is mostly protein, since cats are carnivores."]
# A reranker's prompt template over vLLM's score messages (roles query and document).
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'query' %}<Q>: {{ m['content'] }}\n"
            "{% else %}<D>: {{ m['content'] }}\n{% endif %}{% endfor %}"
            "{{ instruction or '' }}")


def save_classifier(arch: str, path, num_labels: int, labels: dict | None = None):
    """A random tiny `arch` sequence classifier saved with save_pretrained (with the byte
    tokenizer); its torch model."""
    _, cfg = _hf_config(arch)
    cfg.num_labels = num_labels
    if labels:
        cfg.id2label, cfg.label2id = labels, {v: k for k, v in labels.items()}
    cfg._attn_implementation = "eager"
    torch.manual_seed(3)
    cls = {"llama": tf.LlamaForSequenceClassification,
           "qwen2": tf.Qwen2ForSequenceClassification}[arch]
    model = cls(cfg).eval()
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return model


@pytest.fixture(scope="module")
def labeled(tmp_path_factory):
    """A Llama classifier of three named labels, served offline."""
    path = tmp_path_factory.mktemp("llama_cls")
    model = save_classifier("llama", path, 3, LABELS)
    return path, model, LLM(str(path), **ENGINE)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A Qwen2 classifier of one label (a reranker: tokenizer pairs, sigmoid)."""
    path = tmp_path_factory.mktemp("qwen2_cls")
    return path, save_classifier("qwen2", path, 1), tf.AutoTokenizer.from_pretrained(path)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_classify_matches_transformers(labeled, prompts):
    """Each prompt's probabilities (softmax over three labels) as transformers'
    LlamaForSequenceClassification, across 16-token chunks; raw logits with
    use_activation False; the labels read from id2label."""
    path, model, llm = labeled
    outs = llm.classify(prompts)
    assert [o.prompt_token_ids for o in outs] == prompts
    for prompt, out in zip(prompts, outs):
        want = torch.softmax(hf_logits(model, prompt), -1).numpy()
        assert out.outputs.num_classes == 3
        np.testing.assert_allclose(out.outputs.probs, want, atol=2e-6)
    raw = llm.classify(prompts[3], PoolingParams(use_activation=False))[0].outputs.probs
    np.testing.assert_allclose(raw, hf_logits(model, prompts[3]).numpy(), atol=1e-5)
    assert abs(sum(raw) - 1) > 1e-3  # logits, not probabilities
    assert llm.engine.classifier.labels == ("negative", "neutral", "positive")


def test_the_pooler_config_calibrates_and_turns_off_the_activation(labeled, prompts):
    """--pooler-config's logit_mean / logit_sigma (Platt scaling) before the softmax, and
    use_activation false by default (a request may still ask for it)."""
    path, model, llm = labeled
    tuned = LLM(str(path), **ENGINE, pooler_config={"logit_mean": 0.5, "logit_sigma": 2.0,
                                                    "use_activation": False})
    logits = (hf_logits(model, prompts[1]) - 0.5) / 2.0
    got = tuned.classify(prompts[1])[0].outputs.probs
    np.testing.assert_allclose(got, logits.numpy(), atol=1e-5)
    got = tuned.classify(prompts[1], PoolingParams(use_activation=True))[0].outputs.probs
    np.testing.assert_allclose(got, torch.softmax(logits, -1).numpy(), atol=2e-6)
    with pytest.raises(ValueError, match="logit_sigma"):
        LLM(str(path), **ENGINE, pooler_config={"logit_sigma": 0})


def test_a_sequence_classifier_refuses_to_generate(labeled, checkpoints):
    """A *ForSequenceClassification checkpoint has no LM head: generation is refused by
    name; a model without a head refuses classification; scoring needs one label."""
    _, _, llm = labeled
    with pytest.raises(ValueError, match="sequence classifier"):
        llm.generate([[0, 5, 6]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="one label; this model's has 3"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match="dimensions and normalize"):
        llm.classify([[0, 5]], PoolingParams(dimensions=8))
    plain = LLM(str(checkpoints("llama")[0]), **ENGINE)
    with pytest.raises(ValueError, match="no classification head"):
        plain.classify([[0, 5, 6]])
    assert not plain.engine.has_unfinished()


def test_the_activation_follows_the_config(labeled):
    """transformers' problem_type first, then sentence-transformers' activation_fn, then a
    sigmoid for one label and a softmax for several (vLLM's rules)."""
    path, _, llm = labeled
    tok = llm.engine.tokenizer
    hf = json.loads((path / "config.json").read_text())

    def activation(**over):
        return read_classifier(path, {**hf, **over}, tok).activation

    assert activation() == "softmax"
    assert activation(problem_type="regression") == "identity"
    assert activation(problem_type="multi_label_classification") == "sigmoid"
    identity = "torch.nn.modules.linear.Identity"
    assert activation(sentence_transformers={"activation_fn": identity}) == "identity"
    assert activation(sbert_ce_default_activation_function="torch.nn.modules.activation."
                      "Sigmoid") == "softmax"  # (three labels)
    with pytest.raises(ValueError, match="activation function"):
        activation(sbert_ce_default_activation_function="os.system")
    with pytest.raises(ValueError, match="method must be one of"):
        activation(classifier_from_token=["n", "y"])
    with pytest.raises(ValueError, match="is not a token"):
        activation(classifier_from_token=["no", "y"], method="from_2_way_softmax")


def test_cross_encoder_scores_match_transformers(cross_encoder):
    """LLM.score on a one-label sequence classifier: each (query, document) pair tokenized
    as transformers' tokenizer(query, document) (the pair template), scored as the
    sigmoid of Qwen2ForSequenceClassification's logit; 1:N and N:N, raw logits."""
    path, model, tokenizer = cross_encoder
    llm = LLM(str(path), **ENGINE)
    outs = llm.score(QUERY, DOCS)
    for doc, out in zip(DOCS, outs):
        ids = tokenizer(QUERY, doc)["input_ids"]
        assert out.prompt_token_ids == ids
        want = torch.sigmoid(hf_logits(model, ids)[0]).item()
        assert out.outputs.score == pytest.approx(want, abs=2e-6)
    pairs = llm.score(DOCS[:2], DOCS[2:], pooling_params=PoolingParams(use_activation=False))
    for (q, d), out in zip(zip(DOCS[:2], DOCS[2:]), pairs):
        want = hf_logits(model, tokenizer(q, d)["input_ids"])[0].item()
        assert out.outputs.score == pytest.approx(want, abs=1e-5)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(DOCS[:2], DOCS[:3])
    # vLLM's max_tokens_per_query / _doc: each text cut to its first N tokens (the byte
    # tokenizer: a token per ASCII character) before pairing.
    cut = llm.score(QUERY, DOCS, max_tokens_per_query=4, max_tokens_per_doc=6)
    for doc, out in zip(DOCS, cut):
        ids = tokenizer(QUERY[:4], doc[:6])["input_ids"]
        assert out.prompt_token_ids == ids
        want = torch.sigmoid(hf_logits(model, ids)[0]).item()
        assert out.outputs.score == pytest.approx(want, abs=2e-6)
    classified = llm.classify([tokenizer(QUERY, DOCS[0])["input_ids"]])[0].outputs.probs
    assert classified == pytest.approx([outs[0].outputs.score], abs=2e-6)  # (other batches)


def test_a_reranker_from_its_lm_head_rows(checkpoints):
    """A causal LM served as a reranker (vLLM's --hf-overrides classifier_from_token,
    Qwen3-Reranker's way): the score is the softmax probability of "y" against "n" at
    the prompt's last token, from Qwen3ForCausalLM's logits; the pair is one text, or
    the query/document messages rendered by a given chat template (an instruction
    reaching it); the model still generates."""
    path, model = checkpoints("qwen3")
    llm = LLM(str(path), **ENGINE, hf_overrides={"classifier_from_token": ["n", "y"],
                                                  "method": "from_2_way_softmax"})
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    no, yes = tokenizer.convert_tokens_to_ids(["n", "y"])

    def hf_score(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        return torch.softmax(logits[[no, yes]], -1)[1].item()

    for out, doc in zip(llm.score(QUERY, DOCS), DOCS):
        ids = tokenizer(QUERY + doc)["input_ids"]
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(hf_score(ids), abs=2e-6)
    kwargs = {"instruction": "Judge whether the document answers the query."}
    outs = llm.score(QUERY, DOCS[:2], chat_template=TEMPLATE, chat_template_kwargs=kwargs)
    for out, doc in zip(outs, DOCS[:2]):
        text = tokenizer.apply_chat_template(
            [{"role": "query", "content": QUERY}, {"role": "document", "content": doc}],
            chat_template=TEMPLATE, tokenize=False, **kwargs)
        ids = tokenizer(text)["input_ids"]
        assert kwargs["instruction"] in text and out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(hf_score(ids), abs=2e-6)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[0, 7, 9]], greedy)[0].outputs[0].token_ids) == 4


def test_a_bi_encoder_scores_by_cosine_similarity(checkpoints):
    """A model without a head scores a pair as the cosine similarity of the two texts'
    embeddings (transformers' last hidden states at their last tokens)."""
    path, model = checkpoints("llama")
    llm = LLM(str(path), **ENGINE)
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    outs = llm.score(QUERY, DOCS)
    q = hf_last_hidden(model, tokenizer(QUERY)["input_ids"])
    for doc, out in zip(DOCS, outs):
        ids = tokenizer(doc)["input_ids"]
        assert out.prompt_token_ids == tokenizer(QUERY)["input_ids"] + ids
        assert out.outputs.score == pytest.approx(float(q @ hf_last_hidden(model, ids)),
                                                  abs=2e-6)
    assert llm.score("a", "a")[0].outputs.score == pytest.approx(1, abs=1e-6)


@pytest.fixture(scope="module")
def server(cross_encoder, tmp_path_factory):
    path = cross_encoder[0]
    log = tmp_path_factory.mktemp("classify_http") / "server.log"
    with running_server(path, log, cold=True) as (target, proc):
        yield proc.http_url, target


def test_classify_score_and_rerank_over_http(server, cross_encoder):
    """/classify, /score (each field pair) and /rerank (vLLM's, Jina's) on a one-label
    classifier, against transformers; the usage counts the pairs' tokens."""
    server = server[0]
    _, model, tokenizer = cross_encoder
    want = [torch.sigmoid(hf_logits(model, tokenizer(QUERY, d)["input_ids"])[0]).item()
            for d in DOCS]
    ntok = sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCS)
    got = httpx.post(f"{server}/classify", json={"input": DOCS[:2]}).json()
    assert got["object"] == "list" and got["id"].startswith("classify-")
    for d, doc in zip(got["data"], DOCS[:2]):
        prob = torch.sigmoid(hf_logits(model, tokenizer(doc)["input_ids"])[0]).item()
        assert (d["label"], d["num_classes"]) == ("LABEL_0", 1)
        assert d["probs"] == pytest.approx([prob], abs=2e-6)
    for body in ({"text_1": QUERY, "text_2": DOCS}, {"queries": QUERY, "documents": DOCS}):
        for path in ("/score", "/v1/score"):
            got = httpx.post(server + path, json=body).json()
            assert [d["index"] for d in got["data"]] == [0, 1, 2, 3]
            assert [d["score"] for d in got["data"]] == pytest.approx(want, abs=2e-6)
            assert got["usage"] == {"prompt_tokens": ntok, "total_tokens": ntok}
    order = sorted(range(4), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        got = httpx.post(server + path, json={"query": QUERY, "documents": DOCS,
                                              "top_n": 3}).json()
        assert [r["index"] for r in got["results"]] == order[:3]
        assert [r["document"]["text"] for r in got["results"]] == [DOCS[i] for i in order[:3]]
        assert [r["relevance_score"] for r in got["results"]] == pytest.approx(
            [want[i] for i in order[:3]], abs=2e-6)
    every = httpx.post(f"{server}/rerank", json={"query": QUERY, "documents": DOCS}).json()
    assert len(every["results"]) == 4 and every["usage"]["prompt_tokens"] == ntok
    cut = httpx.post(f"{server}/rerank", json={"query": QUERY, "documents": DOCS,
                                               "max_tokens_per_doc": 6}).json()["results"]
    want = {i: torch.sigmoid(hf_logits(model, tokenizer(QUERY, d[:6])["input_ids"])[0]).item()
            for i, d in enumerate(DOCS)}
    assert {r["index"]: r["relevance_score"] for r in cut} == pytest.approx(want, abs=2e-6)
    assert {r["document"]["text"] for r in cut} == set(DOCS)  # as sent


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, 400, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, None),
    ("/score", {"text_1": "a"}, 400, "text_1"),
    ("/score", {"text_1": "a", "text_2": [""]}, 400, "text_2"),
    ("/rerank", {"documents": ["a"]}, 400, "query"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, 400, "top_n"),
    ("/rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": -1}, 400,
     "max_tokens_per_doc"),
    ("/classify", {"input": "a", "dimensions": 4}, 200, None),  # (an embedding's: ignored)
    ("/score", {"text_1": "a", "text_2": "b", "chat_template": "{% if %}"}, 400,
     "chat_template"),
])
def test_bad_scoring_requests_fail_alone(server, path, body, status, param):
    """A request the model cannot answer gets a 400 naming its field; the server goes on
    serving (the last check)."""
    server = server[0]
    r = httpx.post(server + path, json=body)
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error"]["param"] == param, r.text
    assert httpx.post(f"{server}/score", json={"text_1": "a", "text_2": "b"}).status_code == 200


def test_classify_and_score_over_grpc(server, cross_encoder):
    """jaxserve.v1's Classify and Score RPCs: what /classify and /score answer (against
    transformers); bad input is INVALID_ARGUMENT naming its field."""
    import grpc

    from server.client import Client
    from server.protos.jaxserve.v1 import inference_pb2 as pb

    _, model, tokenizer = cross_encoder
    client = Client(server[1])
    try:
        scores = client.score(QUERY, DOCS)
        for doc, got in zip(DOCS, scores):
            ids = tokenizer(QUERY, doc)["input_ids"]
            assert got == pytest.approx(torch.sigmoid(hf_logits(model, ids)[0]).item(),
                                        abs=2e-6)
        raw = client.score(DOCS[:2], DOCS[2:], use_activation=False)
        want = [hf_logits(model, tokenizer(q, d)["input_ids"])[0].item()
                for q, d in zip(DOCS[:2], DOCS[2:])]
        assert raw == pytest.approx(want, abs=1e-5)
        (one,) = client.classify([tokenizer(QUERY, DOCS[0])["input_ids"]])
        assert (one.label, list(one.probs)) == ("LABEL_0", pytest.approx([scores[0]],
                                                                          abs=2e-6))
        cut = client.stub.Score(pb.ScoreRequest(queries=[QUERY], documents=DOCS[:2],
                                                max_tokens_per_doc=6)).scores
        for doc, got in zip(DOCS, cut):
            ids = tokenizer(QUERY, doc[:6])["input_ids"]
            assert got.prompt_tokens == len(ids)
            assert got.score == pytest.approx(
                torch.sigmoid(hf_logits(model, ids)[0]).item(), abs=2e-6)
        for bad, field in (((DOCS[:2], DOCS[:3]), "1:1, 1:N or N:N"), (("q", []), "documents")):
            with pytest.raises(grpc.RpcError) as e:
                client.score(*bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in e.value.details()
    finally:
        client.close()


def test_texts_are_cut_at_token_boundaries(tmp_path):
    """max_tokens_per_query / _doc with a BPE of merges: the text cut where its N+1th
    token starts (no decoding round trip), so the cut text is the original's prefix and
    tokenizes to the original's first N tokens."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    from jaxserve.loading.tokenizer import Tokenizer
    from jaxserve.scoring import truncated_text

    corpus = ["the cat sat on the mat", "a cat eats fish and meat", "cats are carnivores"]
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(corpus * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(tmp_path)
    text = "the cat eats the fish, and then the cats sat on a mat"
    ids = tok.encode(text, False)
    assert len(ids) < len(text)  # merges: tokens of several characters
    for n in (1, 3, 7, len(ids) - 1):
        cut = truncated_text(tok, text, n)
        assert text.startswith(cut) and len(cut) < len(text)
        assert tok.encode(cut, False) == ids[:n]
    assert truncated_text(tok, text, len(ids)) == truncated_text(tok, text, 0) == text
