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
* :func:`plan_span_windows` does the same on a slice of a whole document's token arrays,
  in document offsets, without copying the slice (large documents stay cheap).
* :func:`limit_window_chars` cuts windows longer than a number of characters (a run without
  whitespace is one token for most tokenizers, so the token limit alone does not bound a
  chunk's length), at whitespace when possible.
"""

from __future__ import annotations

import bisect
import re
from array import array
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence, overload

__all__ = [
    "Window",
    "TokenSpans",
    "plan_windows",
    "plan_span_windows",
    "limit_window_chars",
    "split_at_whitespace",
    "spans_from_token_counter",
]

_SENTENCE_END_CHARS = ".!?;:\u3002"
_WHITESPACE_RUN = re.compile(r"\s+")


@dataclass(frozen=True)
class Window:
    """A window: character span ``[start, end)`` of the text and its token count."""

    start: int
    end: int
    num_tokens: int


def _index_typecode(largest: int) -> str:
    """The smallest array typecode for non-negative integers up to ``largest``."""
    return "i" if largest < 2**31 else "q"


class TokenSpans(Sequence[tuple[int, int]]):
    """Token character spans ``(start, end)`` kept in two integer arrays.

    A list of tuples costs about 120 bytes per token; this costs 8 (16 past 2**31 characters),
    which is what keeps a 50 MB document's tokens in tens of megabytes. Behaves as a
    read-only sequence of ``(start, end)`` tuples.
    """

    __slots__ = ("starts", "ends")

    def __init__(self, starts: array, ends: array) -> None:
        if len(starts) != len(ends):
            raise ValueError(f"starts ({len(starts)}) and ends ({len(ends)}) must have the same length")
        self.starts = starts
        self.ends = ends

    @classmethod
    def empty(cls, text_length: int = 0) -> "TokenSpans":
        """No spans yet, sized for offsets up to ``text_length``."""
        code = _index_typecode(text_length)
        return cls(array(code), array(code))

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[int, int]], text_length: int = 0) -> "TokenSpans":
        """Spans from ``(start, end)`` pairs (an existing :class:`TokenSpans` is returned as is)."""
        if isinstance(pairs, TokenSpans):
            return pairs
        spans = cls.empty(text_length)
        spans.extend(pairs)
        return spans

    def extend(self, pairs: Iterable[tuple[int, int]], shift: int = 0, skip_empty: bool = False) -> None:
        """Append ``(start + shift, end + shift)`` for every pair (``skip_empty``: not ``end <= start``)."""
        starts, ends = self.starts, self.ends
        for s, e in pairs:
            if skip_empty and e <= s:
                continue
            starts.append(s + shift)
            ends.append(e + shift)

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, i: int) -> tuple[int, int]: ...

    @overload
    def __getitem__(self, i: slice) -> "TokenSpans": ...

    def __getitem__(self, i: int | slice) -> "tuple[int, int] | TokenSpans":
        if isinstance(i, slice):
            return TokenSpans(self.starts[i], self.ends[i])
        return self.starts[i], self.ends[i]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.starts, self.ends)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenSpans):
            return self.starts.tolist() == other.starts.tolist() and self.ends.tolist() == other.ends.tolist()
        if isinstance(other, Sequence):
            return list(self) == [tuple(p) for p in other]
        return NotImplemented

    def __repr__(self) -> str:
        head = ", ".join(f"({s}, {e})" for s, e in zip(self.starts[:5], self.ends[:5]))
        return f"TokenSpans([{head}{', ...' if len(self) > 5 else ''}], n={len(self)})"


def _check_sizes(chunk_size: int, chunk_overlap: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not 0 <= chunk_overlap < chunk_size:
        raise ValueError(f"chunk_overlap must be in [0, chunk_size), got {chunk_overlap} (chunk_size={chunk_size})")


def _boundaries(
    text: str, starts: Sequence[int], ends: Sequence[int], lo: int, hi: int, span_start: int, span_end: int
) -> tuple[array, array]:
    """Token indexes (relative to ``lo``) where a window may start, and sentence starts.

    A window may start at a token with whitespace before it; a sentence starts after a gap
    holding a newline or after a sentence-end character.
    """
    code = _index_typecode(hi - lo)
    allowed = array(code, [0])
    sentence = array(code, [0])
    prev_end = min(ends[lo], span_end)
    for k in range(1, hi - lo):
        start = starts[lo + k]
        if start > prev_end:
            allowed.append(k)
            after_sentence = prev_end > span_start and text[prev_end - 1] in _SENTENCE_END_CHARS
            if after_sentence or text.find("\n", prev_end, start) >= 0:
                sentence.append(k)
        end = ends[lo + k]
        prev_end = end if end < span_end else span_end
    return allowed, sentence


def _last_at_most(sorted_idx: Sequence[int], limit: int, lower: int) -> int | None:
    """Largest value in ``sorted_idx`` that is ``<= limit`` and ``> lower``."""
    pos = bisect.bisect_right(sorted_idx, limit) - 1
    if pos >= 0 and sorted_idx[pos] > lower:
        return sorted_idx[pos]
    return None


def _first_at_least(sorted_idx: Sequence[int], value: int) -> int | None:
    pos = bisect.bisect_left(sorted_idx, value)
    return sorted_idx[pos] if pos < len(sorted_idx) else None


def _token_cuts(
    n: int, allowed: Sequence[int], sentence: Sequence[int], chunk_size: int, chunk_overlap: int, slack: int
) -> list[tuple[int, int]]:
    """Token index ranges ``[a, b)`` of the windows, before the tail is fixed."""
    cuts: list[tuple[int, int]] = []
    a = 0
    while True:
        hard = a + chunk_size
        if hard >= n:
            cuts.append((a, n))
            return cuts
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


def _fix_tail(cuts: list[tuple[int, int]], allowed: Sequence[int], chunk_size: int, min_tail: int) -> None:
    """Merge a small last window into the previous one, or re-anchor it (in place)."""
    if len(cuts) < 2:
        return
    (pa, pb), (la, lb) = cuts[-2], cuts[-1]
    if lb - pa <= chunk_size:
        cuts[-2:] = [(pa, lb)]
    elif lb - pb < min_tail:
        start = _first_at_least(allowed, lb - chunk_size)
        if start is not None and start < la:
            cuts[-1] = (start, lb)


def plan_span_windows(
    text: str,
    starts: Sequence[int],
    ends: Sequence[int],
    span_start: int,
    span_end: int,
    chunk_size: int,
    chunk_overlap: int = 0,
    sentence_slack: float = 0.2,
    min_tail_tokens: int = 0,
) -> list[Window]:
    """Windows over ``text[span_start:span_end]`` in ``text`` offsets.

    ``starts``/``ends`` are the token spans of the whole ``text`` (sorted by start); the
    tokens starting inside the span are used, with ends clipped to ``span_end``. Nothing is
    copied, so a section of a 50 MB document costs only its window list.
    """
    _check_sizes(chunk_size, chunk_overlap)
    lo = bisect.bisect_left(starts, span_start)
    hi = bisect.bisect_left(starts, span_end)
    n = hi - lo
    if n == 0:
        return [Window(span_start, span_end, 0)] if span_end > span_start else []
    allowed, sentence = _boundaries(text, starts, ends, lo, hi, span_start, span_end)
    cuts = _token_cuts(n, allowed, sentence, chunk_size, chunk_overlap, int(chunk_size * sentence_slack))
    _fix_tail(cuts, allowed, chunk_size, min_tail_tokens)
    return [
        Window(span_start if a == 0 else starts[lo + a], span_end if b >= n else starts[lo + b], b - a)
        for a, b in cuts
    ]


def plan_windows(
    text: str,
    spans: Sequence[tuple[int, int]],
    chunk_size: int,
    chunk_overlap: int = 0,
    sentence_slack: float = 0.2,
    min_tail_tokens: int = 0,
) -> list[Window]:
    """Cut ``text`` (tokenised as ``spans``, ``(start, end)`` per token) into windows.

    Returns windows in order; an empty token list gives one window over the whole text when
    the text is not empty (a whitespace-only span keeps its characters).
    """
    tokens = TokenSpans.from_pairs(spans, len(text))
    return plan_span_windows(
        text, tokens.starts, tokens.ends, 0, len(text), chunk_size, chunk_overlap, sentence_slack, min_tail_tokens
    )


def split_at_whitespace(text: str, start: int, end: int, max_chars: int) -> list[tuple[int, int]]:
    """Cut ``text[start:end]`` into consecutive pieces of at most ``max_chars`` characters.

    Each cut falls just after the last whitespace run that ends within the limit, so words stay
    whole; a run of more than ``max_chars`` non-space characters is cut hard. The pieces tile
    the span exactly.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    pieces: list[tuple[int, int]] = []
    while end - start > max_chars:
        limit = start + max_chars
        cut = limit
        last = None
        for last in _WHITESPACE_RUN.finditer(text, start, limit):
            pass
        if last is not None and last.end() > start:
            cut = last.end()
        pieces.append((start, cut))
        start = cut
    if end > start:
        pieces.append((start, end))
    return pieces


def _tokens_in(starts: Sequence[int], start: int, end: int) -> int:
    return bisect.bisect_left(starts, end) - bisect.bisect_left(starts, start)


def limit_window_chars(
    text: str, windows: Sequence[Window], max_chars: int, starts: Sequence[int] = ()
) -> list[Window]:
    """Windows with none longer than ``max_chars`` characters.

    A longer window is cut by :func:`split_at_whitespace`. The pieces of a cut window start no
    earlier than the end of the previous cut window, so a long run is never repeated in two
    windows' overlap, and a window that ends inside the cut pieces is dropped (they cover it).
    Piece token counts are the tokens of ``starts`` beginning inside them.
    """
    out: list[Window] = []
    floor = -1
    for w in windows:
        if w.end <= floor:
            continue
        if w.end - w.start <= max_chars:
            out.append(w)
            continue
        for a, b in split_at_whitespace(text, max(w.start, floor), w.end, max_chars):
            out.append(Window(a, b, _tokens_in(starts, a, b)))
        floor = w.end
    return out


def _counter_spans(text: str, count_tokens: Callable[[str], int]) -> Iterator[tuple[int, int]]:
    """Yield the spans of :func:`spans_from_token_counter` one at a time."""
    cache: dict[str, int] = {}
    for m in re.finditer(r"\S+", text):
        word = m.group()
        k = cache.get(word)
        if k is None:
            k = max(1, count_tokens(word))
            cache[word] = k
        s, e = m.span()
        if k == 1:
            yield s, e
            continue
        # Spread k tokens over the word; all but the last are zero-gap so no cut falls inside.
        step = max(1, (e - s) // k)
        for j in range(k):
            ts = min(s + j * step, e - 1)
            te = e if j == k - 1 else min(s + (j + 1) * step, e - 1)
            yield ts, max(te, ts)


def spans_from_token_counter(text: str, count_tokens: Callable[[str], int]) -> list[tuple[int, int]]:
    """Approximate token spans for a tokenizer that only counts (e.g. ``tiktoken.encode``).

    The text is split into whitespace-separated words; a word of ``k`` tokens becomes ``k``
    spans that share its characters, the last ending at the word's end. Counts per distinct
    word are cached, so this costs one tokenizer call per vocabulary word.
    """
    return list(_counter_spans(text, count_tokens))
