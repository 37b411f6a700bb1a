"""Token spans of a text, from a Hugging Face tokenizer or any counting tokenizer."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

from ..models import load_hf_tokenizer
from .windows import spans_from_token_counter

TokenSpanFn = Callable[[str], List[tuple]]


def hf_token_spans(tokenizer: Any) -> TokenSpanFn:
    """Exact token character spans from a fast Hugging Face tokenizer (no special tokens)."""

    def spans(text: str) -> List[tuple]:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [(s, e) for s, e in enc["offset_mapping"] if e > s]

    return spans


def counter_token_spans(tokenize: Callable[[str], Sequence]) -> TokenSpanFn:
    """Spans for a LlamaIndex-style tokenizer (``str -> list of tokens``), e.g. tiktoken."""

    def spans(text: str) -> List[tuple]:
        return spans_from_token_counter(text, lambda word: len(tokenize(word)))

    return spans


def token_span_fn(tokenizer_name: str, tokenizer: Callable[[str], Sequence] | None = None) -> TokenSpanFn:
    """The span function for a parser: a custom tokenizer callable wins over a model name."""
    if tokenizer is not None:
        return counter_token_spans(tokenizer)
    return hf_token_spans(load_hf_tokenizer(tokenizer_name))


def count_tokens_fn(tokenizer_name: str, tokenizer: Callable[[str], Sequence] | None = None) -> Callable[[str], int]:
    """Count tokens the way the parser does (for checks and for users' own budgets)."""
    spans = token_span_fn(tokenizer_name, tokenizer)
    return lambda text: len(spans(text))
