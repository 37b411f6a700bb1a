"""Argument checks shared by the retrievers, so every one rejects bad input with the same message."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Union

from llama_index.core.schema import QueryBundle

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1 (bools are not ints here); else a ValueError naming ``name``,
    the value and its type (``"5"``, ``None``, ``True`` and ``5.0`` are refused, not converted)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    return value


def check_query_text(text: Any, name: str = "query text") -> str:
    """``text`` if it is a ``str`` of valid Unicode; else a ValueError saying what to change.

    A lone surrogate (``"\\ud800"``, e.g. from text decoded with ``errors="surrogateescape"``)
    is not Unicode text: tokenizers cannot encode it, so it is refused here with its position.
    """
    if isinstance(text, (bytes, bytearray)):
        raise ValueError(
            f"{name} must be a str, got {type(text).__name__} {bytes(text[:40])!r}: decode it first, "
            "e.g. text.decode('utf-8')"
        )
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a str, got {type(text).__name__} {text!r:.80}")
    found = _SURROGATE.search(text)
    if found is not None:
        raise ValueError(
            f"{name} contains a lone surrogate ({found.group()!r}) at position {found.start()}; it is not valid "
            "Unicode text: clean it with text.encode('utf-8', 'replace').decode()"
        )
    return text


def check_not_blank(query: Union[str, QueryBundle]) -> Union[str, QueryBundle]:
    """``query`` unless it gives nothing to search with: blank text (empty or whitespace only)
    and, for a ``QueryBundle``, no ``embedding`` and no non-blank ``custom_embedding_strs``.

    Such a query matches no BM25 term and embeds to a vector unrelated to any question, so the
    results would be empty or arbitrary: a ValueError says what to pass instead. A bundle with
    blank text that carries its embedding (or strings to embed) is a real query and passes.
    """
    if isinstance(query, str):
        if not query.strip():
            raise ValueError(
                f"the query is blank ({query!r}): there is nothing to search for (no term to match, and its "
                "embedding would rank chunks arbitrarily); pass the question text, or a QueryBundle carrying "
                "the query's embedding: QueryBundle(query_str, embedding=vector)"
            )
        return query
    if query.query_str.strip() or query.embedding is not None:
        return query
    if any(isinstance(s, str) and s.strip() for s in query.custom_embedding_strs or ()):
        return query
    raise ValueError(
        f"QueryBundle.query_str is blank ({query.query_str!r}) and the bundle has no embedding (nor "
        "custom_embedding_strs): there is nothing to search for; set query_str to the question, or pass "
        "the query's embedding: QueryBundle(query_str, embedding=vector)"
    )


def checked_query(str_or_query_bundle: Any, refuse_blank: bool = True) -> Union[str, QueryBundle]:
    """What ``BaseRetriever.retrieve`` takes, checked: a ``str`` or a ``QueryBundle`` whose
    ``query_str`` is a ``str``; anything else (``bytes``, None, a number) is a ValueError, and so
    is a blank query (:func:`check_not_blank`) unless ``refuse_blank`` is False."""
    if isinstance(str_or_query_bundle, QueryBundle):
        query_str = str_or_query_bundle.query_str
        if not isinstance(query_str, str):
            check_query_text(query_str, "QueryBundle.query_str")
        return check_not_blank(str_or_query_bundle) if refuse_blank else str_or_query_bundle
    if isinstance(str_or_query_bundle, str):
        return check_not_blank(str_or_query_bundle) if refuse_blank else str_or_query_bundle
    if isinstance(str_or_query_bundle, (bytes, bytearray)):
        check_query_text(str_or_query_bundle, "the query")
    raise ValueError(
        f"the query must be a str or a QueryBundle, got {type(str_or_query_bundle).__name__} "
        f"{str_or_query_bundle!r:.80}"
    )


class CheckedQueryMixin:
    """For ``BaseRetriever`` subclasses: ``retrieve``/``aretrieve`` check the query first
    (:func:`checked_query`), so ``bytes`` or ``None`` get a clear error instead of a failure
    deep inside LlamaIndex, and a blank query a ValueError instead of empty or arbitrary results
    (unless the class sets ``refuses_blank_query = False``)."""

    refuses_blank_query: ClassVar[bool] = True

    def retrieve(self, str_or_query_bundle: Any) -> Any:
        return super().retrieve(checked_query(str_or_query_bundle, self.refuses_blank_query))  # type: ignore[misc]

    async def aretrieve(self, str_or_query_bundle: Any) -> Any:
        return await super().aretrieve(checked_query(str_or_query_bundle, self.refuses_blank_query))  # type: ignore[misc]
