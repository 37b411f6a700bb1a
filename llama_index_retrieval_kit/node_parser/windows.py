"""Fixed-size token windows over a span of text, with overlap and sentence-aware ends.

Pure functions over token character spans, so any tokenizer works:

* :func:`plan_windows` cuts a list of token spans into windows of at most ``chunk_size``
  tokens, consecutive windows sharing ``chunk_overlap`` tokens. Windows are cut only where
  whitespace separates two tokens (never inside a word, so re-tokenising a window's text
  gives the same count with word-piece tokenizers), and end after a sentence when one ends
  within ``sentence_slack`` of the hard limit. A tiny last window is merged into the previous
  one when both fit in ``chunk_size``, and otherwise re-anchored to the last ``chunk_size``
  tokens (more overlap instead of a fragment).
* Windows tile the text: window ``i`` runs from its first token to the first token of the
  following text, so every character of the span is inside some window.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["Window", "plan_windows", "spans_from_token_counter"]

TokenSpans = Sequence[tuple[int, int]]

_SENTENCE_END_CHARS = ".!?;:\u3002"


@dataclass(frozen=True)
class Window:
    """A window: character span ``[start, end)`` of the text and its token count."""

    start: int
    end: int
    num_tokens: int


def _boundaries(text: str, spans: TokenSpans) -> tuple[list[int], list[int]]:
    """Token indexes where a window may start (whitespace before), and sentence starts."""
    allowed = [0]
    sentence = [0]
    for i in range(1, len(spans)):
        prev_end, start = spans[i - 1][1], spans[i][0]
        if start > prev_end:
            allowed.append(i)
            gap = text[prev_end:start]
            before = text[prev_end - 1] if prev_end > 0 else ""
            if "\n" in gap or before in _SENTENCE_END_CHARS:
                sentence.append(i)
    return allowed, sentence


def _last_at_most(sorted_idx: list[int], limit: int, lower: int) -> int | None:
    """Largest value in ``sorted_idx`` that is ``<= limit`` and ``> lower``."""
    pos = bisect.bisect_right(sorted_idx, limit) - 1
    if pos >= 0 and sorted_idx[pos] > lower:
        return sorted_idx[pos]
    return None


def _first_at_least(sorted_idx: list[int], value: int) -> int | None:
    pos = bisect.bisect_left(sorted_idx, value)
    return sorted_idx[pos] if pos < len(sorted_idx) else None


def plan_windows(
    text: str,
    spans: TokenSpans,
    chunk_size: int,
    chunk_overlap: int = 0,
    sentence_slack: float = 0.2,
    min_tail_tokens: int = 0,
) -> list[Window]:
    """Cut ``text`` (tokenised as ``spans``, ``(start, end)`` per token) into windows.

    Returns windows in order; an empty token list gives one window over the whole text when
    the text is not empty (a whitespace-only span keeps its characters).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not 0 <= chunk_overlap < chunk_size:
        raise ValueError(f"chunk_overlap must be in [0, chunk_size), got {chunk_overlap} (chunk_size={chunk_size})")
    n = len(spans)
    if n == 0:
        return [Window(0, len(text), 0)] if text else []
    allowed, sentence = _boundaries(text, spans)
    slack = int(chunk_size * sentence_slack)

    cuts: list[tuple[int, int]] = []  # token index ranges [a, b)
    a = 0
    while True:
        hard = a + chunk_size
        if hard >= n:
            cuts.append((a, n))
            break
        b = None
        if slack > 0:
            b = _last_at_most(sentence, hard, max(a, hard - slack - 1))
        if b is None:
            b = _last_at_most(allowed, hard, a)
        if b is None:
            b = hard  # no whitespace in a whole window: cut between tokens
        cuts.append((a, b))
        nxt = _first_at_least(allowed, max(a + 1, b - chunk_overlap))
        if nxt is None or nxt > b:
            nxt = b
        a = nxt

    if len(cuts) >= 2:
        (pa, pb), (la, lb) = cuts[-2], cuts[-1]
        if lb - pa <= chunk_size:
            cuts[-2:] = [(pa, lb)]
        elif lb - pb < min_tail_tokens:
            start = _first_at_least(allowed, lb - chunk_size)
            if start is not None and start < la:
                cuts[-1] = (start, lb)

    windows = []
    for a, b in cuts:
        start = 0 if a == 0 else spans[a][0]
        end = len(text) if b >= n else spans[b][0]
        windows.append(Window(start, end, b - a))
    return windows


def spans_from_token_counter(text: str, count_tokens: Callable[[str], int]) -> list[tuple[int, int]]:
    """Approximate token spans for a tokenizer that only counts (e.g. ``tiktoken.encode``).

    The text is split into whitespace-separated words; a word of ``k`` tokens becomes ``k``
    spans that share its characters, the last ending at the word's end. Counts per distinct
    word are cached, so this costs one tokenizer call per vocabulary word.
    """
    spans: list[tuple[int, int]] = []
    cache: dict[str, int] = {}
    for m in re.finditer(r"\S+", text):
        word = m.group()
        k = cache.get(word)
        if k is None:
            k = max(1, count_tokens(word))
            cache[word] = k
        s, e = m.span()
        if k == 1:
            spans.append((s, e))
            continue
        # Spread k tokens over the word; all but the last are zero-gap so no cut falls inside.
        step = max(1, (e - s) // k)
        for j in range(k):
            ts = min(s + j * step, e - 1)
            te = e if j == k - 1 else min(s + (j + 1) * step, e - 1)
            spans.append((ts, max(te, ts)))
    return spans
