"""ONNX Runtime helpers that import neither PyTorch nor sentence-transformers.

Privacy: ONNX Runtime's telemetry is turned off before this module first imports it (see
:func:`import_onnxruntime` and ``onnx_query``'s module doc).

One owner for what both ONNX paths share (the query embedder of ``onnx_query`` and the torch-free
query path of ``query_export``): the cache folder, importing ONNX Runtime with its telemetry off,
sentence-transformers' pooling in numpy, and the session options of a one-query-at-a-time run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

CACHE_ENV = "RKIT_CACHE_DIR"
#: What the ONNX paths (query embedder, ``CrossEncoderReranker(onnx=True)``) import: the ``onnx`` extra.
ONNX_MODULES = ("onnxruntime", "onnx")
#: Read by ONNX Runtime when it is imported: "1" keeps it from writing telemetry files ("0" lets it).
ORT_TELEMETRY_ENV = "ORT_DISABLE_TELEMETRY"


def default_cache_dir() -> Path:
    """Where exported ONNX models live: ``$RKIT_CACHE_DIR`` or ``~/.cache/llama_index_retrieval_kit``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "llama_index_retrieval_kit"


def import_onnxruntime() -> Any:
    """``onnxruntime``, imported with its telemetry off (see the module doc); ImportError if absent."""
    if "onnxruntime" not in sys.modules:
        os.environ.setdefault(ORT_TELEMETRY_ENV, "1")
    import onnxruntime

    onnxruntime.disable_telemetry_events()
    return onnxruntime


def pool(hidden: np.ndarray, attention_mask: np.ndarray, mode: str) -> np.ndarray:
    """Sentence-transformers pooling of token states ``(batch, tokens, dim)`` -> ``(batch, dim)``."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "mean":
        mask = attention_mask[..., None].astype(hidden.dtype)
        return (hidden * mask).sum(axis=1) / np.clip(mask.sum(axis=1), 1e-9, None)
    raise ValueError(f"pooling mode {mode!r} has no ONNX path; supported: 'mean', 'cls'")


#: How long (µs) an idle ONNX Runtime worker thread spins for the next operator of a query before
#: it sleeps. Measured on two cores (benchmarks/busy_neighbour.py): 5-10 µs is as fast on an idle
#: machine as ONNX Runtime's own spin count (within 3%); with another process keeping one core
#: busy, that spin count (and 20 µs or more) made some rounds of queries 2-4x slower, 10 µs rarely.
DEFAULT_ONNX_SPIN_US = 10


def onnx_session_options(ort: Any, threads: int, spin_us: Optional[int]) -> Any:
    """ONNX Runtime ``SessionOptions`` of the query path: all graph optimisations, ``threads``
    intra-op threads (0: one per physical core, pinned by ONNX Runtime), inter-op threads never spin.

    Intra-op worker threads between the operators of one run: ``spin_us=None`` spins ONNX
    Runtime's own number of times, ``0`` sleeps at once (``session.intra_op.allow_spinning=0``),
    ``n > 0`` spins at most ``n`` µs, then sleeps (``session.intra_op.spin_duration_us``; an ONNX
    Runtime too old to know that key ignores it and spins its own number of times). Spinning
    saves waking a sleeping thread for each of the graph's ~40 parallel operators (about 1 ms per
    query here), but a thread that spins long counts as busy to the OS scheduler, which then
    makes it share a core with a busy neighbour process in whole time slices. In every case the
    threads stop spinning when the run returns (``session.force_spinning_stop``), so they never
    take the cores from what runs next.
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0" if spin_us == 0 else "1")
    if spin_us:
        options.add_session_config_entry("session.intra_op.spin_duration_us", str(int(spin_us)))
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options
