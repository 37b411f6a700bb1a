"""Copies of index nodes handed to callers: cheap, and deep enough to protect the index."""

from __future__ import annotations

import copy
import enum
import types
import typing
from typing import Any, Dict, Tuple

from llama_index.core.schema import BaseNode, RelatedNodeInfo
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from .._models import assemble

_IMMUTABLE = (str, int, float, bool, bytes, type(None))
#: List fields of a node that :func:`copy_node` copies one level deep (besides ``relationships``).
_LIST_FIELDS = ("excluded_embed_metadata_keys", "excluded_llm_metadata_keys", "embedding")
_IMMUTABLE_TYPES = frozenset(_IMMUTABLE)
#: Fields :func:`copy_node` copies itself whatever the node class.
_HANDLED_FIELDS = frozenset(("metadata", "relationships") + _LIST_FIELDS)
#: Per node class: its other fields that may hold something mutable (see :func:`_mutable_fields`).
_MUTABLE_FIELDS: Dict[type, Tuple[str, ...]] = {}


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


def copy_related(info: Any) -> Any:
    """A copy of one relationship value (a ``RelatedNodeInfo``, or a list of them for
    ``CHILD``) with its own metadata (every depth); its other fields are immutable scalars.

    ~0.8 us each (pydantic's shallow ``__copy__``, which shares the metadata, takes ~0.9 us)."""
    if type(info) is RelatedNodeInfo:
        values = info.__dict__.copy()
        metadata = values.get("metadata")
        if metadata is not None:
            values["metadata"] = copy_metadata(metadata)
        extra = info.__pydantic_extra__
        return assemble(RelatedNodeInfo, values, set(info.__pydantic_fields_set__), extra=None if extra is None else dict(extra))
    if type(info) is list:
        return [copy_related(item) for item in info]
    return copy.deepcopy(info)  # a subclass or anything else: correct before fast


def _holds_only_immutable(annotation: Any) -> bool:
    """True when every value the type ``annotation`` admits is immutable (scalars, enums, and
    Optional/Union/Literal/Annotated of them)."""
    if annotation in _IMMUTABLE_TYPES or annotation is type(None):
        return True
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return True
    if origin is typing.Annotated:
        return _holds_only_immutable(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:  # Optional[X], X | None
        return all(_holds_only_immutable(arg) for arg in typing.get_args(annotation))
    return False


def _mutable_fields(cls: type) -> Tuple[str, ...]:
    """The fields of node class ``cls`` besides those :func:`copy_node` always copies whose type
    admits a mutable value: ``text_resource`` and the other ``MediaResource`` fields of
    ``Document``/``Node``, ``ImageNode.text_embedding``; none for ``TextNode``. A field typed
    ``Any`` (``IndexNode.obj``: a retriever or query engine) is a reference, shared. Worked out
    once per class."""
    names = _MUTABLE_FIELDS.get(cls)
    if names is None:
        names = tuple(
            name
            for name, field in cls.model_fields.items()
            if name not in _HANDLED_FIELDS and field.annotation is not Any and not _holds_only_immutable(field.annotation)
        )
        _MUTABLE_FIELDS[cls] = names
    return names


def copy_field_value(value: Any) -> Any:
    """A copy of a node field's value: a pydantic model (a ``MediaResource``) as a shallow copy
    whose values are copied as metadata values are (:func:`copy_metadata`: its ``embeddings``
    dict of lists copied, text/bytes/None shared; ~1 us), anything else by :func:`copy_metadata`."""
    if isinstance(value, BaseModel):
        extra = value.__pydantic_extra__
        private = getattr(value, "__pydantic_private__", None)
        return assemble(
            type(value),
            {k: v if type(v) in _IMMUTABLE_TYPES else copy_metadata(v) for k, v in value.__dict__.items()},
            set(value.__pydantic_fields_set__),
            extra=None if extra is None else copy_metadata(extra),
            private=None if private is None else {k: v for k, v in private.items() if v is not PydanticUndefined},
        )
    return copy_metadata(value)


def copy_node(node: BaseNode) -> BaseNode:
    """A shallow copy of ``node`` with its own copy of the metadata and of its relationships
    (every depth), of its excluded-key lists and embedding (one level), and of any other field
    that may hold something mutable (:func:`copy_field_value`: ``text_resource`` and the other
    ``MediaResource`` fields of a ``Document``; a ``TextNode`` has none).

    Enough that neither the caller nor a downstream postprocessor can change the text (strings
    are immutable; assigning ``node.text`` rebinds the copy's field), the metadata (which
    filters read), the relationships (their ids and metadata included) or which keys it has,
    of what the index holds, and that the index's nodes share nothing mutable with the nodes a
    caller inserted. Built as
    pydantic's ``__copy__`` builds a shallow copy (the instance dict, extra, fields-set and
    private values copied one level), with plain ``dict``/``set`` copies instead of
    ``copy.copy`` (about 40% faster; a query copies every result it returns).
    """
    values = node.__dict__.copy()
    values["metadata"] = copy_metadata(node.metadata)
    # Each RelatedNodeInfo copied as the node is (:func:`copy_related`, ~0.8 us each; pydantic's
    # deepcopy takes ~10 us); the other containers one level deep (a dict or list copy each, ~0.1 us).
    relationships = values.get("relationships")
    if relationships is not None:
        values["relationships"] = {kind: copy_related(info) for kind, info in relationships.items()}
    for name in _LIST_FIELDS:
        value = values.get(name)
        if value is not None:
            values[name] = list(value)
    names = _MUTABLE_FIELDS.get(type(node))
    for name in names if names is not None else _mutable_fields(type(node)):
        value = values.get(name)
        if value is not None:
            values[name] = copy_field_value(value)
    fields_set = set(node.__pydantic_fields_set__)
    fields_set.add("metadata")
    extra = node.__pydantic_extra__
    private = getattr(node, "__pydantic_private__", None)
    return assemble(
        type(node),
        values,
        fields_set,
        extra=None if extra is None else dict(extra),
        private=None if private is None else {k: v for k, v in private.items() if v is not PydanticUndefined},
    )
