"""Argument checks shared by the retrievers, so every one rejects bad input with the same message."""

from __future__ import annotations

import re
from typing import Any, Union

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


def checked_query(str_or_query_bundle: Any) -> Union[str, QueryBundle]:
    """What ``BaseRetriever.retrieve`` takes, checked: a ``str`` or a ``QueryBundle`` whose
    ``query_str`` is a ``str``; anything else (``bytes``, None, a number) is a ValueError."""
    if isinstance(str_or_query_bundle, QueryBundle):
        query_str = str_or_query_bundle.query_str
        if not isinstance(query_str, str):
            check_query_text(query_str, "QueryBundle.query_str")
        return str_or_query_bundle
    if isinstance(str_or_query_bundle, str):
        return str_or_query_bundle
    if isinstance(str_or_query_bundle, (bytes, bytearray)):
        check_query_text(str_or_query_bundle, "the query")
    raise ValueError(
        f"the query must be a str or a QueryBundle, got {type(str_or_query_bundle).__name__} "
        f"{str_or_query_bundle!r:.80}"
    )


class CheckedQueryMixin:
    """For ``BaseRetriever`` subclasses: ``retrieve``/``aretrieve`` check the query first
    (:func:`checked_query`), so ``bytes`` or ``None`` get a clear error instead of a failure
    deep inside LlamaIndex."""

    def retrieve(self, str_or_query_bundle: Any) -> Any:
        return super().retrieve(checked_query(str_or_query_bundle))  # type: ignore[misc]

    async def aretrieve(self, str_or_query_bundle: Any) -> Any:
        return await super().aretrieve(checked_query(str_or_query_bundle))  # type: ignore[misc]
