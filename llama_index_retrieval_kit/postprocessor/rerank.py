"""Cross-encoder reranking: :class:`CrossEncoderReranker`, a LlamaIndex node postprocessor.

A cross-encoder reads the query and one passage together and gives one logit per pair; this
module turns that logit into a probability with the logistic sigmoid, ``p = 1 / (1 + e^-logit)``
(bge-reranker and the MS MARCO cross-encoders are trained with a binary cross-entropy head, so
``p`` is their probability that the passage is relevant), and orders the candidates by it.

Two backends load the same Hugging Face checkpoints (a local folder or a hub name):

* ``flag_embedding``: ``FlagEmbedding.FlagReranker``, the library behind LlamaIndex's
  ``FlagEmbeddingReranker`` (install with ``pip install 'llama-index-retrieval-kit[rerank]'``);
* ``sentence_transformers``: ``sentence_transformers.CrossEncoder``, optionally with the forward
  pass exported to ONNX Runtime (``onnx=True``; CPU only, measured in docs/reranking.md).

Results are new :class:`RerankedNodeWithScore` objects: ``score`` is the probability, and the
score and rank each candidate had before reranking (and, for fused results, every leg's score
and rank) stay on it, so later stages (a no-answer gate, tracing) can read them. The nodes and
``NodeWithScore`` objects a caller passes in are never changed. A result whose ``node_id`` repeats an
earlier one is dropped before scoring (the first occurrence is kept).

Cost is the problem on CPU (docs/reranking.md): candidates can be capped by count
(``max_candidates``) and by time (``latency_budget_ms``, from a running estimate of a model call's
cost, ``fixed_ms + pairs * per_pair_ms``), passages are cut to what the model reads before
tokenizing, and loading a model of more than ~100M parameters on CPU logs a warning with the CPU
recommendation. Pairs longer than ``max_length`` tokens (the model reads only their start) are
counted in :class:`RerankStats` and logged once per reranker.

One reranker may serve concurrent queries (threads, and ``aquery``, which LlamaIndex runs in
threads): FlagEmbedding changes its tokenizer's truncation settings on every call, so its calls
are serialized by a lock; sentence-transformers' ``CrossEncoder`` tokenizes with the same settings
every time and runs without one.

Heavy imports (torch, transformers, sentence-transformers, FlagEmbedding, onnxruntime) happen
inside methods, on first use: importing this module does not import torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.bridge.pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    field_serializer,
    field_validator,
    model_validator,
)
from llama_index.core.callbacks import CBEventType, EventPayload
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.rerank import ReRankEndEvent, ReRankStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle

from .._options import StrictOptions
from .._transient import LastValue, TransientState
from ..node_parser.metadata import SECTION_HEADER_KEY
from ..retrievers.checks import check_positive_int, check_query_text
from ..retrievers.fusion import FusedNodeWithScore
from ..tracing import trace_rerank, tracing_enabled
from .._enums import ChoiceEnum

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

#: The design's reranker (docs/architecture.md): best quality, but ~0.8 s per pair on 2 CPU cores.
DEFAULT_RERANK_MODEL = "BAAI/bge-reranker-large"
#: What docs/reranking.md recommends on CPU (22.7M parameters, ~20x cheaper than bge-reranker-large).
CPU_RECOMMENDED_MODEL = "cross-encoder/ms-marco-MiniLM-L6-v2"
#: Above this many parameters a model on CPU gets a warning when it loads.
LARGE_MODEL_PARAMETERS = 100_000_000
#: Characters kept per token of ``max_length`` before tokenizing. WordPiece / SentencePiece tokens
#: of natural text average 3-5 characters, so 16 never cuts text the model would have read.
MAX_CHARS_PER_TOKEN = 16
#: Weight of the newest measurement in the running cost estimate (older ones decay by 1 - this per call).
COST_ESTIMATE_WEIGHT = 0.3
#: Spread of call sizes (weighted coefficient of variation of pairs per call) needed to tell a call's
#: fixed cost from its per-pair cost; below it the fixed part keeps its last value.
MIN_SIZE_SPREAD = 0.1
#: Smallest per-pair cost an estimate reports (keeps the budget arithmetic finite).
MIN_PER_PAIR_MS = 1e-3
#: A tiny pair for the forward passes at load: the first warms the model up (not measured), the
#: second measures the fixed cost of a call (the starting point of the cost estimate).
_WARM_UP_PAIRS = (("warm up", "warm up"),)
#: ONNX's protobuf files hold at most 2 GB; bigger models stay on PyTorch.
ONNX_MAX_WEIGHT_BYTES = 2_000_000_000
INSTALL_HINT = "pip install 'llama-index-retrieval-kit[rerank]'"
_FLAG_FEATURE = "the 'flag_embedding' rerank backend (CrossEncoderReranker's default)"
_FLAG_ALTERNATIVE = "pass backend='sentence_transformers' (core install)"
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:<index>", "mps")
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_ONNX_PROBES = (
    ("What is the annual fee?", "The annual fee is $95, charged on the first statement after account opening."),
    ("late payment", "2. Fees > 2.2 Late Payment Fee\nA late payment fee of up to $40 applies."),
    ("How do I dispute a charge?", "Write to us within 60 days of the statement date to dispute a charge."),
)


class RerankBackend(ChoiceEnum):
    """The library that runs the cross-encoder."""

    FLAG_EMBEDDING = "flag_embedding"
    SENTENCE_TRANSFORMERS = "sentence_transformers"

class RerankedNodeWithScore(FusedNodeWithScore):
    """A reranked result: ``score`` is the reranker's probability; what came before is kept.

    ``leg_ranks`` / ``leg_scores`` are copied from a :class:`FusedNodeWithScore` input (empty for
    other inputs), so a later stage sees the fusion legs as well as the reranker.
    """

    pre_rerank_score: Optional[float] = Field(
        default=None, description="The score the result had before reranking (None if it had none)."
    )
    pre_rerank_rank: int = Field(description="Position (1 = first) of the result in the reranker's input list.")
    rerank_logit: float = Field(description="The cross-encoder's raw logit; score = sigmoid(rerank_logit).")

    @classmethod
    def class_name(cls) -> str:
        return "RerankedNodeWithScore"


@dataclass(frozen=True)
class RerankStats:
    """What one reranking call did (see :attr:`CrossEncoderReranker.last_stats`).

    ``candidates`` = ``duplicates_dropped`` + the distinct results, of which the first
    ``capped_to`` (``max_candidates``) were candidates and the first ``scored`` were scored.
    """

    candidates: int  # results handed in (repeated node ids included)
    capped_to: int  # distinct results kept by max_candidates
    scored: int  # pairs the model scored (fewer than capped_to when the latency budget cut)
    returned: int
    scoring_ms: float  # time in the model (tokenizing included), loading excluded
    per_pair_ms: Optional[float]  # running estimate after this call: cost of one more pair in a call
    latency_budget_ms: Optional[float]
    duplicates_dropped: int = 0  # results whose node_id repeated an earlier result's; dropped before max_candidates
    truncated: int = 0  # scored pairs longer than max_length tokens: the model read only their start
    fixed_call_ms: Optional[float] = None  # running estimate after this call: cost of a model call besides its pairs


# ------------------------------------------------------------------------------ pure functions
def sigmoid(logit: float) -> float:
    """The logistic function ``1 / (1 + e^-x)``, without overflow for large ``|x|``."""
    if logit >= 0:
        return 1.0 / (1.0 + math.exp(-logit))
    z = math.exp(logit)
    return z / (1.0 + z)


def cap_candidates(n_candidates: int, per_pair_ms: float, budget_ms: float, minimum: int = 0, fixed_ms: float = 0.0) -> int:
    """How many of ``n_candidates`` pairs fit in ``budget_ms`` in one call costing ``fixed_ms + n * per_pair_ms``.

    ``n = floor((budget_ms - fixed_ms) / per_pair_ms)``, never fewer than ``minimum`` (capped at
    ``n_candidates``) and never more than ``n_candidates``; a budget that does not cover the fixed
    cost leaves only the minimum.
    """
    if n_candidates < 0 or minimum < 0:
        raise ValueError(f"n_candidates and minimum must be >= 0, got {n_candidates!r} and {minimum!r}")
    if not (per_pair_ms > 0 and math.isfinite(per_pair_ms)):
        raise ValueError(f"per_pair_ms must be a finite number > 0, got {per_pair_ms!r}")
    if not (fixed_ms >= 0 and math.isfinite(fixed_ms)):
        raise ValueError(f"fixed_ms must be a finite number >= 0, got {fixed_ms!r}")
    left = budget_ms - fixed_ms
    fitting = int(left // per_pair_ms) if left > 0 else 0
    return min(n_candidates, max(minimum, fitting))


def running_estimate(previous: Optional[float], measured: float, weight: float = COST_ESTIMATE_WEIGHT) -> float:
    """Exponentially weighted mean: ``measured`` on the first call, then ``(1-w)*previous + w*measured``."""
    if previous is None:
        return measured
    return (1.0 - weight) * previous + weight * measured


@dataclass(frozen=True)
class CallCostEstimate:
    """Estimated time of one model call on ``n`` pairs: ``fixed_ms + n * per_pair_ms``.

    Made by :func:`update_call_cost` from measured calls; the ``*_sum`` fields are the
    exponentially weighted sums it fits the line to (``weight`` = sum of the weights).
    """

    fixed_ms: float
    per_pair_ms: float
    weight: float = 0.0
    pairs_sum: float = 0.0
    pairs_sq_sum: float = 0.0
    ms_sum: float = 0.0
    pairs_ms_sum: float = 0.0

    def call_ms(self, pairs: int) -> float:
        """Predicted milliseconds of one call on ``pairs`` pairs."""
        return self.fixed_ms + pairs * self.per_pair_ms


def fit_call_cost(
    weight: float, pairs_sum: float, pairs_sq_sum: float, ms_sum: float, pairs_ms_sum: float, fixed_before: float
) -> Tuple[float, float]:
    """``(fixed_ms, per_pair_ms)`` of the weighted least-squares line ``ms = fixed + pairs * per_pair``.

    From weighted sums over calls (``weight`` = sum w, ``pairs_sum`` = sum w*n, ``pairs_sq_sum`` =
    sum w*n^2, ``ms_sum`` = sum w*t, ``pairs_ms_sum`` = sum w*n*t). When the calls' sizes are too
    alike to separate the two parts (coefficient of variation of n below :data:`MIN_SIZE_SPREAD`) or
    the slope is not positive (noise), the fixed part stays ``fixed_before`` (0 if that is not below
    the mean call time) and ``per_pair = (mean t - fixed) / mean n``. A negative intercept gives
    ``fixed = 0`` and the line through the origin. ``per_pair`` is at least :data:`MIN_PER_PAIR_MS`.
    """
    if not weight > 0 or not pairs_sum > 0:
        raise ValueError(f"weight and pairs_sum must be > 0 (at least one measured call), got {weight!r} and {pairs_sum!r}")
    mean_pairs, mean_ms = pairs_sum / weight, ms_sum / weight
    var_pairs = max(0.0, pairs_sq_sum / weight - mean_pairs * mean_pairs)
    if var_pairs >= (MIN_SIZE_SPREAD * mean_pairs) ** 2:
        slope = (pairs_ms_sum / weight - mean_pairs * mean_ms) / var_pairs
        if slope > 0:
            intercept = mean_ms - slope * mean_pairs
            if intercept >= 0:
                return intercept, max(MIN_PER_PAIR_MS, slope)
            return 0.0, max(MIN_PER_PAIR_MS, pairs_ms_sum / pairs_sq_sum)
    fixed = fixed_before if 0 <= fixed_before < mean_ms else 0.0
    return fixed, max(MIN_PER_PAIR_MS, (mean_ms - fixed) / mean_pairs)


def update_call_cost(
    previous: Optional[CallCostEstimate],
    pairs: int,
    elapsed_ms: float,
    fixed_prior_ms: float = 0.0,
    weight: float = COST_ESTIMATE_WEIGHT,
) -> CallCostEstimate:
    """The estimate after a call of ``pairs`` pairs took ``elapsed_ms``.

    Older calls' weights are multiplied by ``1 - weight`` (the new call has weight 1), then the
    line is refitted (:func:`fit_call_cost`). ``fixed_prior_ms`` (the fixed cost measured at load)
    is the fixed part until calls of different sizes separate it.
    """
    if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 1:
        raise ValueError(f"pairs must be an int >= 1, got {pairs!r}")
    if not (elapsed_ms >= 0 and math.isfinite(elapsed_ms)):
        raise ValueError(f"elapsed_ms must be a finite number >= 0, got {elapsed_ms!r}")
    if not 0 < weight <= 1:
        raise ValueError(f"weight must be in (0, 1], got {weight!r}")
    keep = 0.0 if previous is None else 1.0 - weight
    old = previous or CallCostEstimate(fixed_ms=max(0.0, fixed_prior_ms), per_pair_ms=MIN_PER_PAIR_MS)
    sums = (
        keep * old.weight + 1.0,
        keep * old.pairs_sum + pairs,
        keep * old.pairs_sq_sum + pairs * pairs,
        keep * old.ms_sum + elapsed_ms,
        keep * old.pairs_ms_sum + pairs * elapsed_ms,
    )
    fixed_ms, per_pair_ms = fit_call_cost(*sums, fixed_before=old.fixed_ms)
    return CallCostEstimate(fixed_ms, per_pair_ms, *sums)


def first_occurrences(nodes: Sequence[NodeWithScore]) -> List[int]:
    """Positions (0-based) of the results whose ``node_id`` did not occur earlier in ``nodes``."""
    seen: set = set()
    positions = []
    for i, result in enumerate(nodes):
        node_id = result.node.node_id
        if node_id not in seen:
            seen.add(node_id)
            positions.append(i)
    return positions


def count_truncated(pair_tokens: Sequence[int], max_length: int, cut_by_chars: Sequence[bool] = ()) -> int:
    """Pairs the model does not read whole: more than ``max_length`` tokens (specials included), or cut by characters."""
    cut = list(cut_by_chars) + [False] * (len(pair_tokens) - len(cut_by_chars))
    return sum(1 for tokens, was_cut in zip(pair_tokens, cut) if was_cut or tokens > max_length)


def truncation_warning(model: str, truncated: int, scored: int, max_length: int, model_limit: Optional[int]) -> str:
    """The warning logged the first time a reranker truncates passages."""
    if model_limit is not None and model_limit <= max_length:
        advice = "max_length is this model's limit, so split documents into smaller chunks (or use a model that reads more)"
    else:
        room = f" (this model reads up to {model_limit})" if model_limit is not None else ""
        advice = f"raise max_length{room} or split documents into smaller chunks"
    return (
        f"reranker {model!r}: {truncated} of {scored} (query, passage) pairs are longer than max_length={max_length} "
        f"tokens; the model read only their start, so what a passage says after that does not count: {advice}. "
        "RerankStats.truncated counts them on every call; see docs/reranking.md. (Logged once per reranker.)"
    )


def max_passage_chars(max_length: int) -> int:
    """Characters of a passage worth tokenizing when the model reads ``max_length`` tokens."""
    return max_length * MAX_CHARS_PER_TOKEN


def passage_text(node: BaseNode, prefix_section: bool = True, max_chars: Optional[int] = None) -> str:
    """The text the cross-encoder reads for ``node``.

    The node's own text (no metadata), after its section path (``metadata["section_header"]``,
    e.g. ``"3. Fees > 3.2 Late payment"``) and a newline when ``prefix_section`` and the node has
    one; cut to ``max_chars`` characters so a long passage is not tokenized beyond what the model
    reads.
    """
    text = node.get_content(metadata_mode=MetadataMode.NONE)
    header = node.metadata.get(SECTION_HEADER_KEY) if prefix_section else None
    if isinstance(header, str) and header.strip():
        text = f"{header.strip()}\n{text}"
    return text if max_chars is None else text[:max_chars]


def check_device(value: Any) -> str:
    """``value`` if it names a device this reranker can use; else a ValueError listing them."""
    if not isinstance(value, str) or not _DEVICE_PATTERN.match(value):
        raise ValueError(f"device {value!r} is not supported; allowed: {', '.join(DEVICE_CHOICES)}")
    return value


def fp16_supported(device: str) -> bool:
    """Whether half precision runs natively on ``device`` (CUDA and Apple MPS; not CPU)."""
    return device.startswith("cuda") or device == "mps"


def large_model_warning(model: str, n_parameters: int, device: str) -> Optional[str]:
    """The warning for a model of more than :data:`LARGE_MODEL_PARAMETERS` on CPU, else None."""
    if device != "cpu" or n_parameters <= LARGE_MODEL_PARAMETERS:
        return None
    return (
        f"reranker {model!r} has {n_parameters / 1e6:.0f}M parameters and runs on CPU: expect seconds per "
        f"query (bge-reranker-large: ~8 s for 40 candidates of 256 tokens on 16 cores, ~34 s on 2). On CPU use "
        f"a small cross-encoder ({CPU_RECOMMENDED_MODEL!r}, or bge-reranker-base with backend="
        "'sentence_transformers', onnx=True), max_candidates=20 to 40 and latency_budget_ms; or run on a GPU. "
        "See docs/reranking.md."
    )


def max_input_tokens(config: Any) -> Optional[int]:
    """Tokens the model's position embeddings cover (RoBERTa-type models reserve pad_token_id + 1)."""
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int):
        return None
    if "roberta" in str(getattr(config, "model_type", "")) or getattr(config, "position_embedding_type", None) == "roberta":
        positions -= int(getattr(config, "pad_token_id", 1) or 0) + 1
    return positions


def resolve_device(device: str) -> str:
    """``"auto"``: ``"cuda"`` when a CUDA GPU is visible, else ``"mps"`` when present, else ``"cpu"``."""
    if device != "auto":
        return device
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def reranked_results(
    candidates: Sequence[NodeWithScore],
    logits: Sequence[float],
    top_n: int,
    input_ranks: Optional[Sequence[int]] = None,
) -> List[RerankedNodeWithScore]:
    """New results for the first ``len(logits)`` candidates, best probability first, cut to ``top_n``.

    Ties (equal logits) keep the input order. The new objects point at the same node objects.
    ``input_ranks``: each candidate's position (1 = first) in the caller's list, when ``candidates``
    is not that list itself (e.g. after dropping repeated node ids); default ``i + 1``.
    """
    if input_ranks is not None and len(input_ranks) < len(logits):
        raise ValueError(f"input_ranks has {len(input_ranks)} entries for {len(logits)} scored candidates")
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))[:top_n]
    results = []
    for i in order:
        candidate = candidates[i]
        results.append(
            RerankedNodeWithScore(
                node=candidate.node,
                score=sigmoid(float(logits[i])),
                rerank_logit=float(logits[i]),
                pre_rerank_score=candidate.score,
                pre_rerank_rank=i + 1 if input_ranks is None else int(input_ranks[i]),
                leg_ranks=dict(getattr(candidate, "leg_ranks", None) or {}),
                leg_scores=dict(getattr(candidate, "leg_scores", None) or {}),
            )
        )
    return results


# ------------------------------------------------------------------------------ backends
class _PairTokenCounter:
    """Tokens of whole (query, passage) pairs, special tokens included, never truncated.

    Uses its own copy of the model's tokenizer: a Hugging Face fast tokenizer keeps its truncation
    setting in shared state, which the backends set for scoring and this counter must not change.
    """

    def __init__(self, tokenizer: Any) -> None:
        import copy

        self._tokenizer = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()

    def lengths(self, pairs: Sequence[Tuple[str, str]]) -> List[int]:
        if not pairs:
            return []
        with self._lock:
            encoded = self._tokenizer(
                [q for q, _ in pairs],
                [p for _, p in pairs],
                truncation=False,
                padding=False,
                add_special_tokens=True,
                return_attention_mask=False,
                return_token_type_ids=False,
                verbose=False,
            )
        return [len(ids) for ids in encoded["input_ids"]]


class _SentenceTransformersScorer:
    """``sentence_transformers.CrossEncoder`` logits, in PyTorch or (``onnx``) ONNX Runtime.

    No lock: ``CrossEncoder`` tokenizes with the same settings on every call, so the tokenizer's
    shared truncation state is set once and only read afterwards; the PyTorch and ONNX Runtime
    forward passes are thread-safe.
    """

    def __init__(self, settings: "CrossEncoderReranker", device: str, fp16: bool) -> None:
        import torch
        from sentence_transformers import CrossEncoder

        self._torch = torch
        self.batch_size = settings.batch_size
        self.device = device
        self.cross_encoder = CrossEncoder(
            settings.model,
            device=device,
            max_length=settings.max_length,
            trust_remote_code=settings.trust_remote_code,
        )
        if fp16:
            self.cross_encoder.half()
        self.hf_model = self.cross_encoder.model
        self.n_parameters = sum(p.numel() for p in self.hf_model.parameters())
        self.token_counter = _PairTokenCounter(self.cross_encoder.tokenizer)
        self.engine = "torch-fp16" if fp16 else "torch"
        self._session: Any = None
        self._input_names: List[str] = []
        if settings.onnx:
            reason = None
            try:
                reason = self._prepare_onnx(settings)
            except Exception as exc:  # an optional speed-up: never fail reranking for it
                reason = f"{type(exc).__name__}: {exc}"
            if reason:
                logger.warning("reranker %s runs on PyTorch, not ONNX Runtime: %s", settings.model, reason)
                self._session = None
            else:
                self.engine = "onnx"

    def logits(self, pairs: List[Tuple[str, str]]) -> List[float]:
        if self._session is not None:
            return self._onnx_logits(pairs)
        scores = self.cross_encoder.predict(
            pairs,
            batch_size=self.batch_size,
            activation_fn=self._torch.nn.Identity(),
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return [float(s) for s in np.atleast_1d(scores)]

    # -- ONNX Runtime path
    def _features(self, pairs: Sequence[Tuple[str, str]]) -> Dict[str, np.ndarray]:
        features = self.cross_encoder.preprocess(list(pairs))
        return {name: features[name].cpu().numpy() for name in self._input_names}

    def _onnx_logits(self, pairs: List[Tuple[str, str]]) -> List[float]:
        # Longest first, as CrossEncoder.predict does, so a batch pads to similar lengths.
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        out = np.empty(len(pairs), dtype=np.float64)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            logits = self._session.run(None, self._features([pairs[i] for i in batch]))[0]
            out[batch] = np.asarray(logits, dtype=np.float64).reshape(len(batch), -1)[:, 0]
        return out.tolist()

    def _prepare_onnx(self, settings: "CrossEncoderReranker") -> Optional[str]:
        """Export (once, cached by a hash of the weights), load and check; returns why not, or None."""
        if self.device != "cpu":
            return f"onnx=True runs on CPU only (device is {self.device!r})"
        weight_bytes = sum(p.numel() * p.element_size() for p in self.hf_model.parameters())
        if weight_bytes > ONNX_MAX_WEIGHT_BYTES:
            return f"its weights ({weight_bytes / 1e9:.1f} GB) exceed ONNX's 2 GB single-file limit"
        from .._extras import missing_extra_error
        from ..embeddings.onnx_query import weights_fingerprint
        from ..embeddings.onnx_runtime import (
            DEFAULT_ONNX_SPIN_US,
            ONNX_MODULES,
            default_cache_dir,
            import_onnxruntime,
            onnx_session_options,
        )

        missing = missing_extra_error("onnx=True", {"onnx": ONNX_MODULES})
        if missing is not None:
            return str(missing)
        ort = import_onnxruntime()
        import inspect

        torch = self._torch
        sample = self.cross_encoder.preprocess(list(_ONNX_PROBES))
        accepted = set(inspect.signature(self.hf_model.forward).parameters)
        self._input_names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in sample and n in accepted]
        # The export depends on the weights and on what the graph is built from: the architecture
        # settings (config.json: heads, activation, ...) and the weights' dtype.
        config_json = self.hf_model.config.to_json_string(use_diff=False)
        dtype = str(next(self.hf_model.parameters()).dtype)
        key = weights_fingerprint(
            self.hf_model,
            extra=(
                f"cross-encoder|{type(self.hf_model).__name__}|{torch.__version__}|{ort.__version__}|{self._input_names}|"
                f"{hashlib.sha256(config_json.encode('utf-8')).hexdigest()}|{dtype}|v2"
            ),
        )
        cache = Path(settings.onnx_cache_dir) if settings.onnx_cache_dir else default_cache_dir()
        path = cache / "onnx" / key / "model.onnx"
        expected = self.cross_encoder.predict(
            list(_ONNX_PROBES), activation_fn=torch.nn.Identity(), convert_to_numpy=True, show_progress_bar=False
        )
        # The query path's session settings: short spinning, so a busy neighbour process cannot
        # stretch a rerank by sharing a core with spinning worker threads (busy_neighbour.py).
        options = onnx_session_options(ort, threads=0, spin_us=DEFAULT_ONNX_SPIN_US)
        problem = ""
        for attempt in ("cached", "exported"):
            if attempt == "exported" or not path.exists():
                if attempt == "exported":
                    logger.warning("re-exporting reranker %s to ONNX: the cached export %s %s", settings.model, path, problem)
                    path.unlink(missing_ok=True)
                else:
                    logger.info("exporting reranker %s to ONNX at %s (once)", settings.model, path)
                export_sequence_classifier(self.hf_model, self._input_names, sample, path)
                attempt = "exported"
            try:
                self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            except Exception as exc:  # a damaged file (e.g. INVALID_PROTOBUF)
                problem = f"cannot be loaded ({type(exc).__name__}: {str(exc)[:200]})"
                self._session = None
                if attempt == "exported":
                    return f"the ONNX export {problem}"
                continue
            got = np.asarray(self._onnx_logits(list(_ONNX_PROBES)))
            worst = float(np.abs(got - np.asarray(expected, dtype=np.float64)).max())
            if worst <= settings.onnx_tolerance:
                logger.debug("ONNX reranker ready for %s (max |logit diff| %.1e)", settings.model, worst)
                return None
            problem = f"differs from PyTorch by {worst:.2e} > onnx_tolerance={settings.onnx_tolerance}"
            self._session = None
            if attempt == "exported":
                break
        return f"ONNX logits differ from PyTorch: the export {problem}"


def export_sequence_classifier(hf_model: Any, input_names: List[str], sample: Dict[str, Any], path: Path) -> None:
    """Export a Hugging Face sequence classifier (inputs -> ``logits``) to ONNX at ``path`` atomically.

    BERT- and RoBERTa-type models are exported with eager attention and passed through ONNX
    Runtime's transformer optimizer, as the query embedding path does
    (:func:`~llama_index_retrieval_kit.embeddings.onnx_query.export_model_output`).
    """
    from ..embeddings.onnx_query import export_model_output

    export_model_output(hf_model, input_names, sample, path, "logits", {0: "batch"}, ("bert", "roberta", "xlm-roberta"))


class _FlagEmbeddingScorer:
    """``FlagEmbedding.FlagReranker`` logits (``normalize=False``), one call at a time.

    ``compute_score`` (FlagEmbedding 1.4.2, ``encoder_only/base.py``) tokenizes the queries and the
    passages with different ``max_length`` / truncation settings, which a fast tokenizer keeps in
    shared state; two calls at once mix them up (wrong logits, or "Truncation error: Second sequence
    not provided"), so calls hold a lock.
    """

    def __init__(self, settings: "CrossEncoderReranker", device: str, fp16: bool) -> None:
        from .._extras import require_extra

        require_extra("rerank", "FlagEmbedding", _FLAG_FEATURE, _FLAG_ALTERNATIVE)
        try:
            from FlagEmbedding import FlagReranker
        except ImportError as exc:  # installed but broken (e.g. a transformers it does not support)
            raise ImportError(
                f"the 'flag_embedding' rerank backend could not import FlagEmbedding ({exc}); reinstall it with "
                f"{INSTALL_HINT}, or {_FLAG_ALTERNATIVE}"
            ) from exc
        self.batch_size = settings.batch_size
        self.max_length = settings.max_length
        self.device = device
        self.reranker = FlagReranker(
            settings.model,
            use_fp16=fp16,
            devices=[device],
            batch_size=settings.batch_size,
            max_length=settings.max_length,
            trust_remote_code=settings.trust_remote_code,
            normalize=False,
        )
        self.hf_model = self.reranker.model
        self.n_parameters = sum(p.numel() for p in self.hf_model.parameters())
        self.token_counter = _PairTokenCounter(self.reranker.tokenizer)
        self.engine = "flag-fp16" if fp16 else "flag"
        self._lock = threading.Lock()

    def logits(self, pairs: List[Tuple[str, str]]) -> List[float]:
        with self._lock:
            scores = self.reranker.compute_score(
                [list(p) for p in pairs], batch_size=self.batch_size, max_length=self.max_length, normalize=False
            )
        if isinstance(scores, (int, float)):
            scores = [scores]
        return [float(s) for s in scores]


_MODEL_FIELDS = frozenset(
    {"model", "backend", "batch_size", "max_length", "device", "use_fp16", "onnx", "onnx_cache_dir", "onnx_tolerance", "trust_remote_code"}
)


# ------------------------------------------------------------------------------ the postprocessor
class CrossEncoderReranker(TransientState, StrictOptions, BaseNodePostprocessor):
    """Rerank retrieved nodes with a cross-encoder; ``score`` becomes its sigmoid probability.

    Each candidate ``(query, passage)`` pair gets the model's logit ``z``; results carry
    ``score = sigmoid(z) = 1 / (1 + e^-z)`` in (0, 1) (the probability of relevance of models
    trained with binary cross-entropy, such as bge-reranker), are ordered by it (ties keep the
    input order) and cut to ``top_n``. They are new :class:`RerankedNodeWithScore` objects with
    ``pre_rerank_score`` / ``pre_rerank_rank`` (and a fused input's ``leg_scores`` /
    ``leg_ranks``); the input objects and nodes are not changed.

    A result whose ``node_id`` repeats an earlier one is dropped first (the first occurrence is
    kept, with its input rank). Candidates after ``max_candidates`` are not scored and not
    returned; ``latency_budget_ms`` scores fewer when the running call cost estimate says they
    would not fit (never fewer than ``top_n``). Pairs longer than ``max_length`` tokens are counted
    (``last_stats.truncated``) and logged once. One object may serve concurrent queries. The
    model loads on first use (or :meth:`load`) and is not part of ``to_dict()``.
    Emits LlamaIndex's ``ReRankStartEvent`` / ``ReRankEndEvent`` inside the postprocessor's span.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=True)

    model: str = Field(
        default=DEFAULT_RERANK_MODEL,
        description="Cross-encoder: a local model folder or a Hugging Face hub name (downloaded by the backend).",
    )
    backend: RerankBackend = Field(
        default=RerankBackend.FLAG_EMBEDDING,
        description="'flag_embedding' (FlagEmbedding's FlagReranker, the [rerank] extra) or 'sentence_transformers' "
        "(sentence-transformers' CrossEncoder).",
    )
    top_n: int = Field(default=5, description="Number of results returned, best first.")
    max_candidates: Optional[int] = Field(
        default=50,
        description="Score only the first this many candidates (in input order, after dropping repeated node ids); "
        "None scores all. The rest are dropped.",
    )
    latency_budget_ms: Optional[float] = Field(
        default=None,
        description="Time for scoring one query; candidates are capped to what fits, from a running estimate of a "
        "model call's cost (fixed + per pair; the first call measures it on the first top_n pairs). Never fewer than "
        "top_n are scored. None: no cap.",
    )
    batch_size: int = Field(default=32, description="Pairs per forward pass.")
    max_length: int = Field(
        default=512,
        description="Tokens the model reads per (query, passage) pair; longer passages are truncated "
        "(and cut to max_length * 16 characters before tokenizing), counted in last_stats.truncated and logged once.",
    )
    device: str = Field(
        default="auto", description=f"Where the model runs: one of {', '.join(DEVICE_CHOICES)} (auto: GPU when present)."
    )
    use_fp16: Optional[bool] = Field(
        default=None,
        description="Half precision: None = on where the device supports it (CUDA, MPS), True on CPU falls back to "
        "fp32 with a warning.",
    )
    section_prefix: bool = Field(
        default=True,
        description="Prepend the chunk's section path (metadata['section_header']) and a newline to the passage.",
    )
    onnx: bool = Field(
        default=False,
        description="sentence_transformers backend on CPU: run the model in ONNX Runtime (exported once, cached, "
        "checked against PyTorch; needs the 'onnx' extra; falls back to PyTorch with a warning).",
    )
    onnx_cache_dir: Optional[str] = Field(
        default=None, description="Folder for exported ONNX models (default $RKIT_CACHE_DIR or ~/.cache/llama_index_retrieval_kit)."
    )
    onnx_tolerance: float = Field(default=1e-3, description="Largest |logit difference| from PyTorch for ONNX to be used.")
    trust_remote_code: bool = Field(default=False, description="Let the model folder run its own code (custom architectures).")

    __transient_private__ = ("_load_lock", "_stats")
    __reloaded_private__ = ("_scorer",)  # a loaded model: read only, guarded by its own lock

    _scorer: Any = PrivateAttr(default=None)
    _load_lock: Any = PrivateAttr(default_factory=threading.Lock)
    _cost: Optional[CallCostEstimate] = PrivateAttr(default=None)
    _fixed_prior_ms: float = PrivateAttr(default=0.0)
    _model_limit: Optional[int] = PrivateAttr(default=None)
    _stats: LastValue = PrivateAttr(default_factory=lambda: LastValue("CrossEncoderReranker.last_stats"))
    _budget_warned: bool = PrivateAttr(default=False)
    _truncation_warned: bool = PrivateAttr(default=False)

    @classmethod
    def class_name(cls) -> str:
        return "CrossEncoderReranker"

    # -- argument checks (errors name the value and what is allowed)
    @field_validator("model", mode="before")
    @classmethod
    def _check_model(cls, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"model must be a local model folder or a hub name such as {DEFAULT_RERANK_MODEL!r}, got {value!r}")
        looks_like_path = value.startswith((".", "~", os.sep)) or (os.altsep is not None and os.altsep in value)
        if looks_like_path and not Path(value).expanduser().is_dir():
            raise ValueError(f"model folder {value!r} does not exist; pass a model folder or a hub name such as {DEFAULT_RERANK_MODEL!r}")
        return str(Path(value).expanduser()) if looks_like_path else value

    @field_validator("backend", mode="before")
    @classmethod
    def _check_backend(cls, value: Any) -> RerankBackend:
        return RerankBackend.from_str(value)

    @field_serializer("backend")
    def _backend_name(self, backend: RerankBackend) -> str:
        return backend.value  # to_dict() stays plain JSON; from_dict accepts the name

    @field_validator("top_n", "batch_size", mode="before")
    @classmethod
    def _check_count(cls, value: Any, info: Any) -> int:
        return check_positive_int(info.field_name, value)

    @field_validator("max_candidates", mode="before")
    @classmethod
    def _check_max_candidates(cls, value: Any) -> Optional[int]:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"max_candidates must be None (score all) or an int >= 1, got {value!r} ({type(value).__name__})")
        return value

    @field_validator("max_length", mode="before")
    @classmethod
    def _check_max_length(cls, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 8:
            raise ValueError(f"max_length must be an int >= 8 (tokens per pair), got {value!r} ({type(value).__name__})")
        return value

    @field_validator("latency_budget_ms", mode="before")
    @classmethod
    def _check_budget(cls, value: Any) -> Optional[float]:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"latency_budget_ms must be None (no budget) or a finite number > 0, got {value!r}")
        return float(value)

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: Any) -> str:
        return check_device(value)

    @field_validator("onnx_tolerance", mode="before")
    @classmethod
    def _check_tolerance(cls, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"onnx_tolerance must be a finite number > 0, got {value!r}")
        return float(value)

    @model_validator(mode="after")
    def _check_combination(self) -> "CrossEncoderReranker":
        if self.onnx and self.backend is not RerankBackend.SENTENCE_TRANSFORMERS:
            raise ValueError(
                f"onnx=True needs backend='sentence_transformers', got backend={self.backend.value!r}; "
                "allowed: onnx=False with any backend"
            )
        if self.backend is RerankBackend.FLAG_EMBEDDING:
            from .._extras import require_extra

            require_extra("rerank", "FlagEmbedding", _FLAG_FEATURE, _FLAG_ALTERNATIVE)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in _MODEL_FIELDS and getattr(self, "__pydantic_private__", None) is not None:
            self._scorer = None  # a model setting changed: load again on next use
            self._cost = None
            self._truncation_warned = False

    # -- model
    def load(self) -> "CrossEncoderReranker":
        """Load the model now (otherwise it loads on first use); returns ``self``."""
        self._ensure_scorer()
        return self

    @property
    def is_loaded(self) -> bool:
        return self._scorer is not None

    @property
    def resolved_device(self) -> Optional[str]:
        """The device the loaded model runs on (None before loading)."""
        return None if self._scorer is None else self._scorer.device

    @property
    def engine(self) -> Optional[str]:
        """What runs the model: 'flag', 'torch', 'onnx' (+ '-fp16'); None before loading."""
        return None if self._scorer is None else self._scorer.engine

    @property
    def per_pair_ms(self) -> Optional[float]:
        """Running estimate of the cost of one more pair in a model call (None before the first scoring)."""
        return None if self._cost is None else self._cost.per_pair_ms

    @property
    def fixed_call_ms(self) -> Optional[float]:
        """Running estimate of a model call's cost besides its pairs (None before the first scoring)."""
        return None if self._cost is None else self._cost.fixed_ms

    @property
    def last_stats(self) -> Optional[RerankStats]:
        """What the last call did (candidates, scored, time; None before the first).

        Concurrency: the last call made in the reader's own thread or asyncio task (``query`` in a
        thread pool, ``asyncio.gather`` of ``aquery``), else - the reader made none - the last call
        of this reranker from anywhere. A traced query records its own call's stats."""
        return self._stats.get()

    def _ensure_scorer(self) -> Any:
        scorer = self._scorer
        if scorer is not None:
            return scorer
        with self._load_lock:
            if self._scorer is None:
                self._scorer = self._load_scorer()
            return self._scorer

    def _load_scorer(self) -> Any:
        from transformers import AutoConfig

        device = resolve_device(self.device)
        config = AutoConfig.from_pretrained(self.model, trust_remote_code=self.trust_remote_code)
        limit = max_input_tokens(config)
        if limit is not None and self.max_length > limit:
            raise ValueError(f"max_length={self.max_length} is more than {self.model!r} reads; allowed: 8 to {limit} tokens")
        self._model_limit = limit
        if getattr(config, "num_labels", 1) != 1:
            raise ValueError(
                f"{self.model!r} has num_labels={config.num_labels}; a reranker needs a one-logit cross-encoder (num_labels=1)"
            )
        fp16 = fp16_supported(device) if self.use_fp16 is None else self.use_fp16
        if fp16 and not fp16_supported(device):
            logger.warning("use_fp16=True is ignored on %s (no native half precision there): running fp32", device)
            fp16 = False
        started = time.perf_counter()
        if self.backend is RerankBackend.FLAG_EMBEDDING:
            scorer: Any = _FlagEmbeddingScorer(self, device, fp16)
        else:
            scorer = _SentenceTransformersScorer(self, device, fp16)
        self._fixed_prior_ms = self._warm_up(scorer)
        logger.info(
            "reranker %s loaded in %.1f s (%s, %s, %.0fM parameters)",
            self.model, time.perf_counter() - started, device, scorer.engine, scorer.n_parameters / 1e6,
        )
        message = large_model_warning(self.model, scorer.n_parameters, device)
        if message:
            logger.warning(message)
        return scorer

    def _warm_up(self, scorer: Any) -> float:
        """Two forward passes on a tiny pair: the first pays one-off start-up costs (not measured),
        the second's time is the fixed cost of a call the estimate starts from."""
        scorer.logits(list(_WARM_UP_PAIRS))
        started = time.perf_counter()
        scorer.logits(list(_WARM_UP_PAIRS))
        return (time.perf_counter() - started) * 1000

    # -- reranking
    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        results, stats = self._rerank_traced(nodes, query_bundle)
        self._stats.set(stats)
        return results

    async def _apostprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        """As LlamaIndex does (the work in a thread), with the stats kept for the awaiting task."""
        results, stats = await asyncio.to_thread(self._rerank_traced, nodes, query_bundle)
        self._stats.set(stats)
        return results

    def _rerank_traced(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle]
    ) -> Tuple[List[NodeWithScore], RerankStats]:
        """Check the input, rerank with LlamaIndex's rerank events, and trace when tracing is on."""
        if query_bundle is None:
            raise ValueError("CrossEncoderReranker needs the query: pass query_bundle or query_str")
        query = check_query_text(query_bundle.query_str, "QueryBundle.query_str")
        if not query.strip():
            raise ValueError(
                f"CrossEncoderReranker scores (query, passage) pairs, and the query text is blank ({query!r}); "
                "pass the question as query_str (a query embedding alone cannot be reranked)"
            )
        for i, result in enumerate(nodes):
            if not isinstance(result, NodeWithScore):
                raise ValueError(f"nodes[{i}] is {type(result).__name__}; expected NodeWithScore objects")
        traced = tracing_enabled()
        started = time.perf_counter()
        dispatcher.event(ReRankStartEvent(query=query_bundle, nodes=nodes, top_n=self.top_n, model_name=self.model))
        with self.callback_manager.event(
            CBEventType.RERANKING,
            payload={
                EventPayload.NODES: nodes,
                EventPayload.MODEL_NAME: self.model,
                EventPayload.QUERY_STR: query,
                EventPayload.TOP_K: self.top_n,
            },
        ) as event:
            reranked, stats = self._rerank(query, list(nodes))
            results: List[NodeWithScore] = list(reranked)
            event.on_end(payload={EventPayload.NODES: results})
        dispatcher.event(ReRankEndEvent(nodes=results))
        if traced:
            trace_rerank(self, query_bundle, nodes, results, started, stats=stats)
        return results, stats

    def _rerank(self, query: str, nodes: List[NodeWithScore]) -> Tuple[List[RerankedNodeWithScore], RerankStats]:
        """The reranked results and what this call did."""
        if not nodes:
            return [], RerankStats(0, 0, 0, 0, 0.0, self.per_pair_ms, self.latency_budget_ms, fixed_call_ms=self.fixed_call_ms)
        scorer = self._ensure_scorer()
        distinct = first_occurrences(nodes)
        duplicates = len(nodes) - len(distinct)
        positions = distinct if self.max_candidates is None else distinct[: self.max_candidates]
        pool = [nodes[i] for i in positions]
        max_chars = max_passage_chars(self.max_length)
        texts = [passage_text(n.node, self.section_prefix) for n in pool]
        pairs = [(query, text[:max_chars]) for text in texts]
        logits, scoring_ms = self._score_within_budget(scorer, pairs)
        scored = len(logits)
        truncated = count_truncated(
            scorer.token_counter.lengths(pairs[:scored]), self.max_length, [len(t) > max_chars for t in texts[:scored]]
        )
        results = reranked_results(pool, logits, self.top_n, input_ranks=[i + 1 for i in positions])
        stats = RerankStats(
            candidates=len(nodes),
            capped_to=len(pool),
            scored=scored,
            returned=len(results),
            scoring_ms=scoring_ms,
            per_pair_ms=self.per_pair_ms,
            latency_budget_ms=self.latency_budget_ms,
            duplicates_dropped=duplicates,
            truncated=truncated,
            fixed_call_ms=self.fixed_call_ms,
        )
        if duplicates:
            logger.debug("dropped %d results whose node_id repeated an earlier one", duplicates)
        if scored < len(pool):
            logger.debug("latency budget %.0f ms: scored %d of %d candidates", self.latency_budget_ms, scored, len(pool))
        if truncated and not self._truncation_warned:
            self._truncation_warned = True
            logger.warning(truncation_warning(self.model, truncated, scored, self.max_length, self._model_limit))
        return results, stats

    def _score_within_budget(self, scorer: Any, pairs: List[Tuple[str, str]]) -> Tuple[List[float], float]:
        """Logits of the first pairs that fit the latency budget (all pairs without one), and the time taken."""
        logits: List[float] = []
        started = time.perf_counter()

        def score(chunk: List[Tuple[str, str]]) -> CallCostEstimate:
            chunk_start = time.perf_counter()
            out = scorer.logits(chunk)
            if len(out) != len(chunk):
                raise RuntimeError(f"the {self.backend.value} backend returned {len(out)} scores for {len(chunk)} pairs")
            elapsed_ms = (time.perf_counter() - chunk_start) * 1000
            # One new object replaces the old: a concurrent call may drop a measurement, never mix two.
            self._cost = cost = update_call_cost(self._cost, len(chunk), elapsed_ms, fixed_prior_ms=self._fixed_prior_ms)
            logits.extend(out)
            return cost

        budget = self.latency_budget_ms
        if budget is None:
            score(pairs)
            return logits, (time.perf_counter() - started) * 1000
        floor = min(self.top_n, len(pairs))
        cost = self._cost
        if cost is None:  # no estimate yet: measure on the pairs that are scored anyway
            cost = score(pairs[:floor])
        spent = (time.perf_counter() - started) * 1000
        if not self._budget_warned and cost.call_ms(floor) > budget:
            self._budget_warned = True
            logger.warning(
                "latency_budget_ms=%.0f is below the cost of top_n=%d pairs (~%.0f ms with %s): scoring %d anyway",
                budget, self.top_n, cost.call_ms(floor), self.model, floor,
            )
        more = cap_candidates(
            len(pairs) - len(logits), cost.per_pair_ms, budget - spent, minimum=max(0, floor - len(logits)), fixed_ms=cost.fixed_ms
        )
        if more:
            score(pairs[len(logits) : len(logits) + more])
        return logits, (time.perf_counter() - started) * 1000
