"""Copies of index nodes handed to callers: cheap, and deep enough to protect the index."""

from __future__ import annotations

import copy
from typing import Any

from llama_index.core.schema import BaseNode

_IMMUTABLE = (str, int, float, bool, bytes, type(None))
_IMMUTABLE_TYPES = frozenset(_IMMUTABLE)


def copy_metadata(value: Any) -> Any:
    """A copy of a metadata value: containers copied recursively, immutable scalars shared.

    Chunk metadata is flat JSON (strings, numbers, short lists); this is several times faster
    than ``copy.deepcopy`` on it and falls back to ``deepcopy`` for anything else.
    """
    kind = type(value)
    if kind in _IMMUTABLE_TYPES or isinstance(value, _IMMUTABLE):
        return value
    if kind is dict:
        # Scalars (nearly every metadata value) are shared without a call per value.
        return {k: v if type(v) in _IMMUTABLE_TYPES else copy_metadata(v) for k, v in value.items()}
    if kind is list:
        return [v if type(v) in _IMMUTABLE_TYPES else copy_metadata(v) for v in value]
    if kind is tuple:
        return tuple(copy_metadata(v) for v in value)
    return copy.deepcopy(value)


def copy_node(node: BaseNode) -> BaseNode:
    """A shallow copy of ``node`` with its own copy of the metadata.

    Enough that neither the caller nor a downstream postprocessor can change the text (strings
    are immutable; assigning ``node.text`` rebinds the copy's field) or the metadata (which
    filters read) of what the index holds.
    """
    copied = node.__copy__()  # pydantic's shallow copy: what model_copy(update=...) does, without its checks
    copied.__dict__["metadata"] = copy_metadata(node.metadata)
    copied.__pydantic_fields_set__.add("metadata")  # __copy__ gave the copy its own set
    return copied
