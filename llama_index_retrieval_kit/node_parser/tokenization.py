"""Token spans of a text, from a Hugging Face tokenizer or any counting tokenizer."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

from ..models import load_hf_tokenizer
from .windows import spans_from_token_counter

TokenSpanFn = Callable[[str], List[tuple]]
BatchTokenSpanFn = Callable[[Sequence[str]], List[List[tuple]]]


def hf_batch_token_spans(tokenizer: Any) -> BatchTokenSpanFn:
    """Exact token character spans from a fast Hugging Face tokenizer (no special tokens).

    Calls the Rust tokenizer directly with a whole batch: no length warnings, no per-call
    Python overhead, and the Rust side tokenizes a batch in parallel.
    """
    backend = tokenizer.backend_tokenizer
    backend.no_truncation()
    backend.no_padding()

    def spans(texts: Sequence[str]) -> List[List[tuple]]:
        encodings = backend.encode_batch(list(texts), add_special_tokens=False)
        return [[(s, e) for s, e in enc.offsets if e > s] for enc in encodings]

    return spans


def hf_token_spans(tokenizer: Any) -> TokenSpanFn:
    """Single-text version of :func:`hf_batch_token_spans`."""
    batch = hf_batch_token_spans(tokenizer)
    return lambda text: batch([text])[0]


def counter_token_spans(tokenize: Callable[[str], Sequence]) -> TokenSpanFn:
    """Spans for a LlamaIndex-style tokenizer (``str -> list of tokens``), e.g. tiktoken."""

    def spans(text: str) -> List[tuple]:
        return spans_from_token_counter(text, lambda word: len(tokenize(word)))

    return spans


def batch_token_span_fn(tokenizer_name: str, tokenizer: Callable[[str], Sequence] | None = None) -> BatchTokenSpanFn:
    """The span function for a parser: a custom tokenizer callable wins over a model name."""
    if tokenizer is not None:
        single = counter_token_spans(tokenizer)
        return lambda texts: [single(t) for t in texts]
    return hf_batch_token_spans(load_hf_tokenizer(tokenizer_name))


def token_span_fn(tokenizer_name: str, tokenizer: Callable[[str], Sequence] | None = None) -> TokenSpanFn:
    """Single-text version of :func:`batch_token_span_fn`."""
    batch = batch_token_span_fn(tokenizer_name, tokenizer)
    return lambda text: batch([text])[0]


def count_tokens_fn(tokenizer_name: str, tokenizer: Callable[[str], Sequence] | None = None) -> Callable[[str], int]:
    """Count tokens the way the parser does (for checks and for users' own budgets)."""
    spans = token_span_fn(tokenizer_name, tokenizer)
    return lambda text: len(spans(text))
