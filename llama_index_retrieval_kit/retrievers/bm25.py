"""BM25 keyword retrieval over LlamaIndex nodes, built on bm25s.

Compared with LlamaIndex's own ``BM25Retriever`` (llama-index-retrievers-bm25) this one

* persists its tokenizer settings (lowercase, token pattern, stopwords, stemmer) with the index,
  so a reloaded retriever tokenizes queries exactly as the index was built and scores identically;
* applies metadata filters per query, *before* taking the top k (all documents are scored, then
  filtered, then cut), so a filter never starves the result list while enough matches exist;
* supports insert / replace / delete by node id or ref doc id without stale or duplicate chunks:
  ``insert_nodes`` adds (replacing equal node ids, LlamaIndex's convention), ``replace_documents``
  replaces whole documents, and a node id two documents would share is refused
  (:class:`~.node_identity.ChunkIdConflictError`) instead of silently replacing a chunk.

Scores are raw BM25 scores from bm25s. A node is returned only if it shares at least one query
term with the query and its score is positive: with ``method="robertson"`` a term found in more
than half of the documents, and with ``"atire"`` a term found in every document, has idf 0, so a
node matching only such terms scores 0 and is not returned.
A term repeated in the query counts once per occurrence (bm25s sums per query token).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import bm25s
import bm25s.stopwords as bm25s_stopwords
import numpy as np
import Stemmer
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.bridge.pydantic import BaseModel, ConfigDict, Field, field_validator
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, QueryType
from llama_index.core.storage.docstore.utils import doc_to_json, json_to_doc
from llama_index.core.vector_stores.types import MetadataFilters

from .._files import atomic_writer, folder_lock, fsync_dir, fsync_tree
from .._json_fragments import FragmentCache
from .bm25_counts import VECTORISED_METHODS, TermCounts, count_terms, counted_index, updated_counts
from .checks import check_positive_int, check_query_text, checked_query
from .filters import filter_mask, validate_filters
from .node_copy import copy_node
from .node_identity import check_chunk_ids

logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets its own logger to DEBUG on import
logger = logging.getLogger(__name__)

BM25_METHODS = ("lucene", "robertson", "atire", "bm25l", "bm25+")
PERSIST_FORMAT_VERSION = 1
_CONFIG_FILE = "retriever.json"
_NODES_FILE = "nodes.json"
_BM25S_DIR = "bm25s"
_TOKEN_IDS_FILE = "tokens.npz"
_TOKEN_VOCAB_FILE = "tokens_vocab.json"
# What persist writes into its folder, in the order an earlier persist is set aside (the config
# first: a folder without it holds no complete index). Nothing else in the folder is touched.
_PAYLOAD = (_CONFIG_FILE, _NODES_FILE, _BM25S_DIR, _TOKEN_IDS_FILE, _TOKEN_VOCAB_FILE)
_PREVIOUS_DIR = ".previous"  # the earlier persist while a new one is written over it
_COMPLETE_MARKER = ".complete"  # in _PREVIOUS_DIR: every earlier payload entry has been moved there
_CONFIG_TEMP_GLOB = f".{_CONFIG_FILE}.*.tmp"  # atomic_writer's temporary files for the config

# Stopword lists shipped with bm25s, by the names bm25s accepts.
_STOPWORDS: Dict[str, Tuple[str, ...]] = {}
for _names, _words in (
    (("en", "english"), bm25s_stopwords.STOPWORDS_EN),
    (("en_plus", "english_plus"), bm25s_stopwords.STOPWORDS_EN_PLUS),
    (("de", "german"), bm25s_stopwords.STOPWORDS_GERMAN),
    (("nl", "dutch"), bm25s_stopwords.STOPWORDS_DUTCH),
    (("fr", "french"), bm25s_stopwords.STOPWORDS_FRENCH),
    (("es", "spanish"), bm25s_stopwords.STOPWORDS_SPANISH),
    (("pt", "portuguese"), bm25s_stopwords.STOPWORDS_PORTUGUESE),
    (("it", "italian"), bm25s_stopwords.STOPWORDS_ITALIAN),
    (("ru", "russian"), bm25s_stopwords.STOPWORDS_RUSSIAN),
    (("sv", "swedish"), bm25s_stopwords.STOPWORDS_SWEDISH),
    (("no", "norwegian"), bm25s_stopwords.STOPWORDS_NORWEGIAN),
    (("zh", "chinese"), bm25s_stopwords.STOPWORDS_CHINESE),
    (("tr", "turkish"), bm25s_stopwords.STOPWORDS_TURKISH),
    (("ko", "korean"), bm25s_stopwords.STOPWORDS_KOREAN),
    (("da", "danish"), bm25s_stopwords.STOPWORDS_DANISH),
):
    for _name in _names:
        _STOPWORDS[_name] = tuple(_words)


class BM25TokenizerConfig(BaseModel):
    """How text becomes BM25 terms; persisted with the index (except ``custom_tokenizer``).

    Pipeline: optionally lowercase, split (``token_pattern`` or ``custom_tokenizer``), drop
    stopwords, stem. Stopwords are compared after lowercasing and before stemming, so with
    ``lowercase=False`` they match case-sensitively.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    lowercase: bool = Field(default=True, description="Lowercase text before splitting.")
    token_pattern: str = Field(
        default=r"(?u)\b\w\w+\b",
        description="Regex whose matches are the tokens (whole match; default: words of 2+ characters, "
        "as in bm25s and scikit-learn). Ignored when custom_tokenizer is set.",
    )
    stopwords: Optional[Union[str, Tuple[str, ...]]] = Field(
        default="en",
        description=f"Stopwords to drop: a bm25s language name ({sorted(_STOPWORDS)}), a list of words, or None.",
    )
    stemmer_language: Optional[str] = Field(
        default="english",
        description="PyStemmer (Snowball) algorithm applied to every token, e.g. 'english'; None disables stemming.",
    )
    custom_tokenizer: Optional[Callable[[str], List[str]]] = Field(
        default=None,
        exclude=True,
        description="Optional callable text -> tokens that replaces the regex split (lowercasing, stopwords and "
        "stemming still apply). Not persisted: pass the same callable again to BM25Retriever.load.",
    )

    @field_validator("token_pattern")
    @classmethod
    def _check_pattern(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"token_pattern {value!r} is not a valid regular expression: {exc}") from exc
        return value

    @field_validator("stopwords")
    @classmethod
    def _check_stopwords(cls, value: Optional[Union[str, Tuple[str, ...]]]) -> Optional[Union[str, Tuple[str, ...]]]:
        if isinstance(value, str) and value not in _STOPWORDS:
            raise ValueError(f"stopwords {value!r} is not a known list; use one of {sorted(_STOPWORDS)}, a list, or None")
        return value

    @field_validator("stemmer_language")
    @classmethod
    def _check_stemmer(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value not in Stemmer.algorithms():
            raise ValueError(f"stemmer_language {value!r} is not a PyStemmer algorithm; use one of {Stemmer.algorithms()} or None")
        return value

    def to_persisted(self) -> Dict[str, Any]:
        """JSON-able settings, with a flag telling whether a custom tokenizer was used."""
        data = self.model_dump(mode="json")
        data["uses_custom_tokenizer"] = self.custom_tokenizer is not None
        return data


_thread_local = threading.local()
_STEM_CACHE_MAX = 1_000_000


def _stemmer(language: str) -> Any:
    """A PyStemmer stemmer for this thread (PyStemmer objects must not be shared across threads)."""
    cache: Dict[str, Any] = _thread_local.__dict__.setdefault("stemmers", {})
    if language not in cache:
        cache[language] = Stemmer.Stemmer(language)
    return cache[language]


def build_tokenizer(config: BM25TokenizerConfig) -> Callable[[str], List[str]]:
    """A function text -> BM25 terms applying ``config`` (compiled once)."""
    pattern = re.compile(config.token_pattern)
    whole_matches = pattern.groups == 0  # findall returns group(0) only for a pattern without groups
    words = config.stopwords
    stopwords = frozenset(_STOPWORDS[words] if isinstance(words, str) else (words or ()))
    custom = config.custom_tokenizer
    language = config.stemmer_language
    stems: Dict[str, str] = {}  # word -> stem; a vocabulary-sized cache shared by this tokenizer

    def stem(tokens: List[str]) -> List[str]:
        known: Dict[str, str] = {}
        missing = []
        for t in set(tokens):
            cached = stems.get(t)
            if cached is None:
                missing.append(t)
            else:
                known[t] = cached
        if missing:
            new = dict(zip(missing, _stemmer(language).stemWords(missing)))
            if len(stems) > _STEM_CACHE_MAX:
                stems.clear()
            stems.update(new)
            known.update(new)
        return [known[t] for t in tokens]

    def tokenize(text: str) -> List[str]:
        if config.lowercase:
            text = text.lower()
        if custom is not None:
            tokens = custom(text)
            if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, str) for t in tokens):
                raise ValueError(f"custom_tokenizer must return a list of str, got {tokens!r:.200}")
        elif whole_matches:
            tokens = pattern.findall(text)  # the whole matches, as finditer's group(0), in C
        else:
            tokens = [m.group(0) for m in pattern.finditer(text)]
        tokens = [t for t in tokens if t and t not in stopwords]
        if language is not None:
            tokens = [t for t in stem(tokens) if t]
        return tokens

    return tokenize


class PackedTokens(Sequence[Tuple[str, ...]]):
    """The token lists of many nodes as one vocabulary plus an id array.

    This is how the index keeps tokens between updates (a fraction of the memory of Python
    tuples of strings) and persists them, so that an update after :meth:`BM25Retriever.load`
    tokenizes only the new text. ``packed[i]`` is node ``i``'s tokens as a tuple of strings.
    """

    def __init__(self, vocab: List[str], ids: np.ndarray, offsets: np.ndarray) -> None:
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(ids) or np.any(np.diff(offsets) < 0):
            raise ValueError("token offsets must start at 0, never decrease and end at the number of token ids")
        if len(ids) and (ids.min() < 0 or ids.max() >= len(vocab)):
            raise ValueError(f"token ids must lie in [0, {len(vocab)}) (the vocabulary size)")
        self.vocab = vocab
        self.ids = ids
        self.offsets = offsets

    @classmethod
    def pack(cls, tokens: Sequence[Sequence[str]]) -> "PackedTokens":
        """Pack per-node token lists (a ``PackedTokens`` is returned as is)."""
        if isinstance(tokens, PackedTokens):
            return tokens
        return cls([], np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64)).extend(tokens)

    def extend(self, tokens: Sequence[Sequence[str]]) -> "PackedTokens":
        """A new ``PackedTokens``: these nodes followed by ``tokens`` (the vocabulary grows as needed)."""
        vocab = list(self.vocab)
        index = {term: i for i, term in enumerate(vocab)}
        new_ids = np.fromiter((index.setdefault(t, len(index)) for toks in tokens for t in toks), dtype=np.int64)
        vocab.extend(list(index)[len(vocab) :])
        lengths = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
        offsets = np.concatenate([self.offsets, self.offsets[-1] + np.cumsum(lengths)])
        dtype = np.int32 if len(vocab) < np.iinfo(np.int32).max else np.int64
        return PackedTokens(vocab, np.concatenate([self.ids.astype(dtype), new_ids.astype(dtype)]), offsets)

    def select(self, positions: Sequence[int]) -> "PackedTokens":
        """A new ``PackedTokens`` with the nodes at ``positions``, in that order."""
        at = np.asarray(positions, dtype=np.int64)
        starts, lengths = self.offsets[at], self.offsets[at + 1] - self.offsets[at]
        offsets = np.zeros(len(at) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        return PackedTokens(self.vocab, self.ids[gather], offsets)

    def bm25s_corpus(self) -> Tuple[List[List[int]], Dict[str, int]]:
        """Every node's token ids and the vocabulary ``{term: id}`` of the terms some node uses
        (ids renumbered densely): the corpus form ``bm25s.BM25.index`` takes as ``(ids, vocab)``,
        the same index as from :meth:`as_lists` without turning ids into strings and back."""
        used = np.bincount(self.ids, minlength=len(self.vocab)) > 0
        new_id = np.cumsum(used) - 1
        flat = new_id[self.ids].tolist()
        bounds = self.offsets.tolist()
        vocab = {term: i for i, term in enumerate(t for t, keep in zip(self.vocab, used.tolist()) if keep)}
        return [flat[bounds[i] : bounds[i + 1]] for i in range(len(self))], vocab

    def as_lists(self) -> List[List[str]]:
        """Every node's tokens as a list of strings (what bm25s indexes)."""
        vocab = self.vocab
        flat = [vocab[j] for j in self.ids.tolist()]
        bounds = self.offsets.tolist()
        return [flat[bounds[i] : bounds[i + 1]] for i in range(len(self))]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Tuple[str, ...]:  # type: ignore[override]
        if not 0 <= i < len(self):
            raise IndexError(f"node position {i} out of range for {len(self)} nodes")
        vocab = self.vocab
        return tuple(vocab[j] for j in self.ids[self.offsets[i] : self.offsets[i + 1]].tolist())

    def __iter__(self) -> Iterator[Tuple[str, ...]]:
        return (self[i] for i in range(len(self)))

    def save(self, folder: Path) -> None:
        """Write the ids (npz) and the vocabulary (JSON), dropping terms no node uses any more."""
        used = np.bincount(self.ids, minlength=len(self.vocab)) > 0
        ids, vocab = self.ids, self.vocab
        if not used.all():
            ids = (np.cumsum(used) - 1).astype(self.ids.dtype)[self.ids]
            vocab = [term for term, keep in zip(self.vocab, used.tolist()) if keep]
        np.savez(folder / _TOKEN_IDS_FILE, ids=ids, offsets=self.offsets)
        (folder / _TOKEN_VOCAB_FILE).write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> "PackedTokens":
        """Read what :meth:`save` wrote into ``folder``."""
        return cls.load_files(folder / _TOKEN_IDS_FILE, folder / _TOKEN_VOCAB_FILE)

    @classmethod
    def load_files(cls, ids_path: Path, vocab_path: Path) -> "PackedTokens":
        """Read the ids (npz) and the vocabulary (JSON) :meth:`save` wrote, from these two files."""
        with np.load(ids_path, allow_pickle=False) as arrays:
            ids, offsets = arrays["ids"], arrays["offsets"]
        vocab = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
        return cls(vocab, ids, offsets)


@dataclass(frozen=True, eq=False)
class BM25Snapshot:
    """An immutable state of the index: nodes, their bm25s index and tie-break order.

    Read-only internal state, handed out as is (no copy: the index and its filter-mask caches
    rely on these very objects): ``nodes`` are the index's own node objects, not copies. Read
    them; never change them (or their metadata, relationships, arrays): an edit would change what
    filters match and what later queries return without updating the BM25 index. For nodes of
    your own, use a retriever's results (copies) or ``node_copy.copy_node``.
    """

    nodes: Tuple[BaseNode, ...]
    bm25: Optional[bm25s.BM25]  # None when no node has a single term
    tie_order: np.ndarray  # position of each node id in sorted order (deterministic ties)
    tokens: Optional[PackedTokens]  # per node; None after loading an index saved without tokens
    node_ids: Tuple[str, ...]  # nodes[i].node_id, read once per snapshot (traces name candidates by position)
    # Term frequencies aligned with bm25's matrix (bm25_counts), kept so an update counts only
    # new tokens; None for bm25s's own methods, and after loading (counted on the first update).
    counts: Optional[TermCounts] = None
    # nodes[i].ref_doc_id (updates select the nodes to keep by id and ref doc id without reading
    # every node's relationships); None: read from the nodes when first needed.
    ref_doc_ids: Optional[Tuple[Optional[str], ...]] = None

    def node_refs(self) -> Tuple[Tuple[str, ...], Tuple[Optional[str], ...]]:
        """Each node's id and ref doc id, in order."""
        refs = self.ref_doc_ids
        if refs is None:
            refs = tuple(node.ref_doc_id for node in self.nodes)
        return self.node_ids, refs


class _SharedIndex:
    """The mutable holder of the current snapshot, shared by a retriever and its filtered views.

    Queries read ``snapshot`` once; writers build a new snapshot and swap it in under ``lock``.
    """

    def __init__(self, snapshot: BM25Snapshot) -> None:
        self.snapshot = snapshot
        self.lock = threading.Lock()


@dataclass(frozen=True)
class BM25Params:
    k1: float
    b: float
    method: str


def build_snapshot(
    nodes: Sequence[BaseNode],
    tokens: Sequence[Sequence[str]],
    params: BM25Params,
    counts: Optional[TermCounts] = None,
    ref_doc_ids: Optional[Sequence[Optional[str]]] = None,
) -> BM25Snapshot:
    """Index ``nodes`` (already tokenized as ``tokens``) with bm25s.

    For the :data:`~.bm25_counts.VECTORISED_METHODS` the matrix is built from term counts in
    arrays (``counts``, the tokens' own when given, e.g. updated from the previous snapshot's by
    :func:`~.bm25_counts.updated_counts`; else counted here): the same matrix bm25s builds.
    ``ref_doc_ids``: each node's ``ref_doc_id`` when the caller has them (else read when needed).
    """
    packed = PackedTokens.pack(tokens)
    bm25: Optional[bm25s.BM25] = None
    nodes = tuple(nodes)
    if params.method in VECTORISED_METHODS:
        if counts is None:
            counts = count_terms(packed.ids, packed.offsets)
        elif counts.n_docs != len(packed):
            raise ValueError(f"term counts of {counts.n_docs} documents for {len(packed)} token lists")
        bm25 = counted_index(counts, packed.vocab, params.k1, params.b, params.method)
    elif counts is not None:
        raise ValueError(f"term counts are kept for methods {VECTORISED_METHODS}, not {params.method!r}")
    elif len(packed.ids):
        bm25 = bm25s.BM25(k1=params.k1, b=params.b, method=params.method, backend="numpy")
        # create_empty_token=False: bm25s would otherwise add a "" term that is not in its score
        # matrix (and crash on an all-empty corpus).
        bm25.index(packed.bm25s_corpus(), create_empty_token=False, show_progress=False)
    node_ids = _node_ids(nodes)
    return BM25Snapshot(
        nodes=nodes, bm25=bm25, tie_order=_tie_order(node_ids), tokens=packed, node_ids=node_ids, counts=counts,
        ref_doc_ids=None if ref_doc_ids is None else tuple(ref_doc_ids),
    )


def _node_ids(nodes: Sequence[BaseNode]) -> Tuple[str, ...]:
    """Each node's id, in order."""
    return tuple(node.node_id for node in nodes)


def _tie_order(node_ids: Sequence[str]) -> np.ndarray:
    """Each node's position in node-id order (ties in a ranking are broken by node id)."""
    order = np.empty(len(node_ids), dtype=np.int64)
    order[sorted(range(len(node_ids)), key=node_ids.__getitem__)] = np.arange(len(node_ids))
    return order


def _check_unique_ids(nodes: Sequence[BaseNode]) -> None:
    seen: set = set()
    duplicates: set = set()
    for node in nodes:
        if node.node_id in seen:
            duplicates.add(node.node_id)
        seen.add(node.node_id)
    if duplicates:
        raise ValueError(f"node ids must be unique within one call; duplicated: {sorted(duplicates)[:10]!r}")


def top_bm25_positions(
    snapshot: BM25Snapshot,
    query_tokens: Sequence[str],
    top_k: int,
    filters: Optional[MetadataFilters] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """The best ``top_k`` node positions and raw BM25 scores for a tokenized query, as arrays.

    Every document sharing a query term is scored; those with score <= 0 or failing ``filters``
    are dropped; the rest are sorted by score (high first), then node id, and cut to ``top_k``.
    Returns ``(positions int64, scores float64)``, best first.
    """
    positions, top_scores, _ = top_bm25_with_scores(snapshot, query_tokens, top_k, filters)
    return positions, top_scores


def top_bm25_with_scores(
    snapshot: BM25Snapshot,
    query_tokens: Sequence[str],
    top_k: int,
    filters: Optional[MetadataFilters] = None,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`top_bm25_positions` plus every node's exact BM25 score from the same scoring pass
    (all 0 without a known query term): ``(positions int64, top scores float64, all scores float64)``."""
    bm25 = snapshot.bm25
    term_ids = [] if bm25 is None else [bm25.vocab_dict[t] for t in query_tokens if t in bm25.vocab_dict]
    if not term_ids:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64), np.zeros(len(snapshot.nodes), dtype=np.float64)
    scores = np.asarray(bm25.get_scores_from_ids(term_ids), dtype=np.float64)
    if bm25.nonoccurrence_array is None:
        # A document without any query term scores exactly 0 here, so positive = matching.
        candidates = np.flatnonzero(scores > 0)
    else:
        # BM25L / BM25+ give every document a base score: matches are the query terms' postings.
        indptr, indices = bm25.scores["indptr"], bm25.scores["indices"]
        postings = [indices[indptr[t] : indptr[t + 1]] for t in sorted(set(term_ids))]
        candidates = np.unique(np.concatenate(postings))
        candidates = candidates[scores[candidates] > 0]
    if filters is not None and candidates.size:
        candidates = candidates[filter_mask(snapshot.nodes, filters)[candidates]]
    if candidates.size > top_k:
        # Keep only scores >= the top_k-th best (ties at the cut included), then sort those.
        cut = np.partition(scores[candidates], candidates.size - top_k)[candidates.size - top_k]
        candidates = candidates[scores[candidates] >= cut]
    best = candidates[np.lexsort((snapshot.tie_order[candidates], -scores[candidates]))[:top_k]]
    return best.astype(np.int64, copy=False), scores[best], scores


def top_matches(
    snapshot: BM25Snapshot,
    query_tokens: Sequence[str],
    top_k: int,
    filters: Optional[MetadataFilters] = None,
) -> List[Tuple[int, float]]:
    """:func:`top_bm25_positions` as a list of (node position, raw BM25 score) pairs."""
    positions, scores = top_bm25_positions(snapshot, query_tokens, top_k, filters)
    return list(zip(positions.tolist(), scores.tolist()))


def persisted_node_json(node: BaseNode) -> bytes:
    """One node's entry in nodes.json: ``json.dumps(doc_to_json(node), ensure_ascii=False)`` as UTF-8.

    Cached per node object by :meth:`BM25Retriever.persist`: a snapshot's nodes are the index's
    own copies, never changed in place (updates build new snapshots around new copies; readers
    get copies). Those copies (``copy_node``) share nothing mutable with the node the caller
    inserted or with the copies retrieval hands out (metadata, relationships and their
    metadata, excluded-key lists, embedding), so the cached entry stays the node's.
    """
    return json.dumps(doc_to_json(node), ensure_ascii=False).encode("utf-8")


def _encode_node(node_id: str, node: BaseNode) -> bytes:
    return persisted_node_json(node)


# ----- persisting over an earlier persist -----------------------------------------------------------
#
# A persist into a folder holding an earlier one first moves the earlier payload into
# ``folder/.previous/`` (the config first), marks it complete, writes the new payload with the
# config last (atomic), then deletes ``.previous/``. Whenever it stops, the folder holds a whole
# index: the new one once ``folder/retriever.json`` exists, else the earlier one, read entry by
# entry from ``.previous/`` (or, for entries not moved yet, from the folder).


def _remove_entry(path: Path) -> None:
    """Delete a file, link or folder (not following links); missing is fine."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path)


def _fsync_payload(folder: Path) -> None:
    """Flush the payload written into ``folder`` (files, then folders, then ``folder``'s entries)
    before the config names it."""
    for name in _PAYLOAD[1:]:
        path = folder / name
        if not path.is_symlink() and path.exists():
            fsync_tree(path)  # and its parent, ``folder``


def _move_payload_aside(folder: Path, previous: Path) -> None:
    """Move the earlier payload entries still in ``folder`` into ``previous`` (the config first),
    then durably mark ``previous`` complete. An entry already in ``previous`` wins: the copy in
    ``folder`` is not part of the earlier index (load reads ``previous``'s) and is removed."""
    for name in _PAYLOAD:
        source = folder / name
        if not os.path.lexists(source):
            continue
        if os.path.lexists(previous / name):
            _remove_entry(source)
        else:
            os.replace(source, previous / name)
    fsync_dir(previous)
    fsync_dir(folder)
    with atomic_writer(previous / _COMPLETE_MARKER, make_parents=False) as fh:
        fh.write("")


def _clear_previous(folder: Path) -> None:
    """Delete ``folder/.previous``: the payload entries and marker in it, then the folder itself.
    Anything else in it was not written by persist: kept, and a ValueError naming it."""
    previous = folder / _PREVIOUS_DIR
    if not os.path.lexists(previous):
        return
    if previous.is_dir() and not previous.is_symlink():
        for name in (*_PAYLOAD, _COMPLETE_MARKER):
            _remove_entry(previous / name)
        for leftover in previous.glob(f".{_COMPLETE_MARKER}.*.tmp"):  # an interrupted marker write
            leftover.unlink(missing_ok=True)
        others = sorted(p.name for p in previous.iterdir())
        if others:
            raise ValueError(
                f"{previous} holds {others}, which BM25Retriever.persist did not write; it uses that folder "
                "to keep the earlier index while writing a new one. Move them elsewhere and persist again."
            )
        previous.rmdir()
    else:
        raise ValueError(f"{previous} is not a folder; BM25Retriever.persist keeps the earlier index there. Move it elsewhere.")
    fsync_dir(folder)


def _remove_previous(folder: Path) -> None:
    """:func:`_clear_previous` once the new index is complete: a failure is only logged (a stale
    ``.previous`` beside a complete config is ignored by load and removed by the next persist)."""
    try:
        _clear_previous(folder)
    except (OSError, ValueError) as exc:
        logger.warning("%s: could not delete %s after persisting (%s)", folder, folder / _PREVIOUS_DIR, exc)


def _set_aside_earlier(folder: Path) -> bool:
    """Make ``folder`` ready for a new payload without losing the index it holds; returns whether
    an earlier index was set aside in ``folder/.previous`` (to delete once the new one is complete).

    A folder without an earlier persist is left as it is (and False returned). After an
    interrupted persist, ``.previous`` holds the earlier index: the entries not moved yet are
    moved, or, once it is complete, the new entries the interrupted persist left are removed."""
    previous = folder / _PREVIOUS_DIR
    config_here = (folder / _CONFIG_FILE).exists()
    config_aside = (previous / _CONFIG_FILE).exists()
    for leftover in folder.glob(_CONFIG_TEMP_GLOB):  # an interrupted atomic write of the config
        leftover.unlink(missing_ok=True)
    if config_here:
        _clear_previous(folder)  # left by a persist that completed
        previous.mkdir()
        fsync_dir(folder)
        _move_payload_aside(folder, previous)
        return True
    if not config_aside:
        return False
    if not (previous / _COMPLETE_MARKER).exists():
        _move_payload_aside(folder, previous)  # what is still in the folder is the earlier index's
    else:
        for name in _PAYLOAD[1:]:  # the interrupted persist's partial files
            _remove_entry(folder / name)
        fsync_dir(folder)
    return True


def _payload_paths(folder: Path) -> Tuple[Dict[str, Path], bool]:
    """Where :meth:`BM25Retriever.load` reads each payload entry, and whether that is the earlier
    index an interrupted persist left in ``folder/.previous`` (entries it has not moved there
    yet are still in ``folder``; once it is complete, every one it uses is there)."""
    previous = folder / _PREVIOUS_DIR
    if (folder / _CONFIG_FILE).exists() or not (previous / _CONFIG_FILE).exists():
        return {name: folder / name for name in _PAYLOAD}, False
    complete = (previous / _COMPLETE_MARKER).exists()
    paths = {name: previous / name if complete or os.path.lexists(previous / name) else folder / name for name in _PAYLOAD}
    return paths, True


def _write_payload(folder: Path, snapshot: BM25Snapshot, fragments: Sequence[bytes], config: Dict[str, Any]) -> None:
    """Write ``snapshot`` (nodes.json from ``fragments``, ``config`` last) into ``folder``, setting
    an earlier persist aside until the new one is complete (the caller holds the folder's lock)."""
    replacing = _set_aside_earlier(folder)
    if snapshot.bm25 is not None:
        snapshot.bm25.save(folder / _BM25S_DIR, show_progress=False)
    with open(folder / _NODES_FILE, "wb") as f:
        f.write(b"[")
        f.write(b", ".join(fragments))
        f.write(b"]")
    if snapshot.tokens is not None:
        snapshot.tokens.save(folder)
    if replacing:  # on disk before the config makes them the index and the earlier one is deleted
        _fsync_payload(folder)
    # Last and in one rename: from here on the folder holds the new index. Its permissions are
    # those open() gave nodes.json (the umask's), as when the config was written with open().
    mode = stat.S_IMODE((folder / _NODES_FILE).stat().st_mode)
    with atomic_writer(folder / _CONFIG_FILE, file_mode=mode, sync_folder=replacing) as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    if replacing:
        _remove_previous(folder)


def _check_params(k1: float, b: float, method: str, similarity_top_k: int) -> None:
    if not isinstance(k1, (int, float)) or isinstance(k1, bool) or not k1 >= 0 or not np.isfinite(k1):
        raise ValueError(f"k1 must be a finite number >= 0, got {k1!r}")
    if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0 <= b <= 1:
        raise ValueError(f"b must be a number in [0, 1], got {b!r}")
    if method not in BM25_METHODS:
        raise ValueError(f"method {method!r} is not supported; use one of {BM25_METHODS}")
    check_positive_int("similarity_top_k", similarity_top_k)


class BM25Retriever(BaseRetriever):
    """Keyword retriever: bm25s scores, per-query metadata filters, persistence, incremental updates.

    Filters: ``filters`` given here apply to every query. For other filters per query use
    :meth:`with_filters`, which returns a cheap view sharing this index (inserts and deletes on
    either are seen by both), e.g. ``bm25.with_filters(f).retrieve("query")``; views also plug
    into :class:`HybridRetriever` or any LlamaIndex pipeline.

    Nodes are copied on insert (metadata deep-copied) and every result carries a fresh copy, so
    neither the caller's nodes nor downstream postprocessors can change what the index holds.

    Updates (:meth:`insert_nodes`, :meth:`replace_documents`, :meth:`delete_ref_doc`, :meth:`delete_nodes`) make a new bm25s
    index of the kept nodes plus the new ones. Tokens are kept (and persisted with the index), so
    only new text is tokenized; for ``lucene``, ``robertson`` and ``atire`` the term counts are
    kept too, so only new tokens are counted and the matrix (the one bm25s builds, bit for bit:
    :mod:`.bm25_counts`) is recomputed in numpy, O(matrix entries) per call; ``bm25l`` / ``bm25+``
    are rebuilt by bm25s, O(corpus tokens) in Python. An index saved before tokens were persisted
    re-tokenizes its nodes once, on the first update after :meth:`load`. Batch your updates.
    Writers are serialised; queries see either the old or the new index, never a mix.

    Example:
        >>> bm25 = BM25Retriever.from_nodes(nodes, tokenizer_config=BM25TokenizerConfig(stemmer_language=None))
        >>> bm25.with_filters(MetadataFilters(filters=[MetadataFilter(key="lang", value="en")])).retrieve("refund")
    """

    def __init__(
        self,
        nodes: Sequence[BaseNode] = (),
        *,
        tokenizer_config: Optional[BM25TokenizerConfig] = None,
        k1: float = 1.5,
        b: float = 0.75,
        method: str = "lucene",
        similarity_top_k: int = 10,
        filters: Optional[MetadataFilters] = None,
        metadata_mode: MetadataMode = MetadataMode.NONE,
        callback_manager: Optional[CallbackManager] = None,
        verbose: bool = False,
    ) -> None:
        """Index ``nodes``; see the class docstring for the parameters' meaning.

        Args:
            nodes: Nodes to index (copied; node ids must be unique).
            tokenizer_config: Tokenization settings; default English stopwords + English stemmer.
            k1: BM25 term-frequency saturation (>= 0).
            b: BM25 length normalisation in [0, 1].
            method: bm25s scoring variant, one of ``BM25_METHODS``.
            similarity_top_k: Number of results per query (>= 1).
            filters: Metadata filters applied to every query (None: no filtering).
            metadata_mode: Which metadata is indexed along with the text (``node.get_content(mode)``).
        """
        super().__init__(callback_manager=callback_manager, verbose=verbose)
        _check_params(k1, b, method, similarity_top_k)
        if tokenizer_config is None:
            tokenizer_config = BM25TokenizerConfig()
        if not isinstance(tokenizer_config, BM25TokenizerConfig):
            raise ValueError(f"tokenizer_config must be a BM25TokenizerConfig, got {type(tokenizer_config).__name__}")
        self._tokenizer_config = tokenizer_config
        self._tokenize = build_tokenizer(tokenizer_config)
        self._params = BM25Params(k1=float(k1), b=float(b), method=method)
        self._metadata_mode = MetadataMode(metadata_mode)
        self._similarity_top_k = similarity_top_k
        self._filters = validate_filters(filters)
        nodes = self._checked_copies(nodes)
        self._shared = _SharedIndex(build_snapshot(nodes, [self._tokens_of(n) for n in nodes], self._params))
        self._node_json: FragmentCache[str] = FragmentCache()  # persist's per-node JSON, shared by views

    @classmethod
    def from_nodes(
        cls,
        nodes: Sequence[BaseNode],
        tokenizer_config: Optional[BM25TokenizerConfig] = None,
        k1: float = 1.5,
        b: float = 0.75,
        method: str = "lucene",
        similarity_top_k: int = 10,
        **kwargs: Any,
    ) -> "BM25Retriever":
        """Build a retriever over ``nodes`` (same arguments as the constructor)."""
        return cls(
            nodes,
            tokenizer_config=tokenizer_config,
            k1=k1,
            b=b,
            method=method,
            similarity_top_k=similarity_top_k,
            **kwargs,
        )

    # ----- properties -------------------------------------------------------------------------

    @property
    def tokenizer_config(self) -> BM25TokenizerConfig:
        """The tokenizer settings (immutable)."""
        return self._tokenizer_config

    @property
    def filters(self) -> Optional[MetadataFilters]:
        """The metadata filters applied to every query of this retriever (or view); assigning new
        ones validates them (a view's filters are its own, see :meth:`with_filters`)."""
        return self._filters

    @filters.setter
    def filters(self, filters: Optional[MetadataFilters]) -> None:
        self._filters = validate_filters(filters)

    @property
    def similarity_top_k(self) -> int:
        """Number of results per query."""
        return self._similarity_top_k

    @property
    def params(self) -> Dict[str, Any]:
        """BM25 parameters: k1, b, method."""
        return {"k1": self._params.k1, "b": self._params.b, "method": self._params.method}

    @property
    def nodes(self) -> List[BaseNode]:
        """Copies of the indexed nodes, in index order."""
        return [copy_node(n) for n in self._shared.snapshot.nodes]

    def __len__(self) -> int:
        return len(self._shared.snapshot.nodes)

    def tokenize(self, text: str) -> List[str]:
        """The BM25 terms of ``text`` under this retriever's tokenizer settings."""
        return self._tokenize(text)

    def with_filters(
        self,
        filters: Optional[MetadataFilters],
        similarity_top_k: Optional[int] = None,
        callback_manager: Optional[CallbackManager] = None,
        verbose: Optional[bool] = None,
    ) -> "BM25Retriever":
        """A view of this index with other metadata filters (None: unfiltered) and, optionally,
        another number of results, callback manager or verbosity; shares the index."""
        view = copy.copy(self)
        view._filters = validate_filters(filters)
        if similarity_top_k is not None:
            check_positive_int("similarity_top_k", similarity_top_k)
            view._similarity_top_k = similarity_top_k
        if callback_manager is not None:
            view.callback_manager = callback_manager
        if verbose is not None:
            view._verbose = bool(verbose)
        return view

    @property
    def snapshot(self) -> BM25Snapshot:
        """The current immutable state (nodes in index order, bm25s index); an update swaps in a
        new one, so holding this object pins one consistent state. Read-only internal state: its
        nodes are the index's own objects, not copies (see :class:`BM25Snapshot`): never edit them."""
        return self._shared.snapshot

    def restore_snapshot(self, snapshot: BM25Snapshot) -> None:
        """Make ``snapshot`` (from :attr:`snapshot`, of this index or one loaded from its folder)
        the state every view of this index answers from, atomically (roll-backs of a failed write)."""
        if not isinstance(snapshot, BM25Snapshot):
            raise TypeError(f"snapshot must be a BM25Snapshot, got {type(snapshot).__name__}")
        with self._shared.lock:
            self._shared.snapshot = snapshot

    # ----- retrieval --------------------------------------------------------------------------

    def retrieve(self, str_or_query_bundle: QueryType) -> List[NodeWithScore]:
        """``BaseRetriever.retrieve`` with the query checked first (a str or a QueryBundle)."""
        return super().retrieve(checked_query(str_or_query_bundle))

    async def aretrieve(self, str_or_query_bundle: QueryType) -> List[NodeWithScore]:
        """``BaseRetriever.aretrieve`` with the query checked first (a str or a QueryBundle)."""
        return await super().aretrieve(checked_query(str_or_query_bundle))

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        query = check_query_text(query_bundle.query_str)
        snapshot = self._shared.snapshot
        matches = top_matches(snapshot, self._tokenize(query), self._similarity_top_k, self._filters)
        logger.debug("bm25 query %r: %d results", query_bundle.query_str[:80], len(matches))
        return [NodeWithScore(node=copy_node(snapshot.nodes[i]), score=score) for i, score in matches]

    # ----- updates ----------------------------------------------------------------------------

    def insert_nodes(self, nodes: Sequence[BaseNode], tokens: Optional[Sequence[Sequence[str]]] = None) -> None:
        """Add ``nodes``; an indexed node with the same node id is replaced (LlamaIndex's convention).

        Other nodes stay, those of the same documents included, so a document's chunks can be
        inserted in several batches. To replace whole documents (their old chunks dropped even when
        the new version has fewer or differently named ones) use :meth:`replace_documents`.
        A node id already indexed for another document (ref doc id), or given to nodes of two
        documents in ``nodes``, is refused with :class:`~.node_identity.ChunkIdConflictError`
        before anything changes (it would silently replace that document's chunk).
        Rebuilds the bm25s index (see class doc). ``tokens``: each node's :meth:`node_tokens`,
        when the caller already has them (a node is then tokenized once); not checked beyond
        their number.
        """
        incoming, tokens = self._incoming(nodes, tokens)
        if not incoming:
            return
        new_ids = {n.node_id for n in incoming}
        self._rebuild(lambda node_id, ref: node_id not in new_ids, incoming, tokens, replaced_docs=frozenset())

    def replace_documents(
        self,
        nodes: Sequence[BaseNode],
        tokens: Optional[Sequence[Sequence[str]]] = None,
        doc_ids: Sequence[str] = (),
    ) -> int:
        """Replace whole documents: remove every indexed node of the documents in ``doc_ids`` and of
        those ``nodes`` belong to (their ref doc ids), and any indexed node with one of their node
        ids, then add ``nodes``; one rebuild. Returns how many indexed nodes were removed.

        This is how ``HybridIndex.upsert`` writes a new version of documents: old chunks go even
        when the new version has fewer or differently named ones, and a document in ``doc_ids``
        with no node in ``nodes`` is emptied. A node id already indexed for a document not being
        replaced is refused with :class:`~.node_identity.ChunkIdConflictError`, as in
        :meth:`insert_nodes`. ``tokens`` as in :meth:`insert_nodes`.
        """
        if isinstance(doc_ids, str) or not all(isinstance(d, str) for d in doc_ids):
            raise ValueError(f"doc_ids must be a list of str document ids, got {doc_ids!r:.200}")
        incoming, tokens = self._incoming(nodes, tokens)
        replaced = frozenset(doc_ids) | {n.ref_doc_id for n in incoming if n.ref_doc_id is not None}
        if not incoming and not replaced:
            return 0
        new_ids = {n.node_id for n in incoming}
        return self._rebuild(
            lambda node_id, ref: node_id not in new_ids and (ref is None or ref not in replaced),
            incoming,
            tokens,
            replaced_docs=replaced,
        )

    def _incoming(
        self, nodes: Sequence[BaseNode], tokens: Optional[Sequence[Sequence[str]]]
    ) -> Tuple[List[BaseNode], Optional[List[List[str]]]]:
        """Copies of ``nodes`` (checked) and their token lists as lists (None: tokenized later)."""
        incoming = self._checked_copies(nodes)
        if tokens is None:
            return incoming, None
        token_lists = [list(t) for t in tokens]
        if len(token_lists) != len(incoming):
            raise ValueError(f"got {len(incoming)} nodes but {len(token_lists)} token lists")
        return incoming, token_lists

    def delete_ref_doc(self, ref_doc_id: str) -> int:
        """Remove every node whose ref doc id is ``ref_doc_id``; returns how many were removed."""
        return self._rebuild(lambda node_id, ref: ref != ref_doc_id, [])

    def delete_nodes(self, node_ids: Sequence[str]) -> int:
        """Remove the nodes with these node ids; returns how many were removed."""
        drop = set(node_ids)
        return self._rebuild(lambda node_id, ref: node_id not in drop, [])

    def _rebuild(
        self,
        keep: Callable[[str, Optional[str]], bool],
        incoming: List[BaseNode],
        incoming_tokens: Optional[List[List[str]]] = None,
        replaced_docs: Collection[str] = frozenset(),
    ) -> int:
        """Swap in a snapshot of the nodes that ``keep(node_id, ref_doc_id)`` keeps plus ``incoming``;
        returns the number removed. An incoming node id indexed for a document not in
        ``replaced_docs`` is a :class:`~.node_identity.ChunkIdConflictError` (nothing changes)."""
        with self._shared.lock:
            old = self._shared.snapshot
            node_ids, refs = old.node_refs()
            if incoming:
                wanted = {n.node_id for n in incoming}
                owners = {node_id: ref for node_id, ref in zip(node_ids, refs) if node_id in wanted}
                check_chunk_ids(incoming, owners.get, replaced_docs)
            kept = [i for i, (node_id, ref) in enumerate(zip(node_ids, refs)) if keep(node_id, ref)]
            removed = len(old.nodes) - len(kept)
            if removed == 0 and not incoming:
                return 0
            old_tokens = old.tokens
            if old_tokens is None:  # loaded from a folder saved without tokens
                old_tokens = PackedTokens.pack([self._tokens_of(n) for n in old.nodes])
            nodes = [old.nodes[i] for i in kept] + incoming
            if incoming_tokens is None:
                incoming_tokens = [self._tokens_of(n) for n in incoming]
            tokens = old_tokens.select(kept).extend(incoming_tokens)
            counts = None
            if old.counts is not None:  # count only the new tokens (same matrix as counting all)
                start = int(tokens.offsets[len(kept)])
                counts = updated_counts(old.counts, kept, tokens.ids[start:], tokens.offsets[len(kept):] - start)
            kept_refs = [refs[i] for i in kept] + [n.ref_doc_id for n in incoming]
            self._shared.snapshot = build_snapshot(nodes, tokens, self._params, counts, kept_refs)
        logger.info("bm25 index rebuilt: %d removed, %d added, %d nodes", removed, len(incoming), len(nodes))
        return removed

    def node_tokens(self, node: BaseNode) -> List[str]:
        """The BM25 terms this index stores for ``node`` (its content in this index's metadata mode)."""
        return self._tokenize(node.get_content(metadata_mode=self._metadata_mode))

    _tokens_of = node_tokens

    @staticmethod
    def _checked_copies(nodes: Sequence[BaseNode]) -> List[BaseNode]:
        bad = [type(n).__name__ for n in nodes if not isinstance(n, BaseNode)]
        if bad:
            raise ValueError(f"nodes must be llama_index BaseNode objects, got {sorted(set(bad))}")
        check_chunk_ids(nodes)  # two documents' nodes with one id: named as such
        _check_unique_ids(nodes)
        return [copy_node(n) for n in nodes]

    # ----- persistence ------------------------------------------------------------------------

    def cached_json_bytes(self) -> int:
        """Bytes of node JSON kept for the next :meth:`persist` (what the cache adds to the index's memory)."""
        return self._node_json.cached_bytes()

    def persist(self, folder: Union[str, Path]) -> None:
        """Save the bm25s index, the nodes (JSON), their tokens, the tokenizer settings and the parameters.

        Only this payload is written (``retriever.json``, ``nodes.json``, ``bm25s/``, ``tokens.npz``,
        ``tokens_vocab.json``); other files in ``folder`` are left alone. Over an earlier persist, a
        failure or crash part-way never loses it: the earlier payload waits in ``folder/.previous/``
        until the new one is complete (``retriever.json`` is written last, atomically), and
        :meth:`load` reads the earlier index until a persist completes. Persists into one folder
        run one at a time, from threads or processes (the folder is locked meanwhile, see
        :func:`~llama_index_retrieval_kit._files.folder_lock`; no file is added to it), and a
        :meth:`load` waits for a running persist: it reads the earlier index or the new one, never a mix.

        Filters and ``custom_tokenizer`` are not saved: pass them to :meth:`load`. Each node's
        JSON is kept (shared with this index's views) and reused while the node stays indexed,
        so a persist after a small update encodes only the new nodes; the memory this takes is
        :meth:`cached_json_bytes`.

        Raises:
            FolderLockTimeout: (:class:`llama_index_retrieval_kit.indices.FolderLockTimeout`, a
                ``RuntimeError``, not an ``OSError``) another thread or process kept ``folder``
                locked (persisting into it, or loading it) for longer than 60 s, e.g. a process
                stopped half-way; none of the payload was written.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        snapshot = self._shared.snapshot
        # Bytes of json.dumps([doc_to_json(n) for n in nodes], ensure_ascii=False), from each
        # node's cached encoding (persisted_node_json): only nodes new since the last persist
        # are encoded. Encoded before any file is touched: a node that cannot be encoded changes nothing.
        fragments = self._node_json.fragments(zip(snapshot.node_ids, snapshot.nodes), _encode_node)
        config = {
            "format_version": PERSIST_FORMAT_VERSION,
            "bm25s_version": bm25s.__version__,
            "k1": self._params.k1,
            "b": self._params.b,
            "method": self._params.method,
            "similarity_top_k": self._similarity_top_k,
            "metadata_mode": self._metadata_mode.value,
            "num_nodes": len(snapshot.nodes),
            "has_bm25_index": snapshot.bm25 is not None,
            "has_tokens": snapshot.tokens is not None,
            "tokenizer": self._tokenizer_config.to_persisted(),
        }
        with folder_lock(folder):  # one persist at a time; loads wait for it (see load)
            _write_payload(folder, snapshot, fragments, config)
        logger.info("bm25 index with %d nodes saved to %s", len(snapshot.nodes), folder)

    @classmethod
    def load(
        cls,
        folder: Union[str, Path],
        *,
        custom_tokenizer: Optional[Callable[[str], List[str]]] = None,
        filters: Optional[MetadataFilters] = None,
        similarity_top_k: Optional[int] = None,
        callback_manager: Optional[CallbackManager] = None,
        verbose: bool = False,
    ) -> "BM25Retriever":
        """Load a retriever saved by :meth:`persist`; it scores exactly like the saved one.

        When the last persist into ``folder`` was interrupted, the index it was replacing is loaded
        (with a warning). Nothing is written. A persist running into ``folder`` (another thread or
        process) is waited for; loads run together (a shared lock of the folder, taken in
        read-only folders too).

        Args:
            folder: The folder given to ``persist``.
            custom_tokenizer: Required if (and only if) the index was built with one; pass the same callable.
            filters: Metadata filters for the loaded retriever (not persisted).
            similarity_top_k: Override the saved number of results per query.

        Raises:
            FolderLockTimeout: (:class:`llama_index_retrieval_kit.indices.FolderLockTimeout`, a
                ``RuntimeError``, not an ``OSError``) a persist into ``folder`` (another thread or
                process) kept it locked for longer than 60 s, e.g. a process stopped half-way
                through its persist.
        """
        folder = Path(folder)
        with folder_lock(folder, shared=True):
            return cls._load_unlocked(folder, custom_tokenizer, filters, similarity_top_k, callback_manager, verbose)

    @classmethod
    def _load_unlocked(
        cls,
        folder: Path,
        custom_tokenizer: Optional[Callable[[str], List[str]]],
        filters: Optional[MetadataFilters],
        similarity_top_k: Optional[int],
        callback_manager: Optional[CallbackManager],
        verbose: bool,
    ) -> "BM25Retriever":
        """:meth:`load`, with the folder's lock held by the caller."""
        paths, interrupted = _payload_paths(folder)
        config_path = paths[_CONFIG_FILE]
        if not config_path.exists():
            raise ValueError(f"{folder} holds no {_CONFIG_FILE}; is it a folder written by BM25Retriever.persist?")
        if interrupted:
            logger.warning(
                "%s: a persist into this folder was interrupted; loading the index it was replacing (from %s). "
                "Persist again to finish replacing it.",
                folder,
                folder / _PREVIOUS_DIR,
            )
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if config.get("format_version") != PERSIST_FORMAT_VERSION:
            raise ValueError(
                f"unsupported BM25Retriever format_version {config.get('format_version')!r} in {config_path}; "
                f"this version reads {PERSIST_FORMAT_VERSION}"
            )
        tokenizer = dict(config["tokenizer"])
        uses_custom = tokenizer.pop("uses_custom_tokenizer")
        if uses_custom and custom_tokenizer is None:
            raise ValueError(
                f"the index in {folder} was built with a custom tokenizer, which is not persisted; "
                "pass the same callable as BM25Retriever.load(..., custom_tokenizer=...)"
            )
        if not uses_custom and custom_tokenizer is not None:
            raise ValueError(
                f"the index in {folder} was built without a custom tokenizer; loading it with one would "
                "tokenize queries differently from the index. Omit custom_tokenizer."
            )
        tokenizer_config = BM25TokenizerConfig(**tokenizer, custom_tokenizer=custom_tokenizer)
        retriever = cls(
            tokenizer_config=tokenizer_config,
            k1=config["k1"],
            b=config["b"],
            method=config["method"],
            similarity_top_k=similarity_top_k if similarity_top_k is not None else config["similarity_top_k"],
            filters=filters,
            metadata_mode=MetadataMode(config["metadata_mode"]),
            callback_manager=callback_manager,
            verbose=verbose,
        )
        nodes = [json_to_doc(d) for d in json.loads(paths[_NODES_FILE].read_text(encoding="utf-8"))]
        if len(nodes) != config["num_nodes"]:
            raise ValueError(f"{folder}: {_NODES_FILE} holds {len(nodes)} nodes, expected {config['num_nodes']}")
        bm25 = None
        if config["has_bm25_index"]:
            bm25 = bm25s.BM25.load(paths[_BM25S_DIR], load_corpus=False, show_progress=False)
            if bm25.scores["num_docs"] != len(nodes):
                raise ValueError(
                    f"{folder}: the bm25s index has {bm25.scores['num_docs']} documents but there are {len(nodes)} nodes"
                )
        tokens = None
        if config.get("has_tokens"):  # indexes saved before tokens were persisted re-tokenize on their first update
            tokens = PackedTokens.load_files(paths[_TOKEN_IDS_FILE], paths[_TOKEN_VOCAB_FILE])
            if len(tokens) != len(nodes):
                raise ValueError(f"{folder}: {_TOKEN_IDS_FILE} holds tokens of {len(tokens)} nodes, expected {len(nodes)}")
        nodes = tuple(nodes)
        node_ids = _node_ids(nodes)
        retriever._shared = _SharedIndex(
            BM25Snapshot(nodes=nodes, bm25=bm25, tie_order=_tie_order(node_ids), tokens=tokens, node_ids=node_ids)
        )
        logger.info("bm25 index with %d nodes loaded from %s", len(nodes), folder)
        return retriever
