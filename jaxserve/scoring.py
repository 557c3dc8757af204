"""Scoring text pairs, as vLLM's `LLM.score`, `/score` and `/rerank` do.

A model with a classification head of one label (a cross-encoder: a reranker, a reward
model) scores a query and a document as one prompt: the pair tokenized with the
tokenizer's pair template (config.json's `use_sep_token`, the default for a sequence
classifier) or as one concatenated text (a causal LM with `classifier_from_token`); with
a chat template given, the template renders the messages [{"role": "query"}, {"role":
"document"}] (chat_template_kwargs, e.g. an `instruction`, reach it) and that text is
tokenized with the tokenizer's special tokens. Its score is the head's output (after its
activation, unless `use_activation` is False). Any other model is a bi-encoder: its score
is the cosine similarity of the two embeddings."""

from __future__ import annotations

import numpy as np

from jaxserve.loading.classifier import Classifier


def pairs(queries: list, documents: list) -> list[tuple]:
    """(query, document) pairs of 1:1, 1:N or N:N inputs, in the documents' order;
    ValueError for other shapes."""
    if not queries:
        raise ValueError("at least one query (text_1, queries) must be given")
    if not documents:
        raise ValueError("at least one document (text_2, documents) must be given")
    if len(queries) > 1 and len(queries) != len(documents):
        raise ValueError(f"inputs must be 1:1, 1:N or N:N; got {len(queries)} queries and "
                         f"{len(documents)} documents")
    return list(zip(queries * len(documents) if len(queries) == 1 else queries, documents))


def cross_encodes(classifier: Classifier | None) -> bool:
    """Whether a model scores pairs as one prompt; ValueError when its head cannot
    score (several labels)."""
    if classifier is None:
        return False
    if classifier.num_labels != 1:
        raise ValueError(f"model: scoring needs a classification head of one label; this "
                         f"model's has {classifier.num_labels}")
    return True


def embedded_texts(pairs: list[tuple[str, str]]) -> list[str]:
    """What a bi-encoder embeds for `pairs`: each distinct query once, then every
    document."""
    return list(dict.fromkeys(q for q, _ in pairs)) + [d for _, d in pairs]


def cosine_scores(pairs: list[tuple[str, str]], vectors: list) -> list[float]:
    """The pairs' bi-encoder scores from the embeddings of `embedded_texts(pairs)`."""
    queries = list(dict.fromkeys(q for q, _ in pairs))
    of = dict(zip(queries, vectors))
    return [cosine(of[q], v) for (q, _), v in zip(pairs, vectors[len(queries):])]


def pair_prompt(tokenizer, classifier: Classifier, query: str, document: str,
                chat_template: str | None = None,
                chat_template_kwargs: dict | None = None) -> list[int]:
    """A cross-encoder's prompt for one pair (module doc); ValueError when it cannot be
    made (no tokenizer, a template that fails)."""
    _need(tokenizer)
    if chat_template is not None:
        text = tokenizer.apply_chat_template(
            [{"role": "query", "content": query}, {"role": "document", "content": document}],
            chat_template=chat_template, tokenize=False, **(chat_template_kwargs or {}))
        return tokenizer.encode(text, True)
    if classifier.use_sep_token:
        return tokenizer.encode_pair(query, document)
    return tokenizer.encode(query + document, True)


def truncated_text(tokenizer, text: str, max_tokens: int) -> str:
    """`text` cut after its first `max_tokens` tokens (0: whole), at a token boundary in
    the text itself (no decoding round trip), as vLLM's max_tokens_per_query / _doc."""
    if max_tokens <= 0:
        return text
    while True:
        offsets = tokenizer.token_offsets(text)
        if len(offsets) <= max_tokens:
            return text
        end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
        text = text[:min(end, len(text) - 1)]


def cut_pairs(tokenizer, pairs: list[tuple[str, str]], max_tokens_per_query: int,
              max_tokens_per_doc: int) -> list[tuple[str, str]]:
    """The pairs with each query and document cut to its first N tokens (0: whole)."""
    _need(tokenizer)
    queries = {q: truncated_text(tokenizer, q, max_tokens_per_query)
               for q in dict.fromkeys(q for q, _ in pairs)}
    return [(queries[q], truncated_text(tokenizer, d, max_tokens_per_doc)) for q, d in pairs]


def _need(tokenizer) -> None:
    if tokenizer is None:
        raise ValueError("scoring text needs the model's tokenizer; this model has none")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """torch's cosine_similarity (each norm at least 1e-8)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(a @ b / (max(np.linalg.norm(a), 1e-8) * max(np.linalg.norm(b), 1e-8)))
