"""A query embedder that needs neither PyTorch nor sentence-transformers: ``OnnxQueryEmbedding``.

Why: a process that only answers queries (``rkit query``, a worker that opens an index) spent
about 6 of its first 8 seconds importing sentence-transformers and PyTorch, to embed queries that
ONNX Runtime then embeds in a few milliseconds (``FastHuggingFaceEmbedding``'s query path).

How: when ``FastHuggingFaceEmbedding`` has checked its ONNX query path (the same vectors as
PyTorch, and faster here) it also writes a *query export record* (:class:`QueryExportRecord`):
where the ONNX model is, the exact fast tokenizer it used (its ``tokenizer.json``), the settings
that shape a query vector (query prompt, lower-casing, maximum length, pooling, normalisation), a
fingerprint of the model folder's files (path, size, modification time of each), the versions of
ONNX Runtime and tokenizers, and PyTorch's vectors of probe texts. Before the record is written it
is opened the torch-free way and must reproduce those vectors. :meth:`OnnxQueryEmbedding.from_export`
opens a record only while the model folder, the versions and the probes (recomputed at every
open) all still agree; otherwise it returns None and the caller uses ``FastHuggingFaceEmbedding``.

Documents: :class:`OnnxQueryEmbedding` embeds texts with a ``FastHuggingFaceEmbedding`` of the same
model and settings, made on first use (PyTorch loads then), so document vectors are exactly
``HuggingFaceEmbedding``'s.

Only local model folders get a record (a hub name is resolved by sentence-transformers' own
cache, whose files this module does not fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding
from pydantic import BaseModel, Field, PrivateAttr

from .onnx_runtime import DEFAULT_ONNX_SPIN_US, default_cache_dir, import_onnxruntime, onnx_session_options, pool

logger = logging.getLogger(__name__)

#: Bumped when the record's meaning changes: older records are then ignored (and rewritten).
QUERY_EXPORT_FORMAT = 1
RECORD_FILE = "record.json"
TOKENIZER_FILE = "tokenizer.json"
#: The packages whose behaviour a record depends on (their versions are part of it).
RECORDED_PACKAGES = ("onnxruntime", "tokenizers")

#: Probe texts: short and long (past any maximum length: truncation), cased, accented, CJK and
#: emoji, surrounding whitespace: what a tokenizer could treat differently outside transformers.
PROBES = (
    "What is the annual fee?",
    "0-dimensional biomaterials show inductive properties.",
    "How do I reset the device to factory settings after a firmware update fails?",
    "  Déjà vu: ÜBER-naïve façade coöperation, São Paulo & Zürich  ",
    "東京の年会費はいくらですか？ 🙂 résumé",
    " ".join(f"clause {i} of the agreement renews automatically unless cancelled" for i in range(60)),
)


class QueryExportRecord(BaseModel):
    """What the torch-free query path needs to embed a query as ``FastHuggingFaceEmbedding`` does."""

    format: int = Field(description="QUERY_EXPORT_FORMAT of the writer.")
    model_folder: str = Field(description="The model folder (resolved path) the record belongs to.")
    files_fingerprint: str = Field(description="model_files_fingerprint() of that folder when the record was written.")
    versions: Dict[str, str] = Field(description="Installed versions of RECORDED_PACKAGES when written.")
    onnx_path: str = Field(description="The exported transformer (inputs -> last hidden state).")
    input_names: List[str] = Field(description="The ONNX model's inputs, in order (input_ids, attention_mask[, token_type_ids]).")
    query_prompt: str = Field(default="", description="Text prepended to every query (sentence-transformers' 'query' prompt).")
    do_lower_case: bool = Field(default=False, description="Lower-case the prompted query first (sentence-transformers' Transformer setting).")
    max_seq_length: int = Field(gt=0, description="Tokens kept per query (longest_first truncation).")
    truncation_side: str = Field(default="right", description="Where truncation cuts ('right' or 'left').")
    pooling: str = Field(description="Pooling of the token states: 'mean' or 'cls'.")
    normalize: bool = Field(description="Whether query vectors are scaled to unit length.")
    probes: List[str] = Field(description="Probe texts.")
    probe_vectors: List[List[float]] = Field(description="PyTorch's (sentence-transformers') query vectors of the probes.")
    tolerance: float = Field(gt=0, description="Largest |difference| from probe_vectors accepted when the record is opened.")


def installed_versions() -> Dict[str, str]:
    """The installed versions of :data:`RECORDED_PACKAGES` ("" for one that is not installed)."""
    versions = {}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = ""
    return versions


def model_files_fingerprint(folder: Path) -> str:
    """A hash of every file under ``folder``: relative path, size and modification time (ns)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(folder).as_posix()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def export_settings_key(model_folder: Path, normalize: bool, query_instruction: Optional[str], max_length: Optional[int]) -> str:
    """The record's folder name: one record per model folder and per embedder settings that change
    a query vector (``HuggingFaceEmbedding``'s ``normalize``, ``query_instruction``, ``max_length``)."""
    settings = json.dumps([str(model_folder.resolve()), bool(normalize), query_instruction, max_length])
    return hashlib.sha256(settings.encode()).hexdigest()[:24]


def record_folder(cache_dir: Optional[str | Path], key: str) -> Path:
    """Where the record of ``key`` lives: ``<cache>/onnx/queries/<key>/``."""
    return Path(cache_dir or default_cache_dir()) / "onnx" / "queries" / key


class OnnxQueryEncoder:
    """Query vectors from a :class:`QueryExportRecord`: tokenizers + ONNX Runtime + numpy pooling,
    one text per run (as queries arrive, and as the record's probes were checked)."""

    def __init__(self, record: QueryExportRecord, tokenizer_path: Path, threads: int = 0, spin_us: Optional[int] = DEFAULT_ONNX_SPIN_US) -> None:
        from tokenizers import Tokenizer

        ort = import_onnxruntime()
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        # What transformers sets for `tokenizer(text, truncation=True, max_length=L, padding=True)`
        # on one text: longest-first truncation at L, no padding.
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=record.max_seq_length, stride=0, strategy="longest_first", direction=record.truncation_side)
        self.record = record
        self._tokenizer = tokenizer
        self._session = ort.InferenceSession(record.onnx_path, onnx_session_options(ort, threads, spin_us), providers=["CPUExecutionProvider"])

    def encode(self, text: str) -> np.ndarray:
        """The query vector of ``text`` (float32)."""
        record = self.record
        prompted = record.query_prompt + text
        if record.do_lower_case:
            prompted = prompted.lower()
        encoding = self._tokenizer.encode(prompted)
        columns = {
            "input_ids": encoding.ids,
            "attention_mask": encoding.attention_mask,
            "token_type_ids": encoding.type_ids,
        }
        feeds = {name: np.asarray([columns[name]], dtype=np.int64) for name in record.input_names}
        hidden = self._session.run(None, feeds)[0]
        vector = pool(hidden, feeds.get("attention_mask", np.ones((1, hidden.shape[1]), np.int64)), record.pooling)[0]
        if record.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector.astype(np.float32, copy=False)

    def worst_probe_difference(self) -> float:
        """Largest |difference| between this encoder's probe vectors and the recorded ones."""
        got = np.vstack([self.encode(text) for text in self.record.probes])
        return float(np.abs(got - np.asarray(self.record.probe_vectors, dtype=np.float32)).max())


def write_query_export(
    folder: Path,
    record: QueryExportRecord,
    tokenizer_json: str,
) -> Optional[str]:
    """Check ``record`` the torch-free way and write it (with ``tokenizer_json``) to ``folder``
    atomically; returns why it was not written, or None."""
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        (staging / TOKENIZER_FILE).write_text(tokenizer_json, encoding="utf-8")
        worst = OnnxQueryEncoder(record, staging / TOKENIZER_FILE, threads=1).worst_probe_difference()
        if not worst <= record.tolerance:
            return f"the torch-free path differs from PyTorch by {worst:.2e} > {record.tolerance}"
        (staging / RECORD_FILE).write_text(record.model_dump_json(), encoding="utf-8")
        for name in (TOKENIZER_FILE, RECORD_FILE):  # the record last: its presence means complete
            os.replace(staging / name, folder / name)
        return None
    finally:
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()


def open_query_export(
    model_folder: Path,
    key: str,
    cache_dir: Optional[str | Path] = None,
    threads: int = 0,
    spin_us: Optional[int] = DEFAULT_ONNX_SPIN_US,
) -> tuple[Optional[OnnxQueryEncoder], str]:
    """The encoder of the record ``key`` for ``model_folder``, or None and why not."""
    folder = record_folder(cache_dir, key)
    path = folder / RECORD_FILE
    if not path.is_file():
        return None, f"no query export record at {path}"
    try:
        record = QueryExportRecord.model_validate_json(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        return None, f"unreadable query export record {path}: {exc}"
    if record.format != QUERY_EXPORT_FORMAT:
        return None, f"query export record {path} has format {record.format}, this version reads {QUERY_EXPORT_FORMAT}"
    if Path(record.model_folder) != model_folder.resolve():
        return None, f"query export record {path} belongs to {record.model_folder}"
    if record.versions != installed_versions():
        return None, f"query export record {path} was written with {record.versions}, installed: {installed_versions()}"
    if record.files_fingerprint != model_files_fingerprint(model_folder):
        return None, f"the files of {model_folder} changed since the query export record {path} was written"
    exports = (Path(cache_dir or default_cache_dir()) / "onnx").resolve()
    if not Path(record.onnx_path).resolve().is_relative_to(exports):
        return None, f"query export record {path} names the ONNX model {record.onnx_path}, outside the cache's exports {exports}"
    if not Path(record.onnx_path).is_file():
        return None, f"the ONNX model {record.onnx_path} of {path} is gone"
    encoder = OnnxQueryEncoder(record, folder / TOKENIZER_FILE, threads=threads, spin_us=spin_us)
    worst = encoder.worst_probe_difference()
    if not worst <= record.tolerance:
        return None, f"the torch-free query path now differs from the recorded vectors by {worst:.2e} > {record.tolerance}"
    return encoder, ""


class OnnxQueryEmbedding(BaseEmbedding):
    """Query vectors of a checked ONNX export without importing PyTorch; documents through a
    ``FastHuggingFaceEmbedding`` of the same model made on first use (see the module doc).

    Build it with :meth:`from_export`; the vectors are those of ``FastHuggingFaceEmbedding(model_name,
    normalize=..., query_instruction=..., max_length=...)`` (queries within the record's tolerance,
    documents exactly). One made otherwise (``from_dict``, the constructor) opens the record on its
    first query, and embeds queries through :attr:`document_model` when there is none.
    """

    normalize: bool = Field(default=True, description="As HuggingFaceEmbedding's normalize.")
    query_instruction: Optional[str] = Field(default=None, description="As HuggingFaceEmbedding's query_instruction.")
    max_length: Optional[int] = Field(default=None, gt=0, description="As HuggingFaceEmbedding's max_length (None: the model's).")
    onnx_cache_dir: Optional[str] = Field(default=None, description="Folder of the ONNX exports and query export records.")
    onnx_threads: int = Field(default=0, ge=0, description="ONNX Runtime intra-op threads (0: one per core).")
    onnx_spin_us: Optional[int] = Field(default=DEFAULT_ONNX_SPIN_US, ge=0, description="As FastHuggingFaceEmbedding's onnx_spin_us.")

    _encoder: Any = PrivateAttr(default=None)
    _encoder_state: str = PrivateAttr(default="unset")  # unset | ready | off
    _encoder_lock: Any = PrivateAttr(default_factory=threading.Lock)
    _documents: Any = PrivateAttr(default=None)
    _documents_lock: Any = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def class_name(cls) -> str:
        return "OnnxQueryEmbedding"

    @classmethod
    def from_export(
        cls,
        model_name: str,
        normalize: bool = True,
        query_instruction: Optional[str] = None,
        max_length: Optional[int] = None,
        onnx_cache_dir: Optional[str] = None,
        onnx_threads: int = 0,
        onnx_spin_us: Optional[int] = DEFAULT_ONNX_SPIN_US,
        embed_batch_size: int = 16,
    ) -> Optional["OnnxQueryEmbedding"]:
        """The torch-free embedder of ``model_name`` (a local model folder) when a checked query
        export record exists for it and these settings, else None (logged at DEBUG: why)."""
        embedder = cls(
            model_name=model_name,
            normalize=normalize,
            query_instruction=query_instruction,
            max_length=max_length,
            onnx_cache_dir=onnx_cache_dir,
            onnx_threads=onnx_threads,
            onnx_spin_us=onnx_spin_us,
            embed_batch_size=embed_batch_size,
        )
        return embedder if embedder.query_encoder(quiet=True) is not None else None

    def query_encoder(self, quiet: bool = False) -> Optional[OnnxQueryEncoder]:
        """The opened record's encoder, or None when there is no valid record (opened once; queries
        then go through :attr:`document_model`, logged at INFO unless ``quiet``)."""
        if self._encoder_state == "unset":
            with self._encoder_lock:
                if self._encoder_state == "unset":
                    folder = Path(self.model_name)
                    if not folder.is_dir():
                        encoder, why = None, "not a local model folder"
                    else:
                        key = export_settings_key(folder, self.normalize, self.query_instruction, self.max_length)
                        try:
                            encoder, why = open_query_export(folder, key, self.onnx_cache_dir, self.onnx_threads, self.onnx_spin_us)
                        except Exception as exc:  # a missing extra, a broken file: the regular path still works
                            encoder, why = None, f"{type(exc).__name__}: {exc}"
                    if encoder is None:
                        logger.log(logging.DEBUG if quiet else logging.INFO, "no torch-free query path for %s: %s", self.model_name, why)
                    self._encoder, self._encoder_state = encoder, "ready" if encoder is not None else "off"
        return self._encoder

    @property
    def document_model(self) -> Any:
        """The ``FastHuggingFaceEmbedding`` that embeds documents (made, with PyTorch, on first use)."""
        with self._documents_lock:
            if self._documents is None:
                from .onnx_query import FastHuggingFaceEmbedding

                kwargs: Dict[str, Any] = {"normalize": self.normalize, "embed_batch_size": self.embed_batch_size}
                if self.query_instruction is not None:
                    kwargs["query_instruction"] = self.query_instruction
                if self.max_length is not None:
                    kwargs["max_length"] = self.max_length
                self._documents = FastHuggingFaceEmbedding(
                    model_name=self.model_name,
                    onnx_cache_dir=self.onnx_cache_dir,
                    onnx_threads=self.onnx_threads,
                    onnx_spin_us=self.onnx_spin_us,
                    **kwargs,
                )
            return self._documents

    def _get_query_embedding(self, query: str) -> List[float]:
        from ..retrievers.checks import check_query_text

        check_query_text(query)
        encoder = self.query_encoder()
        if encoder is None:  # e.g. made by from_dict where the record is gone: the same vectors, with PyTorch
            return self.document_model._get_query_embedding(query)
        return encoder.encode(query).tolist()

    async def _aget_query_embedding(self, query: str) -> List[float]:
        return self._get_query_embedding(query)

    # Documents: the delegate's BaseEmbedding hooks (its public methods would send LlamaIndex's
    # embedding events a second time, and show a second progress bar).
    def _get_text_embedding(self, text: str) -> List[float]:
        return self.document_model._get_text_embedding(text)

    def _get_text_embeddings(self, texts: List[str]) -> List[List[float]]:
        return self.document_model._get_text_embeddings(texts)

    async def _aget_text_embedding(self, text: str) -> List[float]:
        return self._get_text_embedding(text)

    async def _aget_text_embeddings(self, texts: List[str]) -> List[List[float]]:
        return self._get_text_embeddings(texts)  # one batched pass, as the synchronous path

