"""``IndexManifest``: the typed ``index.json`` of a ``HybridIndex`` folder.

The one owner of the file's keys. Reading treats the file as untrusted input: every value is
checked by :func:`.storage.validate_manifest` (a bad one is a :class:`.storage.DamagedIndexError`
naming the file, the key and the value) before the model is built. Writing is one atomic rename
(:func:`.storage.write_json_atomic`). The models are frozen and strict (no
coercion: a wrong type is an error): an update is a new manifest (``with_*`` methods), never a
dict changed in place.

Keys (formats 1 and 2 share them; the JSON written is the JSON read, unknown keys kept)::

    format_version     2 (1: points in Qdrant local mode, migrated on open)
    embed_model        the embedding model's name; embed_model_class its class (absent in early folders)
    embed_settings     the model's settings that change document vectors (models.document_vector_settings:
                       {} for a model used as it comes); absent in folders written before it (not checked)
    embed_dim          the vector dimension (null until the first chunk is embedded)
    node_parser        the node parser's to_dict() (rebuilt by build_node_parser)
    bm25               k1, b, method, avgdl (avgdl: frozen at the first write, the sparse vectors' length norm)
    bm25_tokenizer     BM25TokenizerConfig.to_persisted()
    qdrant_url         the Qdrant server, or null (embedded Qdrant Edge shard in edge/)
    collection         the collection name (on a server, the build collection the folder reads; see store.ServerCollections)
    index_id           the index's random id, kept by upserts and rebuilds of the folder, written into the
                       metadata of the server collections it writes (absent in folders written before it)
    embed_batch_size   texts per embedding call
    generation         the committed generation N (bm25/gen-N, docstore/gen-N.json)
    pending            the write journal: {generation: N + 1, touched_ids} while a write runs, else null
    integrity          sha256 of generation N's files and its chunk count (absent before checksums)
    build_id           a random id of the build that made the folder, new at each build and rebuild (absent
                       before build ids): an open index that finds another one on disk was rebuilt under it

The committed state these keys name (build, generation, checksums) is :attr:`IndexManifest.folder_state`,
which ``push_to`` records in the server copy it makes (:class:`FolderState`).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from llama_index.core.node_parser import NodeParser
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import storage

#: The folder format this version writes.
FORMAT_VERSION = 2
#: Folder formats this version opens: 1 (Qdrant local mode in ``qdrant/``, migrated on open), 2 (Qdrant Edge in ``edge/``).
READABLE_FORMATS = (1, 2)
#: The collection (Qdrant) / shard name of a new index.
COLLECTION = "chunks"

# Keys written only when they hold a value: folders written before them lack them.
_OMITTED_WHEN_NONE = ("embed_model_class", "embed_settings", "integrity", "index_id", "build_id")
#: The form of ``index_id``: 32 lower-case hex digits (:func:`new_index_id`).
INDEX_ID_PATTERN = r"^[0-9a-f]{32}$"


def embed_settings_of(embed_model: Any) -> Dict[str, Any]:
    """The document-vector settings of ``embed_model`` as ``index.json`` records them:
    :func:`~llama_index_retrieval_kit.models.document_vector_settings` after a JSON round trip
    (a tuple reads back as a list), so that a recorded value and a live model's compare equal."""
    from ..models import document_vector_settings

    return json.loads(json.dumps(document_vector_settings(embed_model), sort_keys=True))


def new_index_id() -> str:
    """A new random index id (uuid4, 32 hex digits)."""
    return uuid.uuid4().hex


def new_build_id() -> str:
    """A new random build id (uuid4, 32 hex digits), given to each build and rebuild."""
    return uuid.uuid4().hex


class BM25Settings(BaseModel):
    """BM25 parameters of the index (Lucene BM25, as bm25s scores it)."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    k1: float = Field(description="Term-frequency saturation: tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl)).")
    b: float = Field(description="Length normalisation, 0 (none) to 1 (full).")
    method: str = Field(default="lucene", description="The bm25s scoring variant.")
    avgdl: Optional[float] = Field(
        default=None,
        description="Average chunk length in tokens, fixed at the first write: the length norm of the stored sparse vectors.",
    )


class PendingWrite(BaseModel):
    """The journal of a write in progress: the generation it will commit and every node id it touches."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    generation: int = Field(description="The generation the write commits: the committed one + 1.")
    touched_ids: Tuple[str, ...] = Field(strict=False, description="Node ids whose points the write may change, sorted.")


class GenerationRecord(BaseModel):
    """What a commit recorded of its generation, checked on open (:func:`.storage.verify_generation`)."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    generation: int = Field(description="The committed generation the record describes.")
    files: Dict[str, str] = Field(description="sha256 hex digest of each file, by path relative to the folder.")
    chunks: int = Field(description="Number of indexed chunks (BM25 documents and store points).")

    def as_dict(self) -> Dict[str, Any]:
        """The record as :mod:`.storage` reads it."""
        return self.model_dump(mode="json")


class FolderState(BaseModel):
    """Which committed state of a folder something holds: what ``push_to`` records in the metadata
    of the server copy it makes, so that ``HybridIndex.load(dir, qdrant_url=)`` serves a copy only
    of the state the folder has committed (:attr:`IndexManifest.folder_state`).

    Two states are the same when all three fields are equal: the build (a rebuild is another
    state even at the same generation), the generation (each commit a new one), and the digest of
    the generation's checksums (two copies of one folder that committed different writes at the
    same generation differ there)."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    build_id: Optional[str] = Field(description="index.json's build_id (None: built before build ids).")
    generation: int = Field(description="The committed generation.")
    digest: Optional[str] = Field(
        description="sha256 hex digest of the generation's integrity record (its files' sha256 and chunk count, "
        "canonical JSON); None for a folder written before checksums."
    )

    @classmethod
    def from_json(cls, data: Any) -> Optional["FolderState"]:
        """The state recorded as ``data`` (:meth:`to_json`), or None when it is not one (absent,
        written by another program, or malformed: never trusted as a match)."""
        if not isinstance(data, dict):
            return None
        try:
            return cls.model_validate(data)
        except ValidationError:
            return None

    def to_json(self) -> Dict[str, Any]:
        """The state as a JSON object (what a server collection's metadata holds)."""
        return self.model_dump(mode="json")

    def describe(self) -> str:
        """A short human form: ``generation 5 of build 1a2b3c4d (content 9f8e7d6c)``."""
        build = f"build {self.build_id[:8]}" if self.build_id else "a build without id"
        content = f" (content {self.digest[:8]})" if self.digest else ""
        return f"generation {self.generation} of {build}{content}"


def integrity_digest(record: Optional[Dict[str, Any]]) -> Optional[str]:
    """sha256 of an integrity record (:attr:`IndexManifest.integrity_record`) as canonical JSON
    (sorted keys, no spaces); None for None."""
    if record is None:
        return None
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class IndexManifest(BaseModel):
    """The content of ``index.json`` (see the module docstring for each key)."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    format_version: int = Field(default=FORMAT_VERSION, description="Folder format (READABLE_FORMATS are opened).")
    embed_model: str = Field(description="Name of the embedding model the vectors come from.")
    embed_model_class: Optional[str] = Field(default=None, description="Class name of that model (error messages).")
    embed_settings: Optional[Dict[str, Any]] = Field(
        default=None,
        description="Settings of the model that change document vectors (embed_settings_of; {}: the model as it comes), "
        "recorded at build; None: a folder written before they were recorded, opened without checking them.",
    )
    embed_dim: Optional[int] = Field(default=None, description="Vector dimension; None until the first chunk is embedded.")
    node_parser: Dict[str, Any] = Field(description="The node parser's to_dict(), with its class_name.")
    bm25: BM25Settings = Field(description="BM25 parameters.")
    bm25_tokenizer: Dict[str, Any] = Field(description="BM25TokenizerConfig.to_persisted().")
    qdrant_url: Optional[str] = Field(default=None, description="Qdrant server URL, or None for the embedded shard.")
    collection: str = Field(default=COLLECTION, description="Collection / shard name (letters, digits, '_', '-').")
    embed_batch_size: int = Field(default=256, description="Texts per embedding call.")
    generation: int = Field(default=0, description="The committed generation.")
    pending: Optional[PendingWrite] = Field(default=None, description="The journal of an unfinished write, or None.")
    integrity: Optional[GenerationRecord] = Field(default=None, description="Checksums of the committed generation.")
    index_id: Optional[str] = Field(
        default=None,
        pattern=INDEX_ID_PATTERN,
        description="Random id of the index, kept by upserts and rebuilds; marks the server collections it writes (None: written before ids).",
    )
    build_id: Optional[str] = Field(
        default=None,
        pattern=INDEX_ID_PATTERN,
        description="Random id of the build that made the folder, new at each (re)build (new_build_id); None: built before build ids.",
    )

    # ------------------------------------------------------------------ reading and writing
    @classmethod
    def from_json(
        cls, data: Any, path: Path | str, readable: int | Sequence[int] = READABLE_FORMATS, storage_dir: Optional[Path | str] = None
    ) -> "IndexManifest":
        """The manifest of parsed ``index.json`` data, after :func:`.storage.validate_manifest`
        (``ValueError`` for a format not in ``readable``, :class:`.storage.DamagedIndexError`
        naming ``path``, the key and the value for anything else wrong)."""
        return cls._from_validated(storage.validate_manifest(data, path, readable, storage_dir), path, storage_dir)

    @classmethod
    def read(
        cls, path: Path | str, readable: int | Sequence[int] = READABLE_FORMATS, storage_dir: Optional[Path | str] = None
    ) -> "IndexManifest":
        """Parse and validate ``index.json`` (see :meth:`from_json`; invalid JSON is a DamagedIndexError)."""
        return cls._from_validated(storage.read_manifest(path, readable, storage_dir), path, storage_dir)

    @classmethod
    def _from_validated(cls, data: Dict[str, Any], path: Path | str, storage_dir: Optional[Path | str]) -> "IndexManifest":
        try:
            return cls.model_validate(data)
        except ValidationError as exc:  # not expected after validate_manifest; still a damaged file, not a traceback
            error = exc.errors()[0]
            key = ".".join(str(part) for part in error["loc"])
            raise storage.DamagedIndexError(
                Path(path), f"key {key!r} holds {error.get('input')!r}: {error['msg']}", storage_dir or Path(path).parent
            ) from None

    def to_json(self) -> Dict[str, Any]:
        """The JSON object written to ``index.json`` (a new dict: changing it changes nothing)."""
        omit = {key for key in _OMITTED_WHEN_NONE if getattr(self, key) is None}
        return self.model_dump(mode="json", exclude=omit)

    def write(self, path: Path | str) -> None:
        """Replace ``path`` with this manifest in one rename (file and directory entry fsynced)."""
        storage.write_json_atomic(path, self.to_json())

    # ------------------------------------------------------------------ updates (new manifests)
    def with_pending(self, pending: Optional[PendingWrite]) -> "IndexManifest":
        """This manifest with the write journal ``pending`` (None: no write in progress)."""
        return self.model_copy(update={"pending": pending})

    def committed(self, generation: int, integrity: GenerationRecord) -> "IndexManifest":
        """This manifest switched to ``generation``: journal cleared, its checksums recorded."""
        storage.check_generation(generation)
        return self.model_copy(update={"generation": generation, "pending": None, "integrity": integrity})

    def with_embed_dim(self, dim: int) -> "IndexManifest":
        """This manifest with the vector dimension ``dim`` (set when the collection is created)."""
        return self.model_copy(update={"embed_dim": int(dim)})

    def with_bm25_avgdl(self, avgdl: float) -> "IndexManifest":
        """This manifest with BM25's ``avgdl`` fixed (at the first write)."""
        return self.model_copy(update={"bm25": self.bm25.model_copy(update={"avgdl": float(avgdl)})})

    def with_qdrant_url(self, url: Optional[str], collection: Optional[str] = None) -> "IndexManifest":
        """This manifest served from the Qdrant server ``url`` (None: the embedded shard), from its
        collection ``collection`` when given."""
        update: Dict[str, Any] = {"qdrant_url": url}
        if collection is not None:
            if not storage.SAFE_NAME.fullmatch(collection):
                raise ValueError(f"collection must be letters, digits, '_' and '-' (at most 128), got {collection!r}")
            update["collection"] = collection
        return self.model_copy(update=update)

    def with_index_id(self, index_id: str) -> "IndexManifest":
        """This manifest with the index id ``index_id`` (:func:`new_index_id`)."""
        if not isinstance(index_id, str) or not re.fullmatch(INDEX_ID_PATTERN, index_id):
            raise ValueError(f"index_id must be 32 lower-case hex digits, got {index_id!r}")
        return self.model_copy(update={"index_id": index_id})

    def with_format_version(self, version: int) -> "IndexManifest":
        """This manifest in folder format ``version`` (after a migration)."""
        if version not in READABLE_FORMATS:
            raise ValueError(f"format_version {version!r} is not one this version writes; allowed: {READABLE_FORMATS}")
        return self.model_copy(update={"format_version": version})

    # ------------------------------------------------------------------ derived values
    def embed_settings_match(self, settings: Dict[str, Any]) -> bool:
        """Whether a model with the document-vector settings ``settings`` (:func:`embed_settings_of`)
        makes the vectors this index holds: True when they equal the recorded ones, or when none
        are recorded (a folder written before them: not checked)."""
        return self.embed_settings is None or self.embed_settings == settings

    @property
    def folder_state(self) -> FolderState:
        """The committed state this manifest names (:class:`FolderState`): build, generation and
        the digest of the generation's checksums. A write in progress (``pending``) is not part of
        it: the committed generation is what a reader serves."""
        return FolderState(build_id=self.build_id, generation=self.generation, digest=integrity_digest(self.integrity_record))

    @property
    def integrity_record(self) -> Optional[Dict[str, Any]]:
        """The integrity record as :func:`.storage.verify_generation` takes it (None: unverified folder)."""
        return self.integrity.as_dict() if self.integrity is not None else None

    def build_node_parser(self) -> NodeParser:
        """The node parser recorded here, rebuilt (this package's parsers or LlamaIndex's core ones)."""
        return node_parser_from_dict(self.node_parser)


def node_parser_from_dict(data: Dict[str, Any]) -> NodeParser:
    """Rebuild a node parser from its ``to_dict()`` (``class_name`` picks the class); a ValueError
    when this version has no such parser."""
    from llama_index.core import node_parser as core_parsers

    from ..node_parser import SectionHierarchyNodeParser, SectionWindowNodeParser

    name = data.get("class_name")
    ours = {"SectionWindowNodeParser": SectionWindowNodeParser, "SectionHierarchyNodeParser": SectionHierarchyNodeParser}
    if name in ours:
        return ours[name].from_dict(data)
    for attr in dir(core_parsers):
        cls = getattr(core_parsers, attr)
        if isinstance(cls, type) and issubclass(cls, NodeParser) and getattr(cls, "class_name", None):
            try:
                if cls.class_name() == name:
                    clean = {k: v for k, v in data.items() if k != "id_func"}
                    return cls.from_dict(clean)
            except TypeError:
                continue
    raise ValueError(f"index.json names node parser {name!r}, which this version cannot rebuild; pass node_parser=")
