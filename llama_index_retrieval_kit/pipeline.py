"""Config-driven pipelines: one typed YAML file describes reading, chunking, the index and the query path.

    from llama_index_retrieval_kit.pipeline import PipelineConfig, build_index, build_query_engine

    config = PipelineConfig.from_yaml("examples/pipeline.yaml")
    build_index(config).close()                      # reader.paths -> chunks -> HybridIndex at index.storage_dir
    with build_query_engine(config, llm=my_llm) as engine:
        response = engine.query("How much is the late payment fee?")

The file has one section per stage, in the shape of the design documents::

    name: samples-hybrid            # optional; rkit eval's report name (default: the file name)
    reader:                         # component + its options (default: document_folder)
      component: document_folder
      paths: [docs/]                # what `rkit index --config` / build_index read when given nothing
    chunking:                       # node parser + its options (default: section_window)
      component: section_window
      chunk_size: 200
      chunk_overlap: 40
    embedding: {model: sentence-transformers/all-MiniLM-L6-v2}
    index: {storage_dir: index/}    # + qdrant_url, collection, qdrant_api_key_env, bm25_k1, bm25_b, build_hnsw
    retriever: {mode: hybrid, similarity_top_k: 5}   # + candidate_top_k, weights, rrf_k, dense_search, filters
    no_answer: {gate_path: gate.json}                # a calibrated gate (`rkit calibrate --config`), or similarity_cutoff
    reranker: {model: cross-encoder/ms-marco-MiniLM-L6-v2, backend: sentence_transformers, top_n: 5}
    context: {max_tokens: 1024, order: bookends}
    tracing: {enabled: true, jsonl_path: traces.jsonl}

Rules:

* **Every key works or is refused.** The fixed sections are pydantic models with
  ``extra="forbid"``; a component section (``reader``, ``chunking``, ``reranker``,
  ``context``) takes ``component`` (a registered name or ``"module:Class"``, see
  :mod:`~llama_index_retrieval_kit.components`) and, besides its own keys, exactly the
  component's constructor options, checked against the component's fields and values when the
  file is read. Errors are :class:`PipelineConfigError` (a ``ValueError``) naming the file, the
  key, the bad value and the allowed ones. Retriever options a mode does not use
  (:data:`~llama_index_retrieval_kit.indices.RETRIEVER_OPTIONS`) are refused as
  ``HybridIndex.as_retriever`` refuses them.
* **Optional stages.** ``no_answer``, ``reranker`` and ``context`` are on when their section
  is present, unless it says ``enabled: false`` (its options are still checked, so turning it on
  again works). ``tracing`` is off unless ``enabled: true``.
* **Paths** (``reader.paths``, ``index.storage_dir``, ``no_answer.gate_path``,
  ``tracing.jsonl_path``) in a YAML file are relative to the file's folder; in
  :meth:`PipelineConfig.from_dict` to ``base_dir`` (default: kept as given, i.e. the working
  directory).
* **An existing index must match the config.** Opening an index checks the embedding model,
  the chunking, the BM25 parameters and ``qdrant_url`` against the ones it was built with; a
  difference is an error listing the settings (rebuild with ``rkit index --config FILE --rebuild``).
* **Order of the precision stage**: the no-answer gate runs before the reranker (it reads the
  retrieval legs; the reranker then only runs for answerable queries), or after it when the gate
  was calibrated on reranked results (``rkit calibrate --config`` does that when the config has
  a reranker); the context assembler runs last.

What serialises: the config (:meth:`PipelineConfig.to_dict` / :meth:`~PipelineConfig.to_yaml`,
exact round trip) and every component (``component_to_dict`` / ``component_from_dict``). The
retrievers and query engines built here hold an open :class:`~llama_index_retrieval_kit.indices.HybridIndex`
and cannot be serialised: their ``to_dict()`` raises a ``TypeError`` that says to serialise the
config instead.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import threading
from pathlib import Path
from typing import Annotated, Any, ClassVar, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Tuple, Union

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from ._enums import DenseSearch, QueryBackend, RetrieverMode
from ._files import write_text_atomic
from ._options import check_options
from .components import (
    ComponentError,
    ComponentKind,
    check_component,
    component_options,
    component_to_dict,
    make_component,
    resolve_component,
)
from .evaluation.configs import ConfigError, read_yaml_file
from .models import DEFAULT_EMBED_MODEL

logger = logging.getLogger(__name__)

__all__ = [
    "PipelineConfig",
    "PipelineConfigError",
    "PipelineQueryEngine",
    "PipelineRetriever",
    "PostprocessedRetriever",
    "build_index",
    "build_postprocessors",
    "build_query_engine",
    "build_retriever",
    "index_build_kwargs",
    "index_mismatches",
    "is_pipeline_config",
    "load_gate",
    "make_embed_model",
    "make_node_parser",
    "make_reader",
    "make_tracer",
    "open_index",
    "read_pipeline_documents",
    "to_eval_config",
]

#: Top-level keys of a pipeline config.
SECTIONS: Tuple[str, ...] = (
    "version", "name", "reader", "chunking", "embedding", "index", "retriever", "no_answer", "reranker", "context", "tracing",
)


class PipelineConfigError(ConfigError):
    """A pipeline config is invalid: ``"<file>: key '<key>': <what is wrong>"`` (a ``ValueError``)."""


class _KeyedError(ValueError):
    """Raised inside validators: carries the full dotted key for the message."""

    def __init__(self, message: str, key: str) -> None:
        self.key = key
        super().__init__(message)


def _finite_number(value: Any) -> Any:
    """``value`` when it is a finite int or float (not a bool, a string, NaN or an infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value!r}")
    return value


#: A finite int or float, kept as given (an int stays an int: exact round trip).
Number = Annotated[Union[StrictInt, StrictFloat], BeforeValidator(_finite_number)]


# ------------------------------------------------------------------------------ sections
class _Section(BaseModel):
    """A section with fixed keys: anything else is refused."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class _ComponentSection(BaseModel):
    """A section naming a component: ``component`` + the section's own keys + the component's options.

    Options are the extra keys; each is checked against the component's fields, and the values
    with :func:`~llama_index_retrieval_kit.components.check_component` (which builds only this
    package's components: reading a config never loads a model or runs a model folder's code).
    """

    model_config = ConfigDict(extra="allow", validate_default=True)

    section_name: ClassVar[str] = ""
    component_kind: ClassVar[ComponentKind] = ComponentKind.POSTPROCESSOR

    component: str

    @property
    def options(self) -> Dict[str, Any]:
        """The component's options (the section's keys other than its own)."""
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _check_component(self) -> "_ComponentSection":
        try:
            check_component(self.component, self.options, self.component_kind, key=self.section_name)
        except ComponentError as exc:
            message = str(exc)
            if message.startswith("unknown option"):
                own = ", ".join(type(self).model_fields)
                message += f" (besides the section's own keys: {own})"
            raise _KeyedError(message + _option_hint(self.section_name, exc.key), exc.key or self.section_name) from None
        return self

    def build(self) -> Any:
        """A new instance of the component with the options."""
        return make_component(self.component, self.options, self.component_kind, key=self.section_name)

    def component_class(self) -> type:
        return resolve_component(self.component, self.component_kind)

    def allowed_keys(self) -> List[str]:
        """The section's own keys and the component's options."""
        own = [name for name in type(self).model_fields]
        return own + [o for o in component_options(self.component_class()) if o not in own]


def _option_hint(section: str, key: Optional[str]) -> str:
    if section == "context" and key == "context.max_chunks":
        return (
            ". The context is bounded in tokens (max_tokens); to bound the number of chunks, set "
            "retriever.similarity_top_k (or reranker.top_n)"
        )
    return ""


class ReaderConfig(_ComponentSection):
    """How files become Documents: a reader of this package (``FileReader``) and its options."""

    section_name: ClassVar[str] = "reader"
    component_kind: ClassVar[ComponentKind] = ComponentKind.READER

    component: str = Field(default="document_folder", description="Registered reader name or 'module:Class'.")
    paths: List[str] = Field(
        default_factory=list, description="Files or folders read by build_index / `rkit index --config` when none are given."
    )

    @field_validator("paths", mode="before")
    @classmethod
    def _check_paths(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        return value


class ChunkingConfig(_ComponentSection):
    """The node parser and its options (``chunk_size``, ``chunk_overlap``, ...)."""

    section_name: ClassVar[str] = "chunking"
    component_kind: ClassVar[ComponentKind] = ComponentKind.NODE_PARSER

    component: str = Field(default="section_window", description="Registered node parser name or 'module:Class'.")


class EmbeddingConfig(_Section):
    """The embedding model (``FastHuggingFaceEmbedding``; the default is packaged and offline)."""

    model: str = Field(default=DEFAULT_EMBED_MODEL, min_length=1, description="Hugging Face model id or local folder.")
    query_backend: str = Field(default="onnx", description="What embeds queries: 'onnx' (ONNX Runtime) or 'torch' (PyTorch).")
    embed_batch_size: StrictInt = Field(default=16, ge=1, description="Texts per forward pass.")

    @field_validator("query_backend", mode="before")
    @classmethod
    def _check_query_backend(cls, value: Any) -> str:
        return QueryBackend.from_str(value).value


class IndexConfig(_Section):
    """Where the HybridIndex lives and how its BM25 leg scores."""

    storage_dir: Optional[str] = Field(
        default=None, description="Index folder (index.json, BM25, docstore, and Qdrant's data in local mode). Required to build or open."
    )
    qdrant_url: Optional[str] = Field(default=None, description="A Qdrant server for the vectors (default: local mode inside storage_dir).")
    collection: Optional[str] = Field(
        default=None,
        description="Collection name (letters, digits, '_', '-'; default 'chunks'): on a Qdrant server, the name the index is "
        "served under; two indexes on one server need two names (HybridIndex.from_documents(collection=)).",
    )
    qdrant_api_key_env: Optional[str] = Field(
        default=None, description="Name of the environment variable holding the Qdrant API key (never the key itself)."
    )
    bm25_k1: Number = Field(default=1.2, ge=0, description="BM25 k1 (term frequency saturation).")
    bm25_b: Number = Field(default=0.75, ge=0, le=1, description="BM25 b (length normalisation).")
    build_hnsw: StrictBool = Field(
        default=False,
        description="After each build or update, build the embedded engine's HNSW index (HybridIndex.optimize): "
        "only qdrant_hybrid and dense_search: qdrant use it; the default modes search exactly in memory.",
    )

    @field_validator("storage_dir", "qdrant_url", "qdrant_api_key_env", mode="after")
    @classmethod
    def _non_empty(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not value.strip():
            raise ValueError("must be a non-empty string or null")
        return value

    @field_validator("collection", mode="after")
    @classmethod
    def _collection_name(cls, value: Optional[str]) -> Optional[str]:
        from .indices.hybrid_index import check_collection_name

        return None if value is None else check_collection_name(value)


class RetrieverConfig(_Section):
    """``HybridIndex.as_retriever`` options: the mode and what that mode takes."""

    mode: str = Field(default="hybrid", description="Retriever mode (indices.RETRIEVER_MODES).")
    similarity_top_k: StrictInt = Field(default=5, ge=1, description="Results returned.")
    candidate_top_k: Optional[StrictInt] = Field(default=None, ge=1, description="Depth of each leg before fusion (default: the mode's own, 200 for hybrid, 100 otherwise).")
    weights: Optional[List[Number]] = Field(default=None, description="Leg weights [bm25, dense]; mode 'hybrid' also takes [bm25, dense, feedback].")
    rrf_k: Optional[Number] = Field(default=None, ge=0, description="RRF constant k (default 60).")
    dense_search: Optional[str] = Field(default=None, description="Dense leg: 'memory', 'qdrant' or 'auto' (a server: Qdrant, else memory).")
    filters: Optional[Dict[str, Any]] = Field(
        default=None, description="LlamaIndex MetadataFilters as a mapping: {filters: [{key, value, operator}], condition: and}."
    )

    @field_validator("mode", mode="after")
    @classmethod
    def _check_mode(cls, value: str) -> str:
        return RetrieverMode.from_str(value).value

    @field_validator("dense_search", mode="before")
    @classmethod
    def _check_dense_search(cls, value: Any) -> Optional[str]:
        return None if value is None else DenseSearch.from_str(value).value

    @field_validator("weights", mode="after")
    @classmethod
    def _check_weights(cls, value: Optional[List[float]]) -> Optional[List[float]]:
        if value is None:
            return None
        if len(value) not in (2, 3) or any(not math.isfinite(w) or w < 0 for w in value) or not any(value):
            raise ValueError(
                f"must be 2 finite numbers >= 0, not all 0, [bm25, dense] (mode 'hybrid' also takes 3: "
                f"[bm25, dense, feedback]); got {value!r}"
            )
        return value

    @field_validator("filters", mode="after")
    @classmethod
    def _check_filters(cls, value: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """Checked as MetadataFilters, and kept as a deep copy: the caller's nested filter
        mappings edited afterwards (a template reused per tenant) do not reach this config."""
        if value is not None:
            _metadata_filters(value)
            value = copy.deepcopy(value)
        return value

    @model_validator(mode="after")
    def _check_options_for_mode(self) -> "RetrieverConfig":
        from .indices import RETRIEVER_OPTIONS

        taken = RETRIEVER_OPTIONS[self.mode]
        for name in ("candidate_top_k", "weights", "rrf_k", "dense_search"):
            if getattr(self, name) is None or name in taken:
                continue
            takers = [m for m, names in RETRIEVER_OPTIONS.items() if name in names]
            raise _KeyedError(
                f"mode {self.mode!r} does not use {name} (got {getattr(self, name)!r}); it applies to mode(s) "
                f"{', '.join(takers)}: remove it or choose one of those modes",
                f"retriever.{name}",
            )
        if self.weights is not None and len(self.weights) == 3 and self.mode != "hybrid":
            raise _KeyedError(
                f"3 weights [bm25, dense, feedback] apply to mode 'hybrid' only (its feedback leg); mode {self.mode!r} "
                f"fuses 2 legs: give [bm25, dense]; got {self.weights!r}",
                "retriever.weights",
            )
        if self.mode == "qdrant_hybrid":
            if self.rrf_k is not None and not float(self.rrf_k).is_integer():
                raise _KeyedError(f"must be a whole number for mode 'qdrant_hybrid' (Qdrant's RRF k is an integer), got {self.rrf_k!r}", "retriever.rrf_k")
            if self.weights is not None and len({float(w) for w in self.weights}) > 1:
                raise _KeyedError(
                    f"mode 'qdrant_hybrid' cannot weight its legs (got {self.weights!r}); use mode 'hybrid_rrf' for weighted fusion",
                    "retriever.weights",
                )
        return self

    def as_retriever_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of ``HybridIndex.as_retriever`` (options left unset are not passed)."""
        kwargs: Dict[str, Any] = {"mode": self.mode, "similarity_top_k": self.similarity_top_k}
        for name in ("candidate_top_k", "rrf_k", "dense_search"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.weights is not None:
            kwargs["weights"] = [float(w) for w in self.weights]
        if self.filters is not None:
            kwargs["filters"] = _metadata_filters(self.filters)
        return kwargs


def _metadata_filters(data: Mapping[str, Any]) -> Any:
    from llama_index.core.vector_stores.types import MetadataFilters

    from .retrievers.filters import validate_filters

    try:
        return validate_filters(MetadataFilters.model_validate(dict(data)))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ValueError(
            f"not a MetadataFilters mapping ({where}: {first.get('msg')}); expected "
            "{filters: [{key: doc_id, value: terms.pdf, operator: '=='}], condition: and}"
        ) from None


class NoAnswerConfig(_Section):
    """The no-answer gate: a calibrated gate file, and/or a per-node similarity cutoff."""

    enabled: StrictBool = Field(default=True, description="false: keep the section but do not use the gate.")
    gate_path: Optional[str] = Field(default=None, description="Gate JSON written by `rkit calibrate` (NoAnswerPostprocessor.save).")
    threshold: Optional[Number] = Field(default=None, ge=0, le=1, description="Override the calibrated threshold.")
    similarity_cutoff: Optional[Number] = Field(default=None, description="Drop single nodes scoring below this (SimilarityPostprocessor).")
    no_answer_text: Optional[str] = Field(default=None, min_length=1, description="Response text when the gate closes.")

    @model_validator(mode="after")
    def _check_source(self) -> "NoAnswerConfig":
        if self.gate_path is None and self.similarity_cutoff is None:
            raise _KeyedError(
                "needs gate_path (a gate calibrated with `rkit calibrate --config FILE`) or similarity_cutoff, "
                "also with enabled: false (the section is checked so that turning it on works); or remove the section",
                "no_answer.gate_path",
            )
        if self.gate_path is None and self.threshold is not None:
            raise _KeyedError("threshold applies to a calibrated gate: give gate_path too, or remove threshold", "no_answer.threshold")
        return self

    def overrides(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in ("threshold", "similarity_cutoff", "no_answer_text") if getattr(self, k) is not None}


class RerankerConfig(_ComponentSection):
    """A reranker (default ``cross_encoder``: CrossEncoderReranker) and its options (``model``, ``top_n``, ``batch_size``, ``backend``, ...)."""

    section_name: ClassVar[str] = "reranker"
    component_kind: ClassVar[ComponentKind] = ComponentKind.POSTPROCESSOR

    enabled: StrictBool = Field(default=True, description="false: keep the section but do not rerank.")
    component: str = Field(default="cross_encoder", description="Registered postprocessor name or 'module:Class'.")


class ContextConfig(_ComponentSection):
    """Context assembly (default ``context_assembler``: ContextAssembler) and its options (``max_tokens``, ``order``, ...)."""

    section_name: ClassVar[str] = "context"
    component_kind: ClassVar[ComponentKind] = ComponentKind.POSTPROCESSOR

    enabled: StrictBool = Field(default=True, description="false: keep the section but do not assemble.")
    component: str = Field(default="context_assembler", description="Registered postprocessor name or 'module:Class'.")


class TracingConfig(_Section):
    """Per-stage traces of each query (llama_index_retrieval_kit.tracing)."""

    enabled: StrictBool = Field(default=False, description="Collect a trace per query (response.metadata['trace']).")
    jsonl_path: Optional[str] = Field(default=None, min_length=1, description="Also append each trace to this JSON-lines file.")


_SECTION_MODELS: Dict[str, type] = {
    "reader": ReaderConfig,
    "chunking": ChunkingConfig,
    "embedding": EmbeddingConfig,
    "index": IndexConfig,
    "retriever": RetrieverConfig,
    "no_answer": NoAnswerConfig,
    "reranker": RerankerConfig,
    "context": ContextConfig,
    "tracing": TracingConfig,
}


class PipelineConfig(_Section):
    """The whole pipeline: see the module docstring for the file format and the rules."""

    version: Literal[1] = Field(default=1, description="Format version of the file.")
    name: Optional[str] = Field(default=None, min_length=1, description="Name (rkit eval's report; default: the file name).")
    reader: ReaderConfig = Field(default_factory=ReaderConfig)
    chunking: ChunkingConfig = Field(default_factory=ChunkingConfig)
    embedding: EmbeddingConfig = Field(default_factory=EmbeddingConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    retriever: RetrieverConfig = Field(default_factory=RetrieverConfig)
    no_answer: Optional[NoAnswerConfig] = None
    reranker: Optional[RerankerConfig] = None
    context: Optional[ContextConfig] = None
    tracing: TracingConfig = Field(default_factory=TracingConfig)

    _source: str = PrivateAttr(default="config")

    def __eq__(self, other: Any) -> bool:  # the settings, not where they were read from
        return isinstance(other, PipelineConfig) and self.to_dict() == other.to_dict()

    @property
    def source(self) -> str:
        """Where the config was read from (the YAML file), for error messages."""
        return self._source

    # -- reading
    @classmethod
    def from_dict(cls, data: Any, source: str = "config", base_dir: str | Path | None = None) -> "PipelineConfig":
        """Validate parsed YAML/JSON; relative paths are resolved against ``base_dir`` when given.

        Errors are :class:`PipelineConfigError` naming ``source``, the key, the value and the
        allowed ones.
        """
        if not isinstance(data, Mapping):
            raise PipelineConfigError(source, f"a pipeline config is a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__} {data!r:.80}")
        try:  # a deep copy: the config shares no nested list or mapping with the caller's data
            config = cls.model_validate(copy.deepcopy(dict(data)))
        except ValidationError as exc:
            raise _config_error(exc, source) from None
        if base_dir is not None:
            config = config._with_base_dir(Path(base_dir))
        config._source = source
        return config

    @classmethod
    def from_yaml(cls, path: str | Path) -> "PipelineConfig":
        """Read a YAML file; its relative paths are relative to the file's folder."""
        file_path = Path(path)
        data = read_yaml_file(
            file_path,
            empty_hint="it needs at least an 'index: {storage_dir: ...}' section",
            missing_hint="give the path of a pipeline config (YAML, see examples/pipeline.yaml)",
        )
        return cls.from_dict(data, source=str(file_path), base_dir=file_path.resolve().parent)

    def _with_base_dir(self, base: Path) -> "PipelineConfig":
        def resolve(value: Optional[str]) -> Optional[str]:
            if value is None:
                return None
            path = Path(value).expanduser()
            return os.path.normpath(path if path.is_absolute() else base / path)

        reader = self.reader.model_copy(update={"paths": [resolve(p) for p in self.reader.paths]})
        index = self.index.model_copy(update={"storage_dir": resolve(self.index.storage_dir)})
        no_answer = self.no_answer.model_copy(update={"gate_path": resolve(self.no_answer.gate_path)}) if self.no_answer else None
        tracing = self.tracing.model_copy(update={"jsonl_path": resolve(self.tracing.jsonl_path)})
        return self.model_copy(update={"reader": reader, "index": index, "no_answer": no_answer, "tracing": tracing})

    # -- writing
    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON-ready data; ``PipelineConfig.from_dict(config.to_dict()) == config``."""
        data = self.model_dump(mode="json")
        return {k: v for k, v in data.items() if v is not None or k not in ("no_answer", "reranker", "context", "name")}

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The config as YAML text (written to ``path`` when given)."""
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)
        if path is not None:
            write_text_atomic(path, text)
        return text

    def with_overrides(self, overrides: Mapping[str, Any], source: str = "command line") -> "PipelineConfig":
        """A copy with ``{"section.key": value}`` set (a section name with a mapping replaces the
        whole section), validated again; ``None`` values are skipped (option not given)."""
        data = self.to_dict()
        for dotted, value in overrides.items():
            if value is None:
                continue
            parts = dotted.split(".")
            target = data
            for part in parts[:-1]:
                if not isinstance(target.get(part), dict):
                    target[part] = {}
                target = target[part]
            target[parts[-1]] = value
        return PipelineConfig.from_dict(data, source=source)

    # -- derived
    @property
    def storage_dir(self) -> Path:
        """``index.storage_dir`` as a Path (an error when the config has none)."""
        if self.index.storage_dir is None:
            raise PipelineConfigError(
                self.source, "missing: give the index folder (or --storage on the command line)", "index.storage_dir"
            )
        return Path(self.index.storage_dir)

    def stage_enabled(self, name: str) -> bool:
        """Whether optional stage ``name`` (no_answer, reranker, context, tracing) runs."""
        section = getattr(self, name)
        return section is not None and bool(getattr(section, "enabled", False))


def _config_error(exc: ValidationError, source: str) -> PipelineConfigError:
    """A ValidationError as one PipelineConfigError: every problem with its key, value and the allowed ones."""
    problems: List[Tuple[str, str]] = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ())]
        key = ".".join(loc) or "(top level)"
        kind = err.get("type", "")
        ctx_error = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_error, _KeyedError):
            problems.append((ctx_error.key, str(ctx_error)))
            continue
        if kind == "extra_forbidden":
            model = PipelineConfig if len(loc) == 1 else _SECTION_MODELS.get(loc[0], PipelineConfig)
            allowed = ", ".join(model.model_fields)
            problems.append((key, f"unknown key (value {err.get('input')!r}); allowed keys: {allowed}"))
            continue
        if kind == "missing":
            problems.append((key, "missing (required)"))
            continue
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if kind in ("model_type", "model_attributes_type", "dict_type") and len(loc) == 1 and loc[0] in _SECTION_MODELS:
            allowed = ", ".join(_SECTION_MODELS[loc[0]].model_fields)
            msg = f"must be a mapping of keys ({allowed}{', and the component options' if issubclass(_SECTION_MODELS[loc[0]], _ComponentSection) else ''})"
        if "input" in err and kind not in ("value_error",):
            msg = f"{msg}, got {err['input']!r}"
        problems.append((key, msg))
    first_key, first_msg = problems[0] if problems else (None, str(exc))
    extra = "".join(f"; key {k!r}: {m}" for k, m in problems[1:])
    return PipelineConfigError(source, first_msg + extra, first_key)


def is_pipeline_config(data: Any) -> bool:
    """Whether parsed YAML looks like a pipeline config (not an ``rkit eval`` retriever config)."""
    if not isinstance(data, Mapping):
        return False
    if isinstance(data.get("retriever"), Mapping):
        return True
    return any(key in data for key in SECTIONS if key not in ("name", "retriever"))


# ------------------------------------------------------------------------------ components
def make_reader(config: PipelineConfig) -> Any:
    """The reader of ``config.reader``."""
    return config.reader.build()


def make_node_parser(config: PipelineConfig) -> Any:
    """The node parser of ``config.chunking``."""
    return config.chunking.build()


def make_embed_model(config: PipelineConfig) -> Any:
    """The embedding model of ``config.embedding`` (loads the weights)."""
    from .models import default_embed_model

    e = config.embedding
    return default_embed_model(e.model, query_backend=e.query_backend, embed_batch_size=e.embed_batch_size)


def _api_key(config: PipelineConfig) -> Optional[str]:
    name = config.index.qdrant_api_key_env
    if name is None:
        return None
    value = os.environ.get(name)
    if not value:
        raise PipelineConfigError(config.source, f"environment variable {name!r} is not set (it should hold the Qdrant API key)", "index.qdrant_api_key_env")
    return value


def _comparable(data: Mapping[str, Any]) -> Dict[str, Any]:
    from .components import json_safe

    return {k: v for k, v in json_safe(dict(data)).items() if k not in ("callback_manager", "id_func")}


def index_mismatches(config: PipelineConfig, index: Any) -> List[str]:
    """What the index at ``config.index.storage_dir`` was built with that the config says otherwise."""
    stored = getattr(index, "config", None)
    if not isinstance(stored, Mapping):  # an index that does not record its build settings: nothing to compare
        logger.debug("index %r records no build settings; the config is not checked against it", index)
        return []
    problems: List[str] = []
    wanted_parser = _comparable(make_node_parser(config).to_dict())
    built_parser = _comparable(stored.get("node_parser") or {})
    if built_parser.get("class_name") != wanted_parser.get("class_name"):
        problems.append(f"chunking: built with {built_parser.get('class_name')}, the config says {wanted_parser.get('class_name')}")
    else:
        for key in sorted(set(wanted_parser) & set(built_parser)):
            if built_parser[key] != wanted_parser[key]:
                problems.append(f"chunking.{key}: built with {built_parser[key]!r}, the config says {wanted_parser[key]!r}")
    bm25 = stored.get("bm25") or {}
    for key, wanted in (("k1", config.index.bm25_k1), ("b", config.index.bm25_b)):
        if key in bm25 and not math.isclose(float(bm25[key]), float(wanted)):
            problems.append(f"index.bm25_{key}: built with {bm25[key]!r}, the config says {wanted!r}")
    if (stored.get("qdrant_url") or None) != config.index.qdrant_url:
        problems.append(f"index.qdrant_url: built with {stored.get('qdrant_url')!r}, the config says {config.index.qdrant_url!r}")
    if config.index.collection is not None and isinstance(stored.get("collection"), str):
        from .indices.store import served_collection_name

        built = served_collection_name(stored["collection"])  # a server index records its build collection
        if built != config.index.collection:
            problems.append(f"index.collection: built with {built!r}, the config says {config.index.collection!r}")
    return problems


def open_index(
    config: PipelineConfig, embed_model: Any = None, check: bool = True, read_only: bool = False, show_progress: bool = False
) -> Any:
    """Open the HybridIndex of ``config`` (with its embedding model and node parser).

    With ``check`` (default), an index built with other chunking, BM25 parameters or
    ``qdrant_url`` than the config says is a ``ValueError`` listing them (HybridIndex.load
    itself refuses another embedding model). ``read_only``: ``HybridIndex.load(read_only=True)``
    (beside a process that holds the folder; no writes, no engine-side search).
    ``show_progress``: ``HybridIndex.load``'s bars (a roll-back or a migration on open).
    """
    from .indices import HybridIndex

    storage = config.storage_dir
    if not (storage / "index.json").exists():
        raise PipelineConfigError(
            config.source, f"{storage} holds no index: build it first with `rkit index --config FILE` (or pipeline.build_index)", "index.storage_dir"
        )
    index = HybridIndex.load(
        storage,
        embed_model=embed_model or make_embed_model(config),
        node_parser=make_node_parser(config),
        qdrant_api_key=_api_key(config),
        read_only=read_only,
        show_progress=show_progress,
    )
    if check:
        problems = index_mismatches(config, index)
        if problems:
            index.close()
            raise ValueError(
                f"the index in {storage} does not match the config: " + "; ".join(problems)
                + ". Rebuild it with `rkit index --config FILE --rebuild` (pipeline.build_index(config, overwrite=True)), "
                "or make the config say what the index was built with"
            )
    return index


def read_pipeline_documents(
    config: PipelineConfig, paths: Optional[Sequence[str | Path]] = None, show_progress: bool = False
) -> Tuple[List[Any], List[Any]]:
    """``(documents, failures)``: ``paths`` (default ``reader.paths``) read with the config's reader."""
    from .ingest import read_documents

    paths = list(paths) if paths else list(config.reader.paths)
    if not paths:
        raise PipelineConfigError(config.source, "no files to read: give files or folders, or list them in reader.paths", "reader.paths")
    return read_documents(paths, show_progress=show_progress, reader=make_reader(config))


def build_index(
    config: PipelineConfig,
    documents_or_paths: Optional[Sequence[Any]] = None,
    *,
    overwrite: bool = False,
    allow_source_change: bool = False,
    skip_errors: bool = False,
    show_progress: bool = False,
    embed_model: Any = None,
) -> Any:
    """Build (or update in place) the HybridIndex that ``config`` describes; returns it open.

    ``documents_or_paths``: Documents, or files/folders read with the config's reader (default:
    ``reader.paths``). Files that cannot be read raise ``DocumentReadError`` after the others
    were read (nothing is indexed), unless ``skip_errors=True``, which logs and skips them. An
    existing index is updated with ``upsert`` (it must match the config, see
    :func:`open_index`); ``overwrite=True`` rebuilds it.
    """
    from llama_index.core.schema import Document

    from .indices import HybridIndex
    from .readers import DocumentReadError

    storage = config.storage_dir  # before reading anything: a config without an index folder is an error
    items = list(documents_or_paths) if documents_or_paths is not None else None
    if items and all(isinstance(d, Document) for d in items):
        documents = items
    elif items and any(isinstance(d, Document) for d in items):
        raise ValueError("documents_or_paths mixes Documents and paths: give one or the other")
    else:
        documents, failures = read_pipeline_documents(config, items, show_progress=show_progress)
        if failures:
            if not skip_errors:
                raise DocumentReadError(failures, documents)
            for failure in failures:
                logger.warning("skipped %s", failure)
    if not documents:
        raise ValueError("no documents to index")
    if (storage / "index.json").exists() and not overwrite:
        index = open_index(config, embed_model=embed_model)
        try:
            index.upsert(documents, show_progress=show_progress, allow_source_change=allow_source_change)
            if config.index.build_hnsw:
                index.optimize(show_progress=show_progress)
        except BaseException:
            index.close()
            raise
        return index
    return HybridIndex.from_documents(documents, storage, overwrite=overwrite, show_progress=show_progress, **index_build_kwargs(config, embed_model))


def index_build_kwargs(config: PipelineConfig, embed_model: Any = None) -> Dict[str, Any]:
    """``HybridIndex.from_documents`` keywords for ``config`` (node parser, embedding model, BM25, Qdrant)."""
    return {
        "node_parser": make_node_parser(config),
        "embed_model": embed_model or make_embed_model(config),
        "bm25_k1": float(config.index.bm25_k1),
        "bm25_b": float(config.index.bm25_b),
        "qdrant_url": config.index.qdrant_url,
        "qdrant_api_key": _api_key(config),
        "build_hnsw": bool(config.index.build_hnsw),
        "collection": config.index.collection,
    }


# ------------------------------------------------------------------------------ query path
class _ForwardsFilters:
    """``filters`` of a wrapping retriever: its inner retriever's, read and set there (setting is
    refused when the inner one has no settable filters: a filter silently ignored leaks documents)."""

    _inner: Any

    @property
    def filters(self) -> Optional[MetadataFilters]:
        """The metadata filters of the inner retriever (what every query applies)."""
        return getattr(self._inner, "filters", None)

    @filters.setter
    def filters(self, filters: Optional[MetadataFilters]) -> None:
        from .retrievers.filters import has_settable_filters

        if not has_settable_filters(self._inner):
            raise TypeError(
                f"{type(self._inner).__name__} has no settable filters: build the retriever again with the filters "
                "(retriever.filters in the config)"
            )
        self._inner.filters = filters


class PipelineRetriever(_ForwardsFilters, BaseRetriever):
    """The retriever a :class:`PipelineConfig` describes, over an open HybridIndex.

    Results are the index retriever's, unchanged (fused results keep their legs). It holds the
    index (``.index``; closed by :meth:`close` when it opened it) and the config
    (``.pipeline_config``). Bound to an open index, it cannot be serialised: ``to_dict()``
    raises a TypeError; serialise ``pipeline_config`` instead.
    """

    def __init__(self, retriever: BaseRetriever, index: Any, config: PipelineConfig, owns_index: bool) -> None:
        super().__init__(callback_manager=retriever.callback_manager)
        self._inner = retriever
        self._index = index
        self._config = config
        self._owns_index = owns_index

    @property
    def inner(self) -> BaseRetriever:
        """The HybridIndex retriever."""
        return self._inner

    @property
    def index(self) -> Any:
        return self._index

    @property
    def pipeline_config(self) -> PipelineConfig:
        return self._config

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return self._inner.retrieve(query_bundle)

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return await self._inner.aretrieve(query_bundle)

    def to_dict(self, **kwargs: Any) -> Dict[str, Any]:
        raise TypeError(
            f"a retriever bound to the open index {getattr(self._index, 'storage_dir', self._config.index.storage_dir)} "
            "cannot be serialised: serialise its "
            "config (retriever.pipeline_config.to_dict() or .to_yaml()) and rebuild it with build_retriever(config)"
        )

    def close(self) -> None:
        """Close the index if this retriever opened it."""
        if self._owns_index:
            self._index.close()

    def __enter__(self) -> "PipelineRetriever":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class PostprocessedRetriever(_ForwardsFilters, BaseRetriever):
    """A retriever whose results go through node postprocessors (e.g. a reranker), for code that
    takes a retriever: calibrating a gate on reranked results, the evaluation job."""

    def __init__(self, retriever: BaseRetriever, postprocessors: Sequence[Any]) -> None:
        super().__init__(callback_manager=retriever.callback_manager)
        self._inner = retriever
        self._postprocessors = list(postprocessors)

    @property
    def inner(self) -> BaseRetriever:
        return self._inner

    @property
    def postprocessors(self) -> List[Any]:
        return list(self._postprocessors)

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        nodes = self._inner.retrieve(query_bundle)
        for postprocessor in self._postprocessors:
            nodes = postprocessor.postprocess_nodes(nodes, query_bundle=query_bundle)
        return nodes

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        nodes = await self._inner.aretrieve(query_bundle)
        for postprocessor in self._postprocessors:
            nodes = await postprocessor.apostprocess_nodes(nodes, query_bundle=query_bundle)
        return nodes

    def close(self) -> None:
        """Close the inner retriever's index when it owns one."""
        if isinstance(self._inner, (PipelineRetriever, PostprocessedRetriever)):
            self._inner.close()


def build_retriever(config: PipelineConfig, index: Any = None) -> Any:
    """A :class:`PipelineRetriever`: ``index.as_retriever(**config.retriever)`` over ``index``
    (default: the config's index, opened and owned by the retriever: close it when done)."""
    owns = index is None
    if index is None:
        index = open_index(config)
    else:
        problems = index_mismatches(config, index)
        if problems:
            raise ValueError(f"the index in {getattr(index, 'storage_dir', '?')} does not match the config: " + "; ".join(problems))
    try:
        inner = index.as_retriever(**config.retriever.as_retriever_kwargs())
    except BaseException:
        if owns:
            index.close()
        raise
    return PipelineRetriever(inner, index, config, owns)


def load_gate(config: PipelineConfig) -> Any:
    """The NoAnswerPostprocessor of ``config.no_answer`` (None when the stage is off)."""
    from .postprocessor.no_answer import NoAnswerPostprocessor

    if not config.stage_enabled("no_answer"):
        return None
    section = config.no_answer
    assert section is not None
    overrides = section.overrides()
    if section.gate_path is None:
        return NoAnswerPostprocessor(**overrides)
    path = Path(section.gate_path)
    if not path.is_file():
        raise PipelineConfigError(
            config.source, f"no gate file at {path}: calibrate one with `rkit calibrate --config FILE --dataset QUESTIONS`", "no_answer.gate_path"
        )
    gate = NoAnswerPostprocessor.load(path)
    if overrides:
        gate = NoAnswerPostprocessor.from_dict({**gate.to_dict(), **overrides})
    return gate


def _gate_calibration_warnings(config: PipelineConfig, gate: Any, reranker: Any) -> None:
    fitted = ((gate.fit_report or {}).get("retriever") or {}) if gate is not None else {}
    top_k, fitted_top_k = config.retriever.similarity_top_k, fitted.get("similarity_top_k")
    # A gate reads only its first feature_top_k results: more than calibrated changes nothing, fewer does.
    reads = getattr(gate, "feature_top_k", None)
    top_k_differs = top_k < reads if reads is not None else top_k != fitted_top_k
    if fitted and (fitted.get("mode") != config.retriever.mode or top_k_differs):
        logger.warning(
            "the no-answer gate %s was calibrated with mode %s, similarity_top_k %s; the config retrieves with mode %s, "
            "similarity_top_k %s: its confidences may be off (calibrate again with `rkit calibrate --config FILE`)",
            config.no_answer.gate_path if config.no_answer else None, fitted.get("mode"), fitted.get("similarity_top_k"),
            config.retriever.mode, config.retriever.similarity_top_k,
        )
    fitted_reranker = (gate.fit_report or {}).get("reranker") if gate is not None else None
    if fitted_reranker and reranker is not None and fitted_reranker.get("model") != getattr(reranker, "model", None):
        logger.warning(
            "the no-answer gate was calibrated after reranker %r; the config reranks with %r: its confidences may be off",
            fitted_reranker.get("model"), getattr(reranker, "model", None),
        )


#: Modes whose results carry each leg's score and rank (what a gate fitted on "legs" reads):
#: ``qdrant_hybrid`` too, whose legs run in the engine's batch beside its fusion.
_FUSED_MODES = ("hybrid", "hybrid_score", "hybrid_rrf", "qdrant_hybrid")


def _check_gate_features(config: PipelineConfig, gate: Any) -> None:
    """Refuse a gate whose features the configured retriever cannot give (it would fail, or read
    fused scores that are not comparable across queries)."""
    if gate is None or not gate.is_fitted:
        return
    mode = config.retriever.mode
    if gate.feature_set == "legs" and mode in ("dense", "sparse"):
        why = "was calibrated on fused results (each leg's score and rank)"
    elif gate.feature_set == "score" and mode in _FUSED_MODES:
        why = "was calibrated on a single-leg retriever's scores"
    else:
        return
    raise PipelineConfigError(
        config.source,
        f"the gate {config.no_answer.gate_path if config.no_answer else ''} {why}, which retriever.mode {mode!r} does not "
        f"give: use the mode it was calibrated with ({((gate.fit_report or {}).get('retriever') or {}).get('mode', 'see its fit_report')}) "
        "or calibrate again with `rkit calibrate --config FILE`",
        "no_answer.gate_path",
    )


def build_postprocessors(config: PipelineConfig) -> List[Any]:
    """The precision stage in order: [gate, reranker, context], or [reranker, gate, context] for a
    gate calibrated on reranked results; stages that are off are left out."""
    gate = load_gate(config)
    reranker = config.reranker.build() if config.stage_enabled("reranker") else None
    context = config.context.build() if config.stage_enabled("context") else None
    _gate_calibration_warnings(config, gate, reranker)
    _check_gate_features(config, gate)
    gate_after_reranker = gate is not None and gate.feature_set == "rerank"
    if gate_after_reranker and reranker is None:
        raise PipelineConfigError(
            config.source,
            f"the gate {config.no_answer.gate_path if config.no_answer else ''} was calibrated on reranked results, but the config "
            "has no reranker: add the reranker section it was calibrated with, or calibrate again without it",
            "no_answer.gate_path",
        )
    stages = [reranker, gate, context] if gate_after_reranker else [gate, reranker, context]
    return [stage for stage in stages if stage is not None]


def make_tracer(config: PipelineConfig) -> Any:
    """The trace collector of ``config.tracing`` (a JsonlTraceWriter with ``jsonl_path``), or None when off."""
    if not config.tracing.enabled:
        return None
    from .tracing import JsonlTraceWriter, TraceCollector

    if config.tracing.jsonl_path:
        return JsonlTraceWriter(path=str(config.tracing.jsonl_path), keep=True)
    return TraceCollector()


class _ScopedHandler:
    """Installs an event handler on LlamaIndex's root dispatcher while at least one query runs."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self._active = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.handler is None:
            yield
            return
        with self._lock:
            if self._active == 0:
                self.handler.install()
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self.handler.uninstall()


class PipelineQueryEngine(RetrieverQueryEngine):
    """The ``RetrieverQueryEngine`` a :class:`PipelineConfig` describes.

    Its retriever is a :class:`PipelineRetriever` and its node postprocessors are
    :func:`build_postprocessors`'s. With ``tracing.enabled`` the trace collector (``.tracer``; a
    ``JsonlTraceWriter`` with ``tracing.jsonl_path``) listens on LlamaIndex's root dispatcher
    while a ``query``/``aquery`` of this engine runs (a query of another engine running at the
    same moment in another thread is then traced too), and each response gets
    ``metadata["trace"]``. :meth:`close` closes the index the engine opened. Bound to an open
    index, it cannot be serialised: ``to_dict()`` raises a TypeError.
    """

    pipeline_config: Optional[PipelineConfig] = None
    tracer: Any = None
    _scope: Optional[_ScopedHandler] = None

    def query(self, str_or_query_bundle: Any) -> Any:
        with self._scoped():
            return super().query(str_or_query_bundle)

    async def aquery(self, str_or_query_bundle: Any) -> Any:
        with self._scoped():
            return await super().aquery(str_or_query_bundle)

    def _scoped(self) -> Any:
        return self._scope.active() if self._scope is not None else contextlib.nullcontext()

    def to_dict(self, **kwargs: Any) -> Dict[str, Any]:
        raise TypeError(
            "a query engine bound to an open index cannot be serialised: serialise its config "
            "(engine.pipeline_config.to_dict() or .to_yaml()) and rebuild it with build_query_engine(config, llm=...)"
        )

    def close(self) -> None:
        """Close the index if the engine opened it."""
        retriever = self.retriever
        if isinstance(retriever, (PipelineRetriever, PostprocessedRetriever)):
            retriever.close()

    def __enter__(self) -> "PipelineQueryEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _engine_options() -> List[str]:
    """The keywords of ``RetrieverQueryEngine.from_args`` that :func:`build_query_engine` passes on
    (its ``**kwargs`` swallows any other name without a word)."""
    import inspect

    taken = ("retriever", "llm", "node_postprocessors")
    params = inspect.signature(RetrieverQueryEngine.from_args).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in taken]


def build_query_engine(config: PipelineConfig, llm: Any = None, index: Any = None, **engine_kwargs: Any) -> Any:
    """A :class:`PipelineQueryEngine` (a ``RetrieverQueryEngine``): the config's retriever and its
    precision stage (gate, reranker, context) as node postprocessors, answering with ``llm``.

    ``llm`` defaults to ``llama_index.core.Settings.llm`` when you set one; there is no silent
    fallback to a paid API. ``index``: an open HybridIndex to use (default: the config's, opened
    and closed with the engine). Other keywords go to ``RetrieverQueryEngine.from_args``
    (``response_mode``, ``text_qa_template``, ``streaming``, ...).
    """
    from ._settings import engine_kwargs_for, settings_llm

    if llm is None and settings_llm() is None:
        raise ValueError(
            "build_query_engine needs an LLM: pass llm=... (any LlamaIndex LLM) or set llama_index.core.Settings.llm; "
            "this package never falls back to a paid API"
        )
    if "node_postprocessors" in engine_kwargs:
        raise TypeError("node_postprocessors come from the config (no_answer, reranker, context sections); do not pass them")
    check_options("build_query_engine", engine_kwargs, _engine_options())  # from_args would drop a misspelt one
    postprocessors = build_postprocessors(config)
    retriever = build_retriever(config, index=index)
    try:
        engine = PipelineQueryEngine.from_args(
            retriever, llm=llm, node_postprocessors=postprocessors, **engine_kwargs_for(llm, engine_kwargs)
        )
    except BaseException:
        retriever.close()
        raise
    engine.pipeline_config = config
    engine.tracer = make_tracer(config)
    engine._scope = _ScopedHandler(engine.tracer)
    return engine


# ------------------------------------------------------------------------------ evaluation
def to_eval_config(config: PipelineConfig, default_name: Optional[str] = None, source: str = "config") -> Any:
    """The ``rkit eval`` configuration of a pipeline: its chunking, embedding model, BM25
    parameters and retriever, followed by its precision stage (gate, reranker, context).

    The retriever returns ``similarity_top_k`` results, as in the pipeline (cutoffs past it see no
    more). The evaluation job indexes the dataset's documents in its own folders, so the config's
    ``reader.paths`` and ``index.storage_dir`` (locations) are not used; settings the job
    cannot honour (another reader, a Qdrant server, retriever filters or ``dense_search``,
    embedding options, tracing) are refused.
    """
    from .evaluation.configs import PARSER_CLASSES, EvalConfig, build_parser

    def refuse(key: str, why: str) -> PipelineConfigError:
        return PipelineConfigError(source, f"{why}; rkit eval cannot honour it: remove it from the config to evaluate this pipeline", key)

    if config.reader.component != "document_folder" or config.reader.options:
        raise refuse("reader", "the evaluation reads the dataset's documents with the default reader (document_folder, no options)")
    if config.index.qdrant_url is not None:
        raise refuse("index.qdrant_url", "the evaluation builds local indexes")
    if config.index.qdrant_api_key_env is not None:
        raise refuse("index.qdrant_api_key_env", "the evaluation builds local indexes")
    for key in ("dense_search", "filters"):
        if getattr(config.retriever, key) is not None:
            raise refuse(f"retriever.{key}", "the evaluation retrieves over the whole dataset with the default dense search")
    defaults = EmbeddingConfig()
    for key in ("query_backend", "embed_batch_size"):
        if getattr(config.embedding, key) != getattr(defaults, key):
            raise refuse(f"embedding.{key}", "the evaluation loads embedding models by name with the default options")
    if config.tracing.enabled:
        raise refuse("tracing.enabled", "the evaluation does not trace")
    parser = make_node_parser(config)
    class_name = type(parser).__name__
    if class_name not in PARSER_CLASSES or type(build_parser(class_name, {})) is not type(parser):
        raise refuse("chunking.component", f"the evaluation chunks with {', '.join(PARSER_CLASSES)} only, not {config.chunking.component!r}")
    retriever = config.retriever
    kwargs: Dict[str, Any] = {}
    if retriever.candidate_top_k is not None:
        kwargs["candidate_top_k"] = retriever.candidate_top_k
    if retriever.rrf_k is not None:
        kwargs["rrf_k"] = float(retriever.rrf_k)
    if retriever.weights is not None:
        kwargs["weights"] = tuple(float(w) for w in retriever.weights)
    postprocessors = tuple(component_to_dict(p) for p in build_postprocessors(config))
    name = config.name or default_name or "pipeline"
    if config.reader.paths or config.index.storage_dir:
        logger.info("config %s: rkit eval indexes the dataset's documents itself; reader.paths and index.storage_dir are not used", name)
    return EvalConfig(
        name=name,
        retriever="bm25" if retriever.mode == "sparse" else retriever.mode,
        node_parser=class_name,
        parser_args=dict(config.chunking.options),
        embed_model=config.embedding.model,
        similarity_top_k=retriever.similarity_top_k,
        bm25_k1=float(config.index.bm25_k1),
        bm25_b=float(config.index.bm25_b),
        postprocessors=postprocessors,
        source=source,
        **kwargs,
    )
