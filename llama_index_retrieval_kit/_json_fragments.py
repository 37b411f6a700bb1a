"""JSON files assembled from per-item fragments, each item encoded once per item object.

``json.dumps`` with its default separators (``", "`` and ``": "``, no indent, no sorting)
encodes every item of a list or dict independently of the others::

    json.dumps(items)   == "[" + ", ".join(json.dumps(x) for x in items) + "]"
    json.dumps(mapping) == "{" + ", ".join(dict_item_json(k, v) for k, v in mapping.items()) + "}"

(same ``ensure_ascii`` throughout). So a file holding many items can be written from the items'
cached encodings, and only items new since the last write are encoded: the bytes are exactly
those of the one-shot ``json.dumps``. A :class:`FragmentCache` entry is served only for the very
object it was made from (``is``; the entry holds the object, so its id is never reused while
cached). That is sound only for objects nobody changes in place after they are encoded; each
user states why its objects are never changed (BM25 snapshot nodes; the docstore's private entries).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, Generic, Hashable, Iterable, List, Tuple, TypeVar

Key = TypeVar("Key", bound=Hashable)


def dict_item_json(key: Any, value: Any, ensure_ascii: bool = True) -> str:
    """The text ``json.dumps`` writes for the item ``key: value`` of a dict (key converted as
    the encoder converts it: ``1`` -> ``"1"``, ``None`` -> ``"null"``)."""
    return json.dumps({key: value}, ensure_ascii=ensure_ascii)[1:-1]


def dict_key_json(key: Any, ensure_ascii: bool = True) -> str:
    """The text ``json.dumps`` writes before a dict item's value: the encoded key and ``": "``."""
    return json.dumps({key: 0}, ensure_ascii=ensure_ascii)[1:-2]


#: :class:`FragmentCache` keeps encodings from this call with items on (1: from the first).
KEEP_FROM_CALL = 2


class FragmentCache(Generic[Key]):
    """Encoded items (bytes) by key, each valid only for the object it was encoded from.

    :meth:`fragments` returns every item's encoding and afterwards holds exactly the items of
    that call, so an item dropped from the collection is forgotten at the next write.

    Encodings are kept from the second call with items on (:data:`KEEP_FROM_CALL`): a one-shot
    writer (an index build, one ``rkit index`` update) never holds them, a long-running one
    (about 3.9 KB per chunk for a ``HybridIndex``'s BM25 nodes and docstore together) encodes
    everything on its first two commits and then only what changed.
    """

    def __init__(self) -> None:
        self._entries: Dict[Key, Tuple[Any, bytes]] = {}
        self._calls = 0  # calls that had items

    def fragments(self, items: Iterable[Tuple[Key, Any]], encode: Callable[[Key, Any], bytes]) -> List[bytes]:
        """Each ``(key, item)``'s encoding, in order: the cached one when ``item`` is the object
        cached under ``key``, else ``encode(key, item)``. When ``encode`` raises, the cache is
        left as it was."""
        cached = self._entries
        keep = self._calls + 1 >= KEEP_FROM_CALL
        kept: Dict[Key, Tuple[Any, bytes]] = {}
        out: List[bytes] = []
        for key, item in items:
            hit = cached.get(key)
            fragment = hit[1] if hit is not None and hit[0] is item else encode(key, item)
            if keep:
                kept[key] = (item, fragment)
            out.append(fragment)
        if out:
            self._calls += 1
        self._entries = kept
        return out

    def clear(self) -> None:
        """Forget every cached encoding."""
        self._entries = {}

    def __len__(self) -> int:
        return len(self._entries)

    def cached_bytes(self) -> int:
        """Total length of the cached encodings (what the cache holds beyond the items)."""
        return sum(len(fragment) for _, fragment in self._entries.values())
