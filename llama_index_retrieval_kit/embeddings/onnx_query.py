"""``FastHuggingFaceEmbedding``: LlamaIndex's ``HuggingFaceEmbedding`` with a fast query path.

Why: a retriever embeds one short query per call, and PyTorch on CPU spends most of that call in
small-matrix overhead (about 16-24 ms for all-MiniLM-L6-v2 on two cores). ONNX Runtime runs the
same weights in about 6 ms. Batches of documents stay on PyTorch (sentence-transformers), which
is as fast or faster there, so indexed vectors are exactly ``HuggingFaceEmbedding``'s.

How: on the first query the model's transformer is exported once to ONNX (``torch.onnx``,
cached on disk by a hash of the weights), checked against PyTorch on probe texts, and used for
every later query. Pooling and normalisation are sentence-transformers' own settings (mean or CLS
pooling, optional unit length). Anything this path cannot reproduce exactly (other module
stacks, prompts excluded from pooling, a failed export or check) falls back to PyTorch with one
warning, so the vectors are always the model's.

The ONNX path is an optimisation, installed with the ``onnx`` extra (``onnx`` for the export,
``onnxruntime`` to run it: ``pip install 'llama-index-retrieval-kit[onnx]'``). Without it, queries
are embedded by PyTorch (the same vectors, within ``onnx_tolerance``) and one INFO line names the
extra.

Privacy: ONNX Runtime's telemetry is turned off before this module first imports it
(``ORT_DISABLE_TELEMETRY=1`` unless already set, then ``onnxruntime.disable_telemetry_events()``).
Without that, importing onnxruntime writes a device id and an event store under
``~/.cache/Microsoft/DeveloperTools/.onnxruntime`` (``$XDG_CACHE_HOME`` when set). A process that
imported onnxruntime itself before has already written them.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import tempfile
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple

import numpy as np
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from pydantic import Field, PrivateAttr

from .._enums import QueryBackend
from .._extras import MissingExtraError, require_extra
from ..retrievers.checks import check_query_text
from .onnx_runtime import (  # noqa: F401  (re-exported: their home before onnx_runtime)
    CACHE_ENV,
    DEFAULT_ONNX_SPIN_US,
    ONNX_MODULES,
    ORT_TELEMETRY_ENV,
    default_cache_dir,
    import_onnxruntime,
    onnx_session_options,
    pool,
)
from .query_export import PROBES

logger = logging.getLogger(__name__)

#: Texts the export is traced on (shapes only: the axes are dynamic).
_EXPORT_SAMPLE = PROBES[:3]
#: What a FastHuggingFaceEmbedding may be given without changing how a query is embedded, besides
#: the settings a query export record is keyed by (``_QUERY_SETTINGS``); anything else (model
#: keyword arguments for sentence-transformers) means no record is written.
_QUERY_NEUTRAL_ARGS = frozenset({
    "model_name", "text_instruction", "embed_batch_size", "cache_folder", "device", "callback_manager",
    "show_progress_bar", "num_workers", "embeddings_cache", "parallel_process", "target_devices",
})
_QUERY_SETTINGS = ("normalize", "query_instruction", "max_length")


def weights_fingerprint(module: Any, extra: str = "") -> str:
    """A short hash of a torch module's parameters and buffers (names, shapes, values)."""
    digest = hashlib.sha256(extra.encode())
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(np.ascontiguousarray(tensor.detach().cpu().float().numpy()).tobytes())
    return digest.hexdigest()[:20]


def export_model_output(
    hf_model: Any,
    input_names: List[str],
    sample: dict,
    path: Path,
    output: str,
    output_axes: Dict[int, str],
    fused_model_types: Tuple[str, ...] = ("bert",),
) -> None:
    """Export ``hf_model`` (inputs -> its ``output`` field) to ONNX at ``path`` atomically.

    Models whose ``model_type`` is in ``fused_model_types`` are exported with eager attention and
    then passed through ONNX Runtime's transformer optimizer, which fuses attention, embedding and
    layer norms (about 17% faster per query than the plain export here); any other model, or a
    failed fusion, keeps the plain export. The caller checks the result against PyTorch.
    """
    import torch

    class Output(torch.nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, *inputs: Any) -> Any:
            return getattr(self.model(**dict(zip(input_names, inputs))), output)

    config = hf_model.config
    fuse = getattr(config, "model_type", None) in fused_model_types and hasattr(hf_model, "set_attn_implementation")
    previous = getattr(config, "_attn_implementation", None)
    args = tuple(torch.as_tensor(sample[name]) for name in input_names)
    axes: Dict[str, Dict[int, str]] = {name: {0: "batch", 1: "tokens"} for name in input_names}
    axes[output] = dict(output_axes)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".onnx.tmp")
    os.close(fd)
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            if fuse:
                hf_model.set_attn_implementation("eager")  # the pattern the optimizer fuses
            try:
                torch.onnx.export(
                    Output(hf_model).eval(),
                    args,
                    tmp,
                    input_names=input_names,
                    output_names=[output],
                    dynamic_axes=axes,
                    opset_version=17,
                    dynamo=False,
                )
            finally:
                if fuse and previous:
                    hf_model.set_attn_implementation(previous)
            if fuse:
                _fuse_transformer_ops(tmp, config)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _export_onnx(auto_model: Any, input_names: List[str], sample: dict, path: Path) -> None:
    """Export ``auto_model`` (inputs -> last_hidden_state) to ``path`` atomically."""
    export_model_output(auto_model, input_names, sample, path, "last_hidden_state", {0: "batch", 1: "tokens"})


def _fuse_transformer_ops(onnx_path: str, config: Any) -> None:
    """Rewrite ``onnx_path`` with ONNX Runtime's BERT fusions; leave it as is when that fails."""
    try:
        import_onnxruntime()
        from onnxruntime.transformers import optimizer

        fused = optimizer.optimize_model(
            onnx_path, model_type="bert", num_heads=config.num_attention_heads, hidden_size=config.hidden_size
        )
        fused.save_model_to_file(onnx_path)
    except Exception as exc:  # optional speed-up: the plain export is still correct
        logger.info("ONNX Runtime fusion skipped (%s: %s); using the plain export", type(exc).__name__, exc)


class _NotFaster(str):
    """Why the ONNX path is off when the reason is only speed (an expected outcome: logged at INFO)."""


class FastHuggingFaceEmbedding(HuggingFaceEmbedding):
    """``HuggingFaceEmbedding`` whose query embeddings run in ONNX Runtime (same weights).

    A drop-in replacement: same constructor, same ``model_name``, document vectors computed by
    sentence-transformers exactly as ``HuggingFaceEmbedding`` does; query vectors agree with it
    to ``onnx_tolerance`` (checked when the ONNX model is first used). Set
    ``query_backend="torch"`` to turn the ONNX path off.
    """

    query_backend: Literal["onnx", "torch"] = Field(
        default="onnx", description="Engine for query embeddings: 'onnx' (ONNX Runtime, fast for one text) or 'torch'."
    )
    onnx_cache_dir: Optional[str] = Field(
        default=None, description=f"Folder for exported ONNX models (default ${CACHE_ENV} or ~/.cache/llama_index_retrieval_kit)."
    )
    onnx_tolerance: float = Field(
        default=1e-4, gt=0, description="Largest |difference| from PyTorch on probe texts for the ONNX path to be used."
    )
    onnx_threads: int = Field(default=0, ge=0, description="ONNX Runtime intra-op threads (0: one per core).")
    onnx_spin_us: Optional[int] = Field(
        default=DEFAULT_ONNX_SPIN_US,
        ge=0,
        description="Microseconds an ONNX Runtime worker thread spins for the next operator of a query before it "
        "sleeps: short keeps one query fast without letting a busy neighbour process slow it down; 0: never "
        "spin; None: ONNX Runtime's own spin count.",
    )
    onnx_speed_check: bool = Field(
        default=True,
        description="On first use, time one-text queries in ONNX Runtime and PyTorch (interleaved, median of "
        "7) and keep ONNX only where it is faster on this machine (e.g. not when PyTorch runs on a GPU).",
    )

    _session: Any = PrivateAttr(default=None)
    _onnx_state: str = PrivateAttr(default="unset")  # unset | ready | off
    _onnx_lock: Any = PrivateAttr(default_factory=threading.Lock)
    _input_names: List[str] = PrivateAttr(default_factory=list)
    _pooling: str = PrivateAttr(default="mean")
    _normalize_output: bool = PrivateAttr(default=False)
    # The settings a query export record is keyed by, or None when this embedder has others.
    _export_settings: Optional[Dict[str, Any]] = PrivateAttr(default=None)

    def __init__(
        self,
        *args: Any,
        query_backend: Literal["onnx", "torch"] = "onnx",
        onnx_cache_dir: Optional[str] = None,
        onnx_tolerance: float = 1e-4,
        onnx_threads: int = 0,
        onnx_spin_us: Optional[int] = DEFAULT_ONNX_SPIN_US,
        onnx_speed_check: bool = True,
        **kwargs: Any,
    ) -> None:
        query_backend = QueryBackend.from_str(query_backend).value
        if not onnx_tolerance > 0:
            raise ValueError(f"onnx_tolerance must be > 0, got {onnx_tolerance!r}")
        if onnx_threads < 0:
            raise ValueError(f"onnx_threads must be >= 0 (0: one per core), got {onnx_threads!r}")
        if onnx_spin_us is not None and (type(onnx_spin_us) is not int or onnx_spin_us < 0):
            raise ValueError(
                f"onnx_spin_us must be an int >= 0 (microseconds; 0: never spin) or None (ONNX Runtime's own), got {onnx_spin_us!r}"
            )
        # HuggingFaceEmbedding hands unknown keyword arguments to SentenceTransformer: set ours, and
        # the BaseEmbedding fields its __init__ does not take (they come back from to_dict), after.
        base_fields = {k: kwargs.pop(k) for k in ("num_workers", "embeddings_cache") if k in kwargs}
        given = set(kwargs) | ({"model_name"} if args else set())
        export_settings = None
        if len(args) <= 1 and given <= _QUERY_NEUTRAL_ARGS | set(_QUERY_SETTINGS):
            export_settings = {"normalize": kwargs.get("normalize", True), "query_instruction": kwargs.get("query_instruction"),
                               "max_length": kwargs.get("max_length")}
        super().__init__(*args, **kwargs)
        self._export_settings = export_settings
        for name, value in base_fields.items():
            setattr(self, name, value)
        self.query_backend = query_backend
        self.onnx_cache_dir = None if onnx_cache_dir is None else str(onnx_cache_dir)
        self.onnx_tolerance = onnx_tolerance
        self.onnx_threads = onnx_threads
        self.onnx_spin_us = onnx_spin_us
        self.onnx_speed_check = bool(onnx_speed_check)

    @classmethod
    def class_name(cls) -> str:
        return "FastHuggingFaceEmbedding"

    # ------------------------------------------------------------------ query path
    def _get_query_embedding(self, query: str) -> List[float]:
        check_query_text(query)
        if self.onnx_active:
            return self._onnx_embed([query], prompt_name="query")[0].tolist()
        return super()._get_query_embedding(query)

    @property
    def onnx_active(self) -> bool:
        """Whether query embeddings come from ONNX Runtime (exports the model on first use)."""
        return self.query_backend == "onnx" and self._ensure_onnx()

    @property
    def onnx_session_options(self) -> Any:
        """The ``SessionOptions`` of the running ONNX Runtime session, or None while it is not in use."""
        session = self._session if self._onnx_state == "ready" else None
        return None if session is None else session.get_session_options()

    def _onnx_embed(self, texts: List[str], prompt_name: Optional[str]) -> np.ndarray:
        prompt = (self._model.prompts or {}).get(prompt_name or "", "") or ""
        batch = self._tokenize([prompt + t for t in texts])
        hidden = self._session.run(None, {name: batch[name] for name in self._input_names})[0]
        vectors = pool(hidden, batch["attention_mask"], self._pooling)
        if self._normalize_output or self.normalize:
            vectors = vectors / np.clip(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12, None)
        return vectors

    def _tokenize(self, texts: List[str]) -> dict:
        if getattr(self._model[0], "do_lower_case", False):
            texts = [t.lower() for t in texts]
        tokenizer = self._model.tokenizer
        return dict(
            tokenizer(
                texts, padding=True, truncation=True, max_length=self._model.max_seq_length, return_tensors="np"
            )
        )

    def _ensure_onnx(self) -> bool:
        if self._onnx_state != "unset":
            return self._onnx_state == "ready"
        with self._onnx_lock:
            if self._onnx_state == "unset":
                try:
                    reason = self._prepare_onnx()
                except MissingExtraError as exc:  # a core install: PyTorch is the expected path
                    logger.info("query embeddings of %s use PyTorch: %s", self.model_name, exc)
                    self._onnx_state = "off"
                    return False
                except Exception as exc:  # any export/runtime failure: fall back, never fail a query
                    reason = f"{type(exc).__name__}: {exc}"
                if reason:
                    # Slower on this machine is an expected outcome (INFO); a failed export or check is not.
                    level = logging.INFO if isinstance(reason, _NotFaster) else logging.WARNING
                    logger.log(level, "query embeddings of %s use PyTorch: %s", self.model_name, reason)
                    self._onnx_state = "off"
                else:
                    self._onnx_state = "ready"
        return self._onnx_state == "ready"

    def _prepare_onnx(self) -> Optional[str]:
        """Export/load the ONNX model and check it; returns why it cannot be used, or None.

        Raises :class:`MissingExtraError` when the ``onnx`` extra is not installed.
        """
        require_extra("onnx", ONNX_MODULES, "the ONNX query path of FastHuggingFaceEmbedding")
        ort = import_onnxruntime()
        modules = list(self._model)
        names = [type(m).__name__ for m in modules]
        if names[:2] != ["Transformer", "Pooling"] or any(n != "Normalize" for n in names[2:]):
            return f"module stack {names} has no ONNX path (supported: Transformer, Pooling[, Normalize])"
        pooling = modules[1].get_config_dict()
        if pooling.get("pooling_mode") not in ("mean", "cls"):
            return f"pooling mode {pooling.get('pooling_mode')!r} has no ONNX path (supported: mean, cls)"
        if not pooling.get("include_prompt", True):
            return "the model's pooling excludes prompt tokens"
        auto_model = modules[0].auto_model
        self._pooling = pooling["pooling_mode"]
        self._normalize_output = "Normalize" in names[2:]
        sample = self._tokenize(list(_EXPORT_SAMPLE))
        forward_params = set(inspect.signature(auto_model.forward).parameters)
        self._input_names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in sample and n in forward_params]

        import torch

        key = weights_fingerprint(
            auto_model, extra=f"{type(auto_model).__name__}|{torch.__version__}|{ort.__version__}|{self._input_names}|fused-v1"
        )
        path = Path(self.onnx_cache_dir or default_cache_dir()) / "onnx" / key / "model.onnx"
        if not path.exists():
            logger.info("exporting %s to ONNX at %s (once)", self.model_name, path)
            _export_onnx(auto_model, self._input_names, sample, path)
        options = onnx_session_options(ort, self.onnx_threads, self.onnx_spin_us)
        self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        # Check against PyTorch (batched there), one text at a time here: the way queries arrive.
        expected = np.asarray(super()._embed(list(PROBES), prompt_name="query"), dtype=np.float32)
        got = np.vstack([self._onnx_embed([t], prompt_name="query") for t in PROBES])
        worst = float(np.abs(got - expected).max())
        if not worst <= self.onnx_tolerance:
            self._session = None
            return f"ONNX vectors differ from PyTorch by {worst:.2e} > onnx_tolerance={self.onnx_tolerance}"
        if self.onnx_speed_check:
            onnx_ms, torch_ms = self.time_query_backends()
            if not onnx_ms < torch_ms:
                self._session = None
                return _NotFaster(f"ONNX Runtime is not faster here ({onnx_ms:.1f} vs {torch_ms:.1f} ms per query in PyTorch)")
            logger.info("%s: ONNX query path %.1f ms vs PyTorch %.1f ms per query", self.model_name, onnx_ms, torch_ms)
        logger.debug("ONNX query path ready for %s (max |diff| %.1e)", self.model_name, worst)
        self._record_query_export(path, expected)
        return None

    def ensure_query_export(self) -> bool:
        """Make sure a checked query export record exists for this model and these settings
        (``embeddings.query_export``), exporting and checking the ONNX query path now when that
        was never done (once per machine and model: seconds), so that later query-only processes
        (``rkit query``) embed queries without PyTorch. True when a record exists afterwards;
        never raises (without one, queries take the regular path)."""
        folder = self._query_export_folder()
        if self.query_backend != "onnx" or folder is None:
            return False
        from .query_export import RECORD_FILE

        record = folder / RECORD_FILE
        if not record.is_file():
            logger.info("preparing the ONNX query path of %s (once): later queries start without PyTorch", self.model_name)
            self.onnx_active  # noqa: B018 - prepares the path once per process; a passing check writes the record
        return record.is_file()

    def _query_export_folder(self) -> Optional[Path]:
        """Where this model's and settings' query export record lives, or None when it gets none
        (a hub name, or sentence-transformers arguments a record does not capture)."""
        folder = Path(self.model_name)
        if self._export_settings is None or not folder.is_dir():
            return None
        from .query_export import export_settings_key, record_folder

        return record_folder(self.onnx_cache_dir, export_settings_key(folder, **self._export_settings))

    def _record_query_export(self, onnx_path: Path, probe_vectors: np.ndarray) -> None:
        """Write the query export record of this model and settings (see ``query_export``), so that
        a later process can embed queries without PyTorch; never fails the query path."""
        target = self._query_export_folder()
        if target is None:
            return
        from . import query_export as qe

        folder = Path(self.model_name)

        try:
            record = qe.QueryExportRecord(
                format=qe.QUERY_EXPORT_FORMAT,
                model_folder=str(folder.resolve()),
                files_fingerprint=qe.model_files_fingerprint(folder),
                versions=qe.installed_versions(),
                onnx_path=str(onnx_path.resolve()),
                input_names=list(self._input_names),
                query_prompt=(self._model.prompts or {}).get("query", "") or "",
                do_lower_case=bool(getattr(self._model[0], "do_lower_case", False)),
                max_seq_length=int(self._model.max_seq_length),
                truncation_side=getattr(self._model.tokenizer, "truncation_side", "right") or "right",
                pooling=self._pooling,
                normalize=bool(self._normalize_output or self.normalize),
                probes=list(PROBES),
                probe_vectors=probe_vectors.tolist(),
                tolerance=self.onnx_tolerance,
            )
            why = qe.write_query_export(target, record, self._model.tokenizer.backend_tokenizer.to_str())
        except Exception as exc:  # an optimisation for later processes: never a failure here
            why = f"{type(exc).__name__}: {exc}"
        if why:
            logger.info("no torch-free query path recorded for %s: %s", self.model_name, why)

    def time_query_backends(self, rounds: int = 7) -> tuple:
        """Median ms of one short query in ONNX Runtime and in PyTorch, interleaved (same load)."""
        text = PROBES[0]
        onnx_times, torch_times = [], []
        self._onnx_embed([text], prompt_name="query")  # warm both
        super()._embed([text], prompt_name="query")
        for _ in range(rounds):
            started = time.perf_counter()
            self._onnx_embed([text], prompt_name="query")
            onnx_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            super()._embed([text], prompt_name="query")
            torch_times.append(time.perf_counter() - started)
        return statistics.median(onnx_times) * 1000, statistics.median(torch_times) * 1000
