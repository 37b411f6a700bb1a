"""Retriever setups for the evaluation job: built-in names and a small typed YAML schema.

A configuration names *what to evaluate*: a retriever kind, the node parser that chunks the
documents, and the retriever's settings. Built-in names (``rkit eval --config NAME``):

=====================  =========================================================================
``bm25``               our BM25 (bm25s, k1=1.2, b=0.75) = ``HybridIndex`` mode ``"sparse"``
``dense``              ``HybridIndex`` mode ``"dense"`` (Qdrant local mode, offline MiniLM)
``hybrid``             ``HybridIndex`` mode ``"hybrid"`` (recommended fusion: score fusion today)
``hybrid_score``       ``HybridIndex`` mode ``"hybrid_score"`` (normalised score fusion)
``hybrid_rrf``         ``HybridIndex`` mode ``"hybrid_rrf"`` (reciprocal rank fusion, k=60)
``qdrant_hybrid``      ``HybridIndex`` mode ``"qdrant_hybrid"`` (fusion inside Qdrant)
``llamaindex-bm25``    LlamaIndex's ``BM25Retriever.from_defaults(nodes=...)``, its defaults
``llamaindex-dense``   LlamaIndex's ``VectorStoreIndex`` (in-memory) over the same nodes
=====================  =========================================================================

Our kinds chunk with :class:`SectionWindowNodeParser` (defaults) and LlamaIndex's kinds with
LlamaIndex's default ``SentenceSplitter``, unless a YAML file says otherwise::

    name: hybrid-128                 # optional (default: the file name without .yaml)
    retriever: hybrid                # required: one of the built-in names above
    node_parser:                     # optional: class + its arguments (chunk sizes here)
      class: SectionWindowNodeParser # SectionWindowNodeParser | SectionHierarchyNodeParser |
      chunk_size: 128                #   SentenceSplitter | TokenTextSplitter
      chunk_overlap: 16
    embed_model: sentence-transformers/all-MiniLM-L6-v2   # kinds with a dense leg
    similarity_top_k: 10             # optional: default = enough for the largest k
    candidate_top_k: 100             # hybrid kinds: depth of each leg before fusion (default: the index's, 200 for hybrid, 100 otherwise)
    rrf_k: 60                        # hybrid_rrf, qdrant_hybrid
    weights: [1.0, 1.0]              # hybrid, hybrid_score, hybrid_rrf: [bm25, dense]; hybrid also [bm25, dense, feedback]
    bm25: {k1: 1.2, b: 0.75}         # bm25 and the hybrid kinds

A key that does not apply to the chosen retriever is an error (it would be silently ignored
otherwise). Errors are :class:`ConfigError` (a ValueError) naming the file, the key, the bad
value and the allowed ones.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping

from .._errors import validation_error_text
from ..models import DEFAULT_EMBED_MODEL

#: Built-in retriever names and what they are.
RETRIEVERS: dict[str, str] = {
    "bm25": "our BM25 retriever (bm25s), HybridIndex mode 'sparse'",
    "dense": "HybridIndex mode 'dense' (Qdrant local mode)",
    "hybrid": "HybridIndex mode 'hybrid' (BM25 + dense, the recommended fusion: normalised score fusion)",
    "hybrid_score": "HybridIndex mode 'hybrid_score' (BM25 + dense, normalised score fusion)",
    "hybrid_rrf": "HybridIndex mode 'hybrid_rrf' (BM25 + dense, reciprocal rank fusion)",
    "qdrant_hybrid": "HybridIndex mode 'qdrant_hybrid' (fusion inside Qdrant)",
    "llamaindex-bm25": "LlamaIndex's BM25Retriever.from_defaults(nodes=...)",
    "llamaindex-dense": "LlamaIndex's VectorStoreIndex over the same nodes",
}
#: HybridIndex.as_retriever mode of each of our kinds.
HYBRID_INDEX_MODES: dict[str, str] = {
    "bm25": "sparse",
    "dense": "dense",
    "hybrid": "hybrid",
    "hybrid_score": "hybrid_score",
    "hybrid_rrf": "hybrid_rrf",
    "qdrant_hybrid": "qdrant_hybrid",
}
PARSER_CLASSES: tuple[str, ...] = (
    "SectionWindowNodeParser",
    "SectionHierarchyNodeParser",
    "SentenceSplitter",
    "TokenTextSplitter",
)
#: Parser fields a config may not set (LlamaIndex plumbing, not chunking settings).
_PARSER_INTERNAL = ("callback_manager", "id_func", "class_name")

#: Which retrievers each optional key applies to.
_KEY_SCOPE: dict[str, tuple[str, ...]] = {
    "embed_model": ("dense", "hybrid", "hybrid_score", "hybrid_rrf", "qdrant_hybrid", "llamaindex-dense"),
    "candidate_top_k": ("hybrid", "hybrid_score", "hybrid_rrf", "qdrant_hybrid"),
    "rrf_k": ("hybrid_rrf", "qdrant_hybrid"),
    "weights": ("hybrid", "hybrid_score", "hybrid_rrf"),
    "bm25": ("bm25", "hybrid", "hybrid_score", "hybrid_rrf", "qdrant_hybrid"),
}
TOP_LEVEL_KEYS: tuple[str, ...] = ("name", "retriever", "node_parser", "similarity_top_k", *_KEY_SCOPE)
BM25_KEYS: tuple[str, ...] = ("k1", "b")


class ConfigError(ValueError):
    """A configuration is invalid; the message names where (file) and what (key)."""

    def __init__(self, source: str, message: str, key: str | None = None) -> None:
        self.source = source
        self.key = key
        where = f"{source}: " + (f"key {key!r}: " if key else "")
        super().__init__(where + message)


@dataclass(frozen=True)
class EvalConfig:
    """One retriever setup to evaluate (see the module doc for the fields' meaning).

    ``node_parser`` is a class name from :data:`PARSER_CLASSES` and ``parser_args`` its keyword
    arguments. ``similarity_top_k=None`` lets the job choose a depth that fills ``max(ks)``
    results. ``source`` says where the config came from ("built-in" or a file path).
    """

    name: str
    retriever: str
    node_parser: str
    parser_args: Mapping[str, Any] = field(default_factory=dict)
    embed_model: str = DEFAULT_EMBED_MODEL
    similarity_top_k: int | None = None
    candidate_top_k: int | None = None  # None: the HybridIndex mode's own default (what users get)
    rrf_k: float = 60.0
    weights: tuple[float, ...] | None = None
    bm25_k1: float = 1.2
    bm25_b: float = 0.75
    source: str = "built-in"
    #: Node postprocessors applied to the retriever's results, in order, as
    #: ``components.component_to_dict`` dicts (a pipeline config's gate, reranker, context).
    postprocessors: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)

    def __post_init__(self) -> None:
        if self.retriever not in RETRIEVERS:
            raise ConfigError(self.source, f"unknown retriever {self.retriever!r}; choose one of {list(RETRIEVERS)}", "retriever")
        if self.node_parser not in PARSER_CLASSES:
            raise ConfigError(self.source, f"unknown class {self.node_parser!r}; choose one of {list(PARSER_CLASSES)}", "node_parser")
        # Deep copies: the config shares no nested list or mapping with the caller's data (a
        # heading_patterns list edited afterwards must not change this config or its chunking key).
        object.__setattr__(self, "parser_args", copy.deepcopy(dict(self.parser_args)))
        object.__setattr__(self, "postprocessors", tuple(copy.deepcopy(dict(spec)) for spec in self.postprocessors))

    @property
    def uses_hybrid_index(self) -> bool:
        """True for our kinds (served by a HybridIndex or, for bm25 alone, its BM25 leg)."""
        return self.retriever in HYBRID_INDEX_MODES

    @property
    def needs_embeddings(self) -> bool:
        """True when the retriever has a dense leg (documents must be embedded)."""
        return self.retriever not in ("bm25", "llamaindex-bm25")

    def make_postprocessors(self) -> list[Any]:
        """New instances of :attr:`postprocessors`, in order."""
        from ..components import ComponentKind, component_from_dict

        return [
            component_from_dict(spec, ComponentKind.POSTPROCESSOR, key=f"postprocessors[{i}]")
            for i, spec in enumerate(self.postprocessors)
        ]

    def make_parser(self) -> Any:
        """A new node parser instance from ``node_parser`` and ``parser_args``."""
        return build_parser(self.node_parser, self.parser_args, self.source)

    def chunking_key(self) -> str:
        """Identifies the chunking: configs whose parsers have the same settings get the same nodes.

        Computed from the parser's full settings, so an argument given at its default value
        and an argument left out are the same chunking.
        """
        settings = {k: v for k, v in self.make_parser().to_dict().items() if k not in _PARSER_INTERNAL}
        return _digest({"class": self.node_parser, "settings": settings})

    def index_key(self) -> str:
        """Identifies a HybridIndex build: chunking + embedding model + BM25 parameters."""
        return _digest(
            {"chunking": self.chunking_key(), "embed_model": self.embed_model, "k1": self.bm25_k1, "b": self.bm25_b}
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings (what metrics.json records for this config)."""
        data: dict[str, Any] = {
            "name": self.name,
            "retriever": self.retriever,
            "description": RETRIEVERS[self.retriever],
            "node_parser": {"class": self.node_parser, **dict(self.parser_args)},
            "similarity_top_k": self.similarity_top_k,
            "source": self.source,
        }
        if self.postprocessors:
            data["postprocessors"] = [dict(spec) for spec in self.postprocessors]
        for key, scope in _KEY_SCOPE.items():
            if self.retriever in scope:
                data[key] = {
                    "embed_model": self.embed_model,
                    "candidate_top_k": self.candidate_top_k,
                    "rrf_k": self.rrf_k,
                    "weights": list(self.weights) if self.weights is not None else None,
                    "bm25": {"k1": self.bm25_k1, "b": self.bm25_b},
                }[key]
        return data


def _digest(data: Mapping[str, Any]) -> str:
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def default_parser_class(retriever: str) -> str:
    """LlamaIndex's default splitter for LlamaIndex's kinds, ours for ours."""
    return "SentenceSplitter" if retriever.startswith("llamaindex-") else "SectionWindowNodeParser"


def builtin_config(name: str) -> EvalConfig:
    """The built-in configuration called ``name`` (see :data:`RETRIEVERS`)."""
    if name not in RETRIEVERS:
        raise ConfigError("--config", f"unknown configuration {name!r}; built-in names: {list(RETRIEVERS)}, or give a .yaml file")
    return EvalConfig(name=name, retriever=name, node_parser=default_parser_class(name))


def _parser_class(name: str) -> type:
    if name in ("SectionWindowNodeParser", "SectionHierarchyNodeParser"):
        from .. import node_parser

        return getattr(node_parser, name)
    from llama_index.core import node_parser as core

    return getattr(core, name)


def parser_fields(class_name: str) -> list[str]:
    """The arguments a config may give to parser ``class_name``."""
    return [name for name in _parser_class(class_name).model_fields if name not in _PARSER_INTERNAL]


def build_parser(class_name: str, args: Mapping[str, Any], source: str = "config") -> Any:
    """Instantiate parser ``class_name`` with ``args``; bad names or values raise ConfigError."""
    if class_name not in PARSER_CLASSES:
        raise ConfigError(source, f"unknown class {class_name!r}; choose one of {list(PARSER_CLASSES)}", "node_parser.class")
    allowed = parser_fields(class_name)
    for key in args:
        if key not in allowed:
            raise ConfigError(source, f"{class_name} has no argument {key!r}; allowed: {allowed}", f"node_parser.{key}")
    try:
        return _parser_class(class_name)(**dict(args))
    except (ValueError, TypeError) as exc:  # pydantic ValidationError is a ValueError
        raise ConfigError(source, f"invalid arguments for {class_name}: {validation_error_text(exc)}", "node_parser") from exc


# --------------------------------------------------------------------------------------------
# YAML
# --------------------------------------------------------------------------------------------


def _number(source: str, key: str, value: Any, minimum: float, integer: bool = False) -> Any:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if integer:
        ok = ok and isinstance(value, numbers.Integral)
    if not ok or value < minimum:
        kind = "an integer" if integer else "a number"
        raise ConfigError(source, f"must be {kind} >= {minimum}, got {value!r}", key)
    return int(value) if integer else float(value)


def _mapping(source: str, key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(source, f"must be a mapping (key: value lines), got {type(value).__name__} {value!r}", key)
    return dict(value)


def config_from_dict(data: Mapping[str, Any], source: str = "config", default_name: str | None = None) -> EvalConfig:
    """An :class:`EvalConfig` from parsed YAML (see the module doc for the schema)."""
    data = _mapping(source, "(top level)", data)
    unknown = [key for key in data if key not in TOP_LEVEL_KEYS]
    if unknown:
        raise ConfigError(source, f"unknown key; allowed keys: {list(TOP_LEVEL_KEYS)}", str(unknown[0]))
    retriever = data.get("retriever")
    if retriever is None:
        raise ConfigError(source, f"missing (required); one of {list(RETRIEVERS)}", "retriever")
    if retriever not in RETRIEVERS:
        raise ConfigError(source, f"unknown retriever {retriever!r}; choose one of {list(RETRIEVERS)}", "retriever")
    for key, scope in _KEY_SCOPE.items():
        if key in data and retriever not in scope:
            raise ConfigError(source, f"does not apply to retriever {retriever!r} (only to {list(scope)})", key)

    name = data.get("name", default_name or retriever)
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(source, f"must be a non-empty string, got {name!r}", "name")

    parser_data = _mapping(source, "node_parser", data.get("node_parser") or {})
    class_name = parser_data.pop("class", default_parser_class(retriever))
    if class_name not in PARSER_CLASSES:
        raise ConfigError(source, f"unknown class {class_name!r}; choose one of {list(PARSER_CLASSES)}", "node_parser.class")
    build_parser(class_name, parser_data, source)  # validate names and values now

    kwargs: dict[str, Any] = {}
    if data.get("similarity_top_k") is not None:
        kwargs["similarity_top_k"] = _number(source, "similarity_top_k", data["similarity_top_k"], 1, integer=True)
    if "candidate_top_k" in data:
        kwargs["candidate_top_k"] = _number(source, "candidate_top_k", data["candidate_top_k"], 1, integer=True)
    if "rrf_k" in data:
        kwargs["rrf_k"] = _number(source, "rrf_k", data["rrf_k"], 0)
        if retriever == "qdrant_hybrid" and not float(kwargs["rrf_k"]).is_integer():
            raise ConfigError(source, f"must be a whole number for qdrant_hybrid (Qdrant's RRF k is an integer), got {data['rrf_k']!r}", "rrf_k")
    if "embed_model" in data:
        if not isinstance(data["embed_model"], str) or not data["embed_model"].strip():
            raise ConfigError(source, f"must be a model name or folder, got {data['embed_model']!r}", "embed_model")
        kwargs["embed_model"] = data["embed_model"]
    if "weights" in data:
        weights = data["weights"]
        counts = (2, 3) if retriever == "hybrid" else (2,)  # hybrid's feedback fusion: [bm25, dense, feedback] too
        if not isinstance(weights, list) or len(weights) not in counts:
            shape = "2 numbers [bm25, dense] or 3 [bm25, dense, feedback]" if retriever == "hybrid" else "2 numbers [bm25, dense]"
            raise ConfigError(source, f"must be a list of {shape}, got {weights!r}", "weights")
        kwargs["weights"] = tuple(_number(source, "weights", w, 0) for w in weights)
    if "bm25" in data:
        bm25 = _mapping(source, "bm25", data["bm25"])
        for key in bm25:
            if key not in BM25_KEYS:
                raise ConfigError(source, f"unknown key; allowed: {list(BM25_KEYS)}", f"bm25.{key}")
        if "k1" in bm25:
            kwargs["bm25_k1"] = _number(source, "bm25.k1", bm25["k1"], 0)
        if "b" in bm25:
            kwargs["bm25_b"] = _number(source, "bm25.b", bm25["b"], 0)
            if kwargs["bm25_b"] > 1:
                raise ConfigError(source, f"must be a number in [0, 1], got {bm25['b']!r}", "bm25.b")
    return EvalConfig(
        name=name.strip(),
        retriever=retriever,
        node_parser=class_name,
        parser_args=parser_data,
        source=source,
        **kwargs,
    )


@functools.lru_cache(maxsize=1)
def _unique_keys_loader() -> Any:
    """A ``yaml.SafeLoader`` subclass that refuses a key repeated in one mapping."""
    import yaml

    class UniqueKeySafeLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: Dict[Any, Any] = {}
                for key_node, _ in node.value:  # keys written here (a '<<' merge's keys may be overridden)
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.setdefault(key, key_node)
                    except TypeError:  # an unhashable key: the base class reports it
                        continue
                    if first is not key_node:
                        raise yaml.constructor.ConstructorError(
                            None, None,
                            f"key {key!r} is given twice (first on line {first.start_mark.line + 1}); "
                            "YAML would keep only the last: merge the two or remove one",
                            key_node.start_mark,
                        )
            return super().construct_mapping(node, deep=deep)

    return UniqueKeySafeLoader


def read_yaml_file(
    path: str | Path, empty_hint: str = "it needs at least 'retriever: <name>'", missing_hint: str | None = None
) -> Any:
    """Parsed YAML of ``path``; errors are :class:`ConfigError` naming the file (and line).

    A key given twice in one mapping is refused (YAML loaders keep the last silently, so a
    second ``index:`` section would replace the first without a word)."""
    import yaml

    file_path = Path(path)
    if file_path.is_dir():
        raise ConfigError(str(file_path), "is a folder; give the path of a .yaml configuration file")
    if not file_path.is_file():
        raise ConfigError(str(file_path), "file not found; " + (
            missing_hint or f"give a built-in name ({', '.join(RETRIEVERS)}) or the path of a .yaml configuration"
        ))
    try:
        data = yaml.load(file_path.read_text(encoding="utf-8"), Loader=_unique_keys_loader())  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(str(file_path), f"not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(str(file_path), f"not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8 YAML") from exc
    except RecursionError:
        raise ConfigError(str(file_path), "nested too deeply to read (lists/mappings inside each other); "
                          "a configuration nests at most a few levels") from None
    except OSError as exc:
        raise ConfigError(str(file_path), f"cannot read: {exc.strerror or exc}") from exc
    if data is None:
        raise ConfigError(str(file_path), f"the file is empty; {empty_hint}")
    return data


def load_config_file(path: str | Path) -> EvalConfig:
    """A configuration from a YAML file (name defaults to the file name without extension).

    A pipeline config (``llama_index_retrieval_kit.pipeline``: sections such as ``chunking``,
    ``index`` and a ``retriever`` mapping) is accepted too: its retrieval settings and
    precision stage are evaluated (:func:`~llama_index_retrieval_kit.pipeline.to_eval_config`).
    """
    file_path = Path(path)
    data = read_yaml_file(file_path)
    from ..pipeline import is_pipeline_config

    if is_pipeline_config(data):
        from ..pipeline import PipelineConfig, to_eval_config

        pipeline = PipelineConfig.from_dict(data, source=str(file_path), base_dir=file_path.resolve().parent)
        return to_eval_config(pipeline, default_name=file_path.stem, source=str(file_path))
    return config_from_dict(data, source=str(file_path), default_name=file_path.stem)


def resolve_config(spec: str | Path | EvalConfig) -> EvalConfig:
    """An :class:`EvalConfig` from a built-in name, a YAML path, or an EvalConfig (returned as is)."""
    if isinstance(spec, EvalConfig):
        return spec
    text = str(spec)
    if text in RETRIEVERS:
        return builtin_config(text)
    if text.endswith((".yaml", ".yml")) or Path(text).exists():
        return load_config_file(text)
    raise ConfigError(
        "--config", f"unknown configuration {text!r}; built-in names: {list(RETRIEVERS)}, or the path of a .yaml file"
    )
