"""Token spans of a text, from a Hugging Face tokenizer or any counting tokenizer.

Large texts are tokenized in pieces of at most :data:`PIECE_CHARS` characters, cut after a
newline (else after a space) so word-level pre-tokenizers see the same words, and the pieces
are sent to the tokenizer in batches of at most :data:`BATCH_CHARS` characters. The Rust
tokenizer keeps per-byte alignment tables and per-token strings while it encodes (hundreds of
bytes per token), so encoding a 50 MB text in one call took gigabytes; in pieces its memory is
bounded by the batch, and the spans are kept in compact arrays (:class:`TokenSpans`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Sequence

from ..models import load_backend_tokenizer
from .windows import TokenSpans, _counter_spans

TokenSpanFn = Callable[[str], TokenSpans]
BatchTokenSpanFn = Callable[[Sequence[str]], List[TokenSpans]]
#: Offsets per piece: ``(start, end)`` pairs relative to the piece.
EncodeFn = Callable[[List[str]], List[Sequence[tuple[int, int]]]]

#: Most characters the tokenizer sees in one text (larger texts are cut into pieces).
PIECE_CHARS = 32_768
#: Most characters sent to the tokenizer in one batch call.
BATCH_CHARS = 1_048_576


def piece_bounds(text: str, max_chars: int = PIECE_CHARS) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of consecutive pieces of ``text``, each at most ``max_chars`` long.

    A cut goes after the last newline in the second half of the piece, else after the last
    space or tab there, else (a run without whitespace) at the limit.
    """
    if max_chars < 2:
        raise ValueError(f"max_chars must be >= 2, got {max_chars}")
    pos, n, half = 0, len(text), max_chars // 2
    while n - pos > max_chars:
        limit = pos + max_chars
        cut = text.rfind("\n", pos + half, limit)
        if cut < 0:
            cut = max(text.rfind(" ", pos + half, limit), text.rfind("\t", pos + half, limit))
        cut = limit if cut < 0 else cut + 1
        yield pos, cut
        pos = cut
    if n > pos:
        yield pos, n


def spans_in_pieces(
    texts: Sequence[str], encode: EncodeFn, piece_chars: int = PIECE_CHARS, batch_chars: int = BATCH_CHARS
) -> List[TokenSpans]:
    """Token spans of every text, encoding bounded pieces in bounded batches.

    ``encode`` maps a list of strings to their token offsets; empty spans are dropped.
    """
    out = [TokenSpans.empty(len(t)) for t in texts]
    batch: list[tuple[int, int, str]] = []
    size = 0

    def flush() -> None:
        offsets = encode([piece for _, _, piece in batch])
        for (index, shift, _), offs in zip(batch, offsets):
            out[index].extend(offs, shift, skip_empty=True)
        batch.clear()

    for index, text in enumerate(texts):
        for a, b in piece_bounds(text, piece_chars):
            batch.append((index, a, text[a:b]))
            size += b - a
            if size >= batch_chars:
                flush()
                size = 0
    if batch:
        flush()
    return out


def hf_batch_token_spans(
    tokenizer: Any, piece_chars: int = PIECE_CHARS, batch_chars: int = BATCH_CHARS
) -> BatchTokenSpanFn:
    """Exact token character spans from a fast Hugging Face tokenizer (no special tokens).

    Calls the Rust tokenizer directly with batches of pieces: no length warnings, no per-call
    Python overhead, the Rust side tokenizes a batch in parallel, and memory stays bounded
    however long the texts are (see the module docstring).
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # a transformers fast tokenizer, or a tokenizers.Tokenizer
    backend.no_truncation()
    backend.no_padding()

    def encode(pieces: List[str]) -> List[Sequence[tuple[int, int]]]:
        return [enc.offsets for enc in backend.encode_batch(pieces, add_special_tokens=False)]

    return lambda texts: spans_in_pieces(texts, encode, piece_chars, batch_chars)


def hf_token_spans(tokenizer: Any) -> TokenSpanFn:
    """Single-text version of :func:`hf_batch_token_spans`."""
    batch = hf_batch_token_spans(tokenizer)
    return lambda text: batch([text])[0]


def counter_token_spans(tokenize: Callable[[str], Sequence]) -> TokenSpanFn:
    """Spans for a LlamaIndex-style tokenizer (``str -> list of tokens``), e.g. tiktoken."""

    def spans(text: str) -> TokenSpans:
        out = TokenSpans.empty(len(text))
        out.extend(_counter_spans(text, lambda word: len(tokenize(word))))
        return out

    return spans


def batch_token_span_fn(tokenizer_name: str, tokenizer: Callable[[str], Sequence] | None = None) -> BatchTokenSpanFn:
    """The span function for a parser: a custom tokenizer callable wins over a model name."""
    if tokenizer is not None:
        single = counter_token_spans(tokenizer)
        return lambda texts: [single(t) for t in texts]
    return hf_batch_token_spans(load_backend_tokenizer(tokenizer_name))


def token_span_fn(tokenizer_name: str, tokenizer: Callable[[str], Sequence] | None = None) -> TokenSpanFn:
    """Single-text version of :func:`batch_token_span_fn`."""
    batch = batch_token_span_fn(tokenizer_name, tokenizer)
    return lambda text: batch([text])[0]


def count_tokens_fn(tokenizer_name: str, tokenizer: Callable[[str], Sequence] | None = None) -> Callable[[str], int]:
    """Count tokens the way the parser does (for checks and for users' own budgets)."""
    spans = token_span_fn(tokenizer_name, tokenizer)
    return lambda text: len(spans(text))
