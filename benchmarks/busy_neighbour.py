"""Query latency with one core kept busy by another process (issue 11, section 3: p50 under load <= 2x idle).

    python benchmarks/busy_neighbour.py                              # SciFact test queries (300), python neighbour
    python benchmarks/busy_neighbour.py --neighbour both             # also a numpy/BLAS neighbour
    python benchmarks/busy_neighbour.py --queries 20                 # quick run
    python benchmarks/busy_neighbour.py --no-hybrid --configs threads1,nospin   # embedding rows only
    python benchmarks/busy_neighbour.py --dataset ../shared/datasets/beir/nfcorpus --json PATH

A web server rarely has the machine to itself: here one core of the two is kept busy by a
neighbour process (a child started with ``subprocess`` right before each loaded phase and killed
right after it): ``python`` spins a pure-Python loop, ``numpy`` multiplies 256x256 matrices on one
BLAS thread. Its CPU share during the phase is printed, so one can check it really took a core.

Rows, all in one process and one run, each timed one query at a time on the same queries:

* query embedding alone (``get_query_embedding``) of the package's ``FastHuggingFaceEmbedding``
  in several ONNX Runtime session configurations (``--configs`` picks some): the package default
  (``onnx_threads=0``: one pinned thread per physical core; ``onnx_spin_us=10``: worker threads
  spin at most 10 µs for the next operator, then sleep), ``onnx_spin_us=None`` (ONNX Runtime's
  own spin count, the default before), ``onnx_spin_us=50``, ``onnx_spin_us=0`` (never spin),
  ``onnx_threads=1`` (no worker thread) and ``onnx_threads=2`` (the default's count on two cores,
  without ONNX Runtime's thread pinning);
* LlamaIndex's own ``HuggingFaceEmbedding`` (PyTorch, its defaults): the reference alternative;
* ``HybridIndex.as_retriever("hybrid")`` (defaults) end to end with a text query (the index's
  embedding model, the package default, embeds it), the same retriever with the embedding given
  (retrieval alone), and, per ONNX configuration, that configuration's embedding plus the same
  retrieval (one index folder opens in one object at a time, so the other configurations embed
  the query and hand the retriever a ``QueryBundle`` with the embedding: the same work as the
  text path).

Phases alternate in rounds of ``--round-size`` queries: idle, then loaded by each neighbour, so
drift of the machine affects both. Within a phase every row answers the round's queries back to
back (rotating the order of rows per round) after one untimed call. The table gives p50/p95 idle
and loaded, the ratio of the p50s, whether it meets the bar (ratio <= 2) and in how many rounds
the loaded p50 exceeded twice that round's idle p50 (a neighbour that shares a core with a pinned
worker thread slows some rounds down and not others). Measure on an otherwise idle machine
(``uptime`` before and after): these are latencies.

The index (default chunking, ``HybridIndex.from_documents`` defaults) is built once under
``benchmarks/.cache/busy_neighbour_<dataset>_index`` with vectors from the benchmark cache.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402  (sets HF_HUB_OFFLINE, one BLAS thread, sys.path)
import numpy as np  # noqa: E402

logger = logging.getLogger("benchmarks.busy_neighbour")

BAR = 2.0  # issue 11: loaded p50 at most 2x idle p50

#: The neighbours: one single-threaded process each, printing "ready" once it spins.
NEIGHBOURS: Dict[str, str] = {
    "python": "print('ready', flush=True)\nx = 0\nwhile True:\n    x += 1\n",
    "numpy": (
        "import numpy as np\na = np.random.rand(256, 256)\nb = np.random.rand(256, 256)\n"
        "print('ready', flush=True)\nwhile True:\n    a @ b\n"
    ),
}

#: ONNX Runtime session configurations of FastHuggingFaceEmbedding compared: key -> (label, kwargs).
ONNX_CONFIGS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "default": ("default", {}),
    "ort-spin": ("onnx_spin_us=None (ONNX Runtime's spin count)", {"onnx_spin_us": None}),
    "spin50": ("onnx_spin_us=50", {"onnx_spin_us": 50}),
    "nospin": ("onnx_spin_us=0 (never spin)", {"onnx_spin_us": 0}),
    "threads1": ("onnx_threads=1", {"onnx_threads": 1}),
    "threads2": ("onnx_threads=2 (not pinned)", {"onnx_threads": 2}),
}


class Neighbour:
    """A child process keeping one core busy while the ``with`` block runs."""

    def __init__(self, kind: str) -> None:
        if kind not in NEIGHBOURS:
            raise ValueError(f"neighbour {kind!r} is unknown; allowed: {sorted(NEIGHBOURS)}")
        self.kind = kind
        self.cpu_share = float("nan")  # CPU seconds of the child / wall seconds of the block
        self._proc: Optional[subprocess.Popen] = None
        self._started = 0.0

    def __enter__(self) -> "Neighbour":
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self._proc = subprocess.Popen([sys.executable, "-c", NEIGHBOURS[self.kind]], stdout=subprocess.PIPE, env=env)
        line = self._proc.stdout.readline() if self._proc.stdout else b""
        if line.strip() != b"ready":
            self._proc.kill()
            raise RuntimeError(f"the {self.kind} neighbour did not start (said {line!r})")
        time.sleep(0.2)  # let the scheduler settle it on a core
        self._started = time.perf_counter()
        self._cpu0 = _child_cpu_seconds(self._proc.pid)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._proc is None:
            return
        wall = time.perf_counter() - self._started
        cpu = _child_cpu_seconds(self._proc.pid) - self._cpu0
        self.cpu_share = cpu / wall if wall > 0 else float("nan")
        self._proc.kill()
        self._proc.wait()


def _child_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux ``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Row:
    name: str
    fn: Callable[[str], Any]
    group: str
    note: str = ""
    rounds: Dict[str, List[List[float]]] = field(default_factory=dict)  # phase -> per round, seconds per query

    def times(self, phase: str) -> List[float]:
        return [t for chunk in self.rounds[phase] for t in chunk]

    def rounds_over(self, phase: str, ratio: float) -> Tuple[int, int]:
        """(rounds whose p50 in ``phase`` exceeds ``ratio`` x that round's idle p50, rounds)."""
        pairs = list(zip(self.rounds["idle"], self.rounds[phase]))
        return sum(np.median(load) > ratio * np.median(idle) for idle, load in pairs), len(pairs)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) * 1000.0


# ------------------------------------------------------------------------------------------ setup
def open_index(folder: Path, embed_model: Any):
    """The default HybridIndex over the corpus (built once, vectors from the benchmark cache)."""
    from llama_index_retrieval_kit.indices import HybridIndex

    storage = C.CACHE_DIR / f"busy_neighbour_{folder.name}_index"
    if (storage / "index.json").exists():
        return HybridIndex.load(storage, embed_model=embed_model)
    corpus = C.read_corpus(folder)
    docs = C.our_documents(corpus)
    nodes = C.our_parser().get_nodes_from_documents(docs)  # the package's default chunking
    C.cached_embeddings([C.embed_text_of(n) for n in nodes], show_progress=True)  # fill the shared cache first
    if storage.exists():
        shutil.rmtree(storage)
    # every vector is already computed
    return HybridIndex.from_documents(docs, storage, embed_model=embed_model, show_progress=True, embedding_cache=C.CACHE_FILE)


def onnx_model(kwargs: Dict[str, Any]):
    from llama_index_retrieval_kit.models import default_embed_model

    return default_embed_model(**kwargs)


def backend_of(model: Any) -> str:
    return "onnx" if getattr(model, "onnx_active", False) else "torch"


def build_rows(
    index: Any, default_model: Any, configs: Dict[str, Dict[str, Any]], queries: Sequence[str], llamaindex: bool
) -> List[Row]:
    """The timed rows: embedding alone per configuration (and LlamaIndex's), then the hybrid rows
    when ``index`` is given."""
    from llama_index.core.schema import QueryBundle

    rows: List[Row] = []
    models = {label: (default_model if not kwargs else onnx_model(kwargs)) for label, kwargs in configs.items()}
    for label, model in models.items():
        model.get_query_embedding("warm up")  # export/load the ONNX model, speed check
        if model is default_model:
            label = f"default (onnx_threads={model.onnx_threads}, onnx_spin_us={model.onnx_spin_us})"
        rows.append(Row(f"embed: Fast {label}", model.get_query_embedding, "embedding", f"backend {backend_of(model)}"))
    if llamaindex:
        li = C.llamaindex_embed_model()
        li.get_query_embedding("warm up")
        rows.append(Row("embed: LlamaIndex HuggingFaceEmbedding", li.get_query_embedding, "embedding", "PyTorch, its defaults"))
    if index is not None:
        retriever = index.as_retriever("hybrid")
        rows.append(Row("hybrid: text query (package default)", retriever.retrieve, "hybrid", "as_retriever('hybrid'), defaults"))
        given = {text: default_model.get_query_embedding(text) for text in queries}  # before any timing

        def retrieve_given(text: str) -> Any:
            return retriever.retrieve(QueryBundle(text, embedding=given[text]))

        rows.append(Row("hybrid: embedding given (retrieval alone)", retrieve_given, "hybrid", "embedding precomputed"))
        for label, model in models.items():
            if model is default_model:
                continue

            def embed_and_retrieve(text: str, model: Any = model) -> Any:
                return retriever.retrieve(QueryBundle(text, embedding=model.get_query_embedding(text)))

            rows.append(Row(f"hybrid: Fast {label} + retrieval", embed_and_retrieve, "hybrid", f"backend {backend_of(model)}"))
    return rows


# ------------------------------------------------------------------------------------------ measure
def run_phase(rows: List[Row], phase: str, queries: List[str], shift: int) -> None:
    """Every row answers ``queries`` back to back, one at a time (rows rotated by ``shift``)."""
    order = rows[shift % len(rows) :] + rows[: shift % len(rows)]
    for row in order:
        row.fn(queries[0])  # one untimed call after switching rows
        times: List[float] = []
        row.rounds.setdefault(phase, []).append(times)
        for text in queries:
            started = time.perf_counter()
            row.fn(text)
            times.append(time.perf_counter() - started)


def measure(rows: List[Row], queries: List[str], neighbours: Sequence[str], round_size: int, warmup: int) -> Dict[str, List[float]]:
    """Rounds of ``round_size`` queries: an idle phase, then one loaded phase per neighbour."""
    for text in queries[:warmup]:
        for row in rows:
            row.fn(text)
    shares: Dict[str, List[float]] = {kind: [] for kind in neighbours}
    rounds = [queries[i : i + round_size] for i in range(0, len(queries), round_size)]
    for ri, chunk in enumerate(rounds):
        run_phase(rows, "idle", chunk, ri)
        for kind in neighbours:
            with Neighbour(kind) as neighbour:
                run_phase(rows, kind, chunk, ri)
            shares[kind].append(neighbour.cpu_share)
        print(f"  round {ri + 1}/{len(rounds)}: {sum(map(len, rounds[: ri + 1]))}/{len(queries)} queries", flush=True)
    return shares


def table(rows: List[Row], neighbours: Sequence[str]) -> str:
    head = ["row", "neighbour", "idle p50 ms", "idle p95 ms", "loaded p50 ms", "loaded p95 ms", "ratio p50", "bar (<= 2x)",
            "rounds > 2x", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind in neighbours:
        for row in rows:
            idle50, idle95 = percentile(row.times("idle"), 50), percentile(row.times("idle"), 95)
            load50, load95 = percentile(row.times(kind), 50), percentile(row.times(kind), 95)
            ratio = load50 / idle50
            over, total = row.rounds_over(kind, BAR)
            lines.append(
                f"| {row.name} | {kind} | {idle50:.2f} | {idle95:.2f} | {load50:.2f} | {load95:.2f} | {ratio:.2f} | "
                f"{'yes' if ratio <= BAR else 'NO'} | {over}/{total} | {row.note} |"
            )
    return "\n".join(lines)


def to_json(rows: List[Row], neighbours: Sequence[str]) -> List[Dict[str, Any]]:
    out = []
    for row in rows:
        entry: Dict[str, Any] = {"row": row.name, "group": row.group, "note": row.note, "queries": len(row.times("idle"))}
        for phase in ("idle", *neighbours):
            entry[f"{phase}_p50_ms"] = percentile(row.times(phase), 50)
            entry[f"{phase}_p95_ms"] = percentile(row.times(phase), 95)
            entry[f"{phase}_round_p50_ms"] = [percentile(chunk, 50) for chunk in row.rounds[phase]]
        out.append(entry)
    return out


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", type=Path, default=C.DEFAULT_BEIR / "scifact")
    ap.add_argument("--split", default="test")
    ap.add_argument("--queries", type=int, default=None, help="first N queries of the split (default: all)")
    ap.add_argument("--round-size", type=int, default=50, help="queries per round (one idle and one loaded phase each)")
    ap.add_argument("--warmup", type=int, default=5, help="queries run once through every row before timing")
    ap.add_argument("--neighbour", choices=[*NEIGHBOURS, "both"], default="python", help="what keeps the core busy")
    ap.add_argument(
        "--configs",
        default=",".join(ONNX_CONFIGS),
        help="comma-separated ONNX configurations (the default is always measured), of: "
        + "; ".join(f"{key} = {label}" for key, (label, _) in ONNX_CONFIGS.items()),
    )
    ap.add_argument("--no-llamaindex", action="store_true", help="skip LlamaIndex's HuggingFaceEmbedding row")
    ap.add_argument("--no-hybrid", action="store_true", help="skip the HybridIndex rows (no index build)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args(argv)
    for name in ("queries", "round_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    keys = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in keys if c not in ONNX_CONFIGS]
    if unknown or not keys:
        ap.error(f"--configs: unknown {unknown or args.configs!r}; allowed: {', '.join(ONNX_CONFIGS)}")
    args.config_keys = ["default"] + [c for c in keys if c != "default"]  # the package default is always measured
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    folder = args.dataset.resolve()
    data = C.load_split(folder, args.split, corpus={})
    queries = list(data.queries.values())[: args.queries]
    neighbours = list(NEIGHBOURS) if args.neighbour == "both" else [args.neighbour]
    load_before = os.getloadavg()
    default_model = C.embed_model()  # the package default: FastHuggingFaceEmbedding, onnx_threads=0
    index = None if args.no_hybrid else open_index(folder, default_model)
    try:
        configs = dict(ONNX_CONFIGS[c] for c in args.config_keys)
        rows = build_rows(index, default_model, configs, queries, not args.no_llamaindex)
        print(f"[{folder.name}] {len(queries)} {args.split} queries, rounds of {args.round_size}, neighbours: {', '.join(neighbours)}", flush=True)
        started = time.perf_counter()
        shares = measure(rows, queries, neighbours, args.round_size, args.warmup)
        seconds = time.perf_counter() - started
    finally:
        if index is not None:
            index.close()
    load_after = os.getloadavg()
    print()
    print(table(rows, neighbours))
    print()
    for kind, values in shares.items():
        print(f"{kind} neighbour CPU share during its phases: median {statistics.median(values):.2f} of a core (min {min(values):.2f})")
    print(f"{os.cpu_count()} CPUs; load average 1/5/15 min before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
          f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}; measured in {seconds:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"rows": to_json(rows, neighbours), "neighbour_cpu_share": shares}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
