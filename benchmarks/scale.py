"""Scale limits: BM25Retriever (bm25s) build / memory / latency, and Qdrant local mode.

    nice -n 10 python benchmarks/scale.py [--sizes 100000,1000000] [--json PATH]
        [--fallback-size 300000] [--raw-sizes N,...] [--qdrant-sizes 10000,50000,100000]
        [--dense-sizes 100000,200000,400000,800000] [--parts bm25,qdrant,dense]
        [--mem-limit-gib 10] [--timeout 2400]

Results and guidance: ``docs/benchmarks.md``, section "Scale". The default run took 26 min
wall (about 16 CPU minutes, mostly single-threaded) on a 2-core VM shared with other
benchmarks, and peaks below 4 GiB RSS. Our retriever at 1M chunks needs about 9.6 GiB, so with
the default 10 GiB limit the default run projects it, skips it and measures 300k instead; to
measure 1M itself (17 min wall, 9.6 GiB peak):

    nice -n 10 python benchmarks/scale.py --parts bm25 --sizes 1000000 --raw-sizes "" --json b.json
    python benchmarks/scale.py --report-from a.json,b.json      # tables of both runs, merged

Everything is synthetic and deterministic (seed 0): chunks of 60-120 words drawn from a
Zipf(s=1) vocabulary of 50,000 words whose 30 most frequent words are English stopwords, each a
``TextNode`` with a uuid id, a SOURCE relationship and small metadata ``{"doc_id", "source"
(20 values), "page"}``. Queries are 3-6 non-stopword words drawn from the same distribution; the
filtered runs keep one ``source`` (5 % of the chunks).

Every measurement runs in its own child process, so memory numbers are not polluted by an
earlier size. The parent samples the child's RSS every 50 ms (psutil) and kills it when it
passes ``--mem-limit-gib`` (the size is then reported as aborted, with the RSS it had reached);
before starting a size it projects the peak linearly from the largest smaller size of the same
kind and skips it when the projection exceeds 90 % of the limit. Inside the child a thread
samples RSS per phase (peak and retained RSS over the phase's start; the process peak is the
kernel's ``ru_maxrss``). No tracemalloc: it would slow the build several times over.

Parts:

* ``bm25``   our ``BM25Retriever`` (default tokenizer: English stopwords + Snowball stemmer)
  per size: build broken down into phases (node copies, tokenization, bm25s index, token
  cache; timed by wrapping the module's helpers), query latency p50/p95 over 100 queries (top
  10) unfiltered and with a metadata filter, one ``insert_nodes`` of 100 chunks (a full
  rebuild), persist time and size; then ``BM25Retriever.load`` in a fresh process (load time,
  steady RSS, query latency). A size projected past the memory limit is replaced by
  ``--fallback-size`` for our retriever, and measured with raw bm25s (``bm25s.tokenize`` +
  ``BM25.index``, no nodes), which also runs at the smallest size for comparison.
* ``qdrant`` Qdrant local mode with on-disk storage (``QdrantClient(path=...)``) and the schema
  ``HybridIndex`` writes: dense ``text-dense`` (384-d cosine, random unit vectors), sparse
  ``text-sparse-new`` (our BM25 weights, ``Modifier.IDF``) and the node payload
  (``node_to_metadata_dict``), upserted in batches of 256 into one collection grown through
  ``--qdrant-sizes``. Local mode commits one SQLite transaction (with fsync) per point, so
  durable inserts run at disk-sync speed; to reach 100k points in minutes most points are
  written with SQLite ``synchronous=OFF`` (same file format; "fsync off" columns, i.e. the
  CPU-bound rate) and the last ``--durable-points`` of each size with the default settings
  ("durable", what ``HybridIndex`` gets). At each size: query latency for dense, dense with a
  ``doc_id`` filter, sparse, and Qdrant-side hybrid (the ``QdrantHybridRetriever`` query: two
  prefetches + RRF). Then the folder is reopened in a fresh process (load time and RSS).
* ``dense``  where brute-force dense search in local mode crosses 50 ms / 200 ms at larger
  sizes: the collection's in-memory state is filled directly with N unit vectors (inserting
  millions of points through the API takes hours in local mode) and queried through the public
  ``query_points``; the 100k row can be compared with the API-built collection of ``qdrant``.

Latencies are wall-clock; "cpu" columns are the process CPU time per query (all threads),
which the machine's other load inflates much less than wall time.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import psutil  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GIB = 1024**3
MIB = 1024**2
SEED = 0
VOCAB_SIZE = 50_000
N_STOPWORDS = 30  # the most frequent "words" are real English stopwords
QUERY_COUNT = 100
TOP_K = 10
RESULT_TAG = "SCALE-RESULT "


# ============================================================================ synthetic corpus
@functools.lru_cache(maxsize=1)
def vocabulary() -> Tuple[str, ...]:
    """50k distinct lowercase words: 30 English stopwords, then pseudo-words of 2-4 syllables
    (frequent words shorter, ~6 letters on average per running word, as in English prose)."""
    import bm25s.stopwords as sw

    stop = [w for w in sw.STOPWORDS_EN if len(w) >= 2][:N_STOPWORDS]
    rng = np.random.default_rng(SEED)
    syllables = np.array([c + v for c in "bcdfghklmnprstvz" for v in "aeiou"], dtype=object)
    codas = np.array(["", "", "", "n", "r", "s", "t", "l"], dtype=object)
    seen = set(stop)
    words = list(stop)
    while len(words) < VOCAB_SIZE:
        m = 4 * (VOCAB_SIZE - len(words))
        parts = rng.integers(0, len(syllables), size=(m, 4))
        coda = rng.integers(0, len(codas), size=m)
        for k in range(m):
            rank = len(words)
            if rank >= VOCAB_SIZE:
                break
            n_syl = 2 if rank < 300 else 3 if rank < 8000 else 4
            w = "".join(syllables[parts[k, :n_syl]]) + codas[coda[k]]
            if w not in seen:
                seen.add(w)
                words.append(w)
    return tuple(words)


def zipf_probs(n: int, s: float = 1.0, q: float = 2.7) -> np.ndarray:
    """Zipf-Mandelbrot probabilities p(r) ~ 1 / (r + q)^s over ranks 1..n."""
    p = 1.0 / (np.arange(1, n + 1) + q) ** s
    return p / p.sum()


def chunk_texts(n: int, start: int = 0) -> List[str]:
    """Texts of chunks start..start+n-1 (deterministic per position, generated in blocks)."""
    vocab = np.array(vocabulary(), dtype=object)
    cdf = np.cumsum(zipf_probs(VOCAB_SIZE))
    texts: List[str] = []
    block = 50_000
    for b0 in range(start - start % block, start + n, block):
        rng = np.random.default_rng([SEED, b0])
        lengths = rng.integers(60, 121, size=block)
        ids = np.searchsorted(cdf, rng.random(int(lengths.sum())), side="right").clip(0, VOCAB_SIZE - 1)
        words = vocab[ids]
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        lo, hi = max(start, b0) - b0, min(start + n, b0 + block) - b0
        texts.extend(" ".join(words[offsets[i] : offsets[i + 1]]) for i in range(lo, hi))
    return texts


def queries(count: int = QUERY_COUNT) -> List[str]:
    """3-6 distinct non-stopword words each, Zipf-distributed over ranks 31..50k."""
    vocab = vocabulary()
    p = zipf_probs(VOCAB_SIZE)[N_STOPWORDS:]
    p = p / p.sum()
    rng = np.random.default_rng([SEED, 999])
    out = []
    for _ in range(count):
        k = int(rng.integers(3, 7))
        ids = rng.choice(len(p), size=k, replace=False, p=p) + N_STOPWORDS
        out.append(" ".join(vocab[i] for i in ids))
    return out


def node_id(i: int) -> str:
    return str(uuid.UUID(int=i + 1))


def make_nodes(texts: Sequence[str], start: int = 0) -> list:
    from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode

    nodes = []
    for j, text in enumerate(texts):
        i = start + j
        doc = f"doc-{i // 8}"
        nodes.append(
            TextNode(
                id_=node_id(i),
                text=text,
                metadata={"doc_id": doc, "source": f"source-{i % 20}", "page": i % 50},
                relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=doc)},
            )
        )
    return nodes


def bm25_filter():
    from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters

    return MetadataFilters(filters=[MetadataFilter(key="source", value="source-3")])


# ============================================================================ measuring helpers
def rss() -> int:
    return psutil.Process().memory_info().rss


class PhaseMeter:
    """Wall time, CPU time, RSS at start/end and sampled peak RSS of named (possibly nested) phases."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.phases: Dict[str, Dict[str, float]] = {}
        self._active: Dict[str, int] = {}  # phase -> peak RSS seen so far
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._proc = psutil.Process()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                now = self._proc.memory_info().rss
                with self._lock:
                    for name, peak in self._active.items():
                        if now > peak:
                            self._active[name] = now
            except Exception:  # pragma: no cover
                pass
            self._stop.wait(self.interval)

    def start(self, name: str) -> None:
        now = rss()
        with self._lock:
            self._active[name] = now
        self.phases[name] = {"_t": time.perf_counter(), "_c": time.process_time(), "rss_start": now}

    def stop(self, name: str) -> Dict[str, float]:
        ph = self.phases[name]
        now = rss()
        with self._lock:
            peak = max(self._active.pop(name), now)
        ph["seconds"] = time.perf_counter() - ph.pop("_t")
        ph["cpu_seconds"] = time.process_time() - ph.pop("_c")
        ph["rss_end"] = now
        ph["rss_peak"] = peak
        ph["retained_bytes"] = now - ph["rss_start"]
        ph["peak_delta_bytes"] = peak - ph["rss_start"]
        return ph

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        self.start(name)
        out = fn()
        self.stop(name)
        return out

    def close(self) -> None:
        self._stop.set()


def latency(fn: Callable[[Any], Any], items: Sequence[Any], warmup: int = 3) -> Dict[str, float]:
    for it in items[:warmup]:
        fn(it)
    wall, cpu = [], []
    for it in items:
        t, c = time.perf_counter(), time.process_time()
        fn(it)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    w, c = np.array(wall) * 1000, np.array(cpu) * 1000
    return {
        "n": len(items),
        "p50_ms": float(np.percentile(w, 50)),
        "p95_ms": float(np.percentile(w, 95)),
        "cpu_p50_ms": float(np.percentile(c, 50)),
        "cpu_p95_ms": float(np.percentile(c, 95)),
    }


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def peak_rss_kernel() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def emit(result: Dict[str, Any]) -> None:
    result["process_peak_rss"] = peak_rss_kernel()
    print(RESULT_TAG + json.dumps(result), flush=True)


# ============================================================================ workers (child processes)
def worker_bm25_build(n: int, workdir: Path) -> None:
    import llama_index_retrieval_kit.retrievers.bm25 as bm25_mod
    from llama_index_retrieval_kit.retrievers.bm25 import BM25Retriever, BM25TokenizerConfig

    meter = PhaseMeter()
    base = rss()
    texts = meter.run("generate_texts", lambda: chunk_texts(n))
    nodes = meter.run("make_nodes", lambda: make_nodes(texts))
    del texts
    gc.collect()

    # Phase boundaries inside the constructor: wrap the module's helpers (timing only).
    orig_copies = BM25Retriever.__dict__["_checked_copies"].__func__
    orig_snapshot = bm25_mod.build_snapshot
    orig_index = bm25_mod.bm25s.BM25.index

    def copies_wrapper(nodes_):
        meter.start("ctor_copy_nodes")
        out = orig_copies(nodes_)
        meter.stop("ctor_copy_nodes")
        meter.start("ctor_tokenize")
        return out

    def snapshot_wrapper(nodes_, tokens_, params_):
        meter.stop("ctor_tokenize")
        meter.start("ctor_snapshot")
        out = orig_snapshot(nodes_, tokens_, params_)
        meter.stop("ctor_snapshot")
        return out

    def index_wrapper(self, *a, **kw):
        meter.start("bm25s_index")
        out = orig_index(self, *a, **kw)
        meter.stop("bm25s_index")
        return out

    BM25Retriever._checked_copies = staticmethod(copies_wrapper)
    bm25_mod.build_snapshot = snapshot_wrapper
    bm25_mod.bm25s.BM25.index = index_wrapper
    cfg = BM25TokenizerConfig()  # English stopwords + English Snowball stemmer (the default)
    retriever = meter.run("build_total", lambda: BM25Retriever(nodes, tokenizer_config=cfg, similarity_top_k=TOP_K))
    BM25Retriever._checked_copies = staticmethod(orig_copies)
    bm25_mod.build_snapshot = orig_snapshot
    bm25_mod.bm25s.BM25.index = orig_index

    snap = retriever.snapshot
    sc = snap.bm25.scores
    index_bytes = int(sum(np.asarray(sc[k]).nbytes for k in ("data", "indices", "indptr")))
    n_tokens = int(sum(len(t) for t in snap.tokens))
    meter.start("drop_caller_nodes")
    del nodes
    gc.collect()
    meter.stop("drop_caller_nodes")
    steady = rss()

    qs = queries()
    unfiltered = latency(lambda q: retriever.retrieve(q), qs)
    view = retriever.with_filters(bm25_filter())
    filtered = latency(lambda q: view.retrieve(q), qs if n < 500_000 else qs[:30])
    # how many candidates the filter has to look at (docs sharing a query term)
    cand = []
    for q in qs[:20]:
        ids = [snap.bm25.vocab_dict[t] for t in retriever.tokenize(q) if t in snap.bm25.vocab_dict]
        ip = snap.bm25.scores["indptr"]
        cand.append(sum(int(ip[t + 1] - ip[t]) for t in set(ids)))

    extra = make_nodes(chunk_texts(100, start=n), start=n)
    meter.run("insert_100_nodes", lambda: retriever.insert_nodes(extra))

    folder = workdir / f"bm25-{n}"
    shutil.rmtree(folder, ignore_errors=True)
    meter.run("persist", lambda: retriever.persist(folder))
    files = {p.name: dir_size(p) if p.is_dir() else p.stat().st_size for p in folder.iterdir()}
    meter.close()
    emit(
        {
            "kind": "bm25_build",
            "n": n,
            "base_rss": base,
            "steady_rss_after_build": steady,
            "phases": meter.phases,
            "bm25s_index_bytes": index_bytes,
            "vocab_size": len(snap.bm25.vocab_dict),
            "tokens_total": n_tokens,
            "query": unfiltered,
            "query_filtered": filtered,
            "candidates_per_query_mean": float(np.mean(cand)),
            "persist_dir": str(folder),
            "persist_bytes": dir_size(folder),
            "persist_files": files,
        }
    )


def worker_bm25_load(n: int, workdir: Path) -> None:
    from llama_index_retrieval_kit.retrievers.bm25 import BM25Retriever

    folder = workdir / f"bm25-{n}"
    meter = PhaseMeter()
    base = rss()
    retriever = meter.run("load", lambda: BM25Retriever.load(folder))
    gc.collect()
    loaded = rss()
    qs = queries()
    q = latency(lambda s: retriever.retrieve(s), qs[:50])
    meter.close()
    emit({"kind": "bm25_load", "n": n, "base_rss": base, "rss_after_load": loaded, "phases": meter.phases, "query": q})


def worker_bm25s_raw(n: int, workdir: Path) -> None:
    import bm25s
    import Stemmer

    meter = PhaseMeter()
    base = rss()
    texts = meter.run("generate_texts", lambda: chunk_texts(n))
    stemmer = Stemmer.Stemmer("english")
    tok = meter.run(
        "tokenize", lambda: bm25s.tokenize(texts, lower=True, stopwords="en", stemmer=stemmer, show_progress=False)
    )
    del texts
    gc.collect()
    model = bm25s.BM25(method="lucene", k1=1.5, b=0.75, backend="numpy")
    meter.run("index", lambda: model.index(tok, show_progress=False))
    del tok
    gc.collect()
    steady = rss()
    qs = queries()

    def search(s):
        qt = bm25s.tokenize([s], lower=True, stopwords="en", stemmer=stemmer, show_progress=False, return_ids=False)
        return model.retrieve(qt, k=TOP_K, show_progress=False, n_threads=1)

    q = latency(search, qs)
    folder = workdir / f"bm25s-raw-{n}"
    shutil.rmtree(folder, ignore_errors=True)
    meter.run("save", lambda: model.save(folder, show_progress=False))
    size = dir_size(folder)
    shutil.rmtree(folder, ignore_errors=True)
    meter.close()
    emit({"kind": "bm25s_raw", "n": n, "base_rss": base, "steady_rss": steady, "phases": meter.phases, "query": q, "persist_bytes": size})


# ----------------------------------------------------------------------------- qdrant
DENSE_DIM = 384


def unit_vectors(n: int, start: int = 0, dim: int = DENSE_DIM) -> np.ndarray:
    """Random unit vectors (float32), deterministic per block of 100k rows."""
    out = np.empty((n, dim), dtype=np.float32)
    block = 100_000
    pos = 0
    for b0 in range(start - start % block, start + n, block):
        rng = np.random.default_rng([SEED, 7, b0])
        v = rng.standard_normal((block, dim), dtype=np.float32)
        lo, hi = max(start, b0) - b0, min(start + n, b0 + block) - b0
        v = v[lo:hi]
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        out[pos : pos + len(v)] = v
        pos += len(v)
    return out


def hybrid_points(start: int, n: int, avgdl: float) -> list:
    """Points as HybridIndex._write_points builds them (dense, BM25 sparse, full node payload)."""
    from llama_index.core.vector_stores.utils import node_to_metadata_dict
    from llama_index_retrieval_kit.retrievers.bm25 import BM25TokenizerConfig, build_tokenizer
    from llama_index_retrieval_kit.retrievers.qdrant_hybrid import DENSE_VECTOR, SPARSE_VECTOR, bm25_doc_vector
    from qdrant_client import models

    tokenize = build_tokenizer(BM25TokenizerConfig())
    nodes = make_nodes(chunk_texts(n, start), start)
    vecs = unit_vectors(n, start)
    return [
        models.PointStruct(
            id=node.node_id,
            vector={DENSE_VECTOR: vec.tolist(), SPARSE_VECTOR: bm25_doc_vector(tokenize(node.get_content()), avgdl, 1.2, 0.75)},
            payload=node_to_metadata_dict(node, remove_text=False, flat_metadata=False),
        )
        for node, vec in zip(nodes, vecs)
    ]


def _collection_storage(client: Any, name: str) -> Any:
    """The SQLite connection of a local-mode collection (qdrant-client internals; benchmark shortcut)."""
    return client._client.collections[name].storage.storage


def worker_qdrant_grow(steps: Sequence[int], workdir: Path, durable: int) -> None:
    """Grow one on-disk collection through ``steps`` points, measuring ingest and queries at each."""
    import warnings

    from llama_index_retrieval_kit.retrievers.bm25 import BM25TokenizerConfig, build_tokenizer
    from llama_index_retrieval_kit.retrievers.qdrant_hybrid import (
        DENSE_VECTOR,
        SPARSE_VECTOR,
        bm25_query_vector,
        sparse_vectors_config,
    )
    from qdrant_client import QdrantClient, models

    warnings.filterwarnings("ignore", message="Local mode is not recommended")
    path = workdir / "qdrant"
    shutil.rmtree(path, ignore_errors=True)
    base = rss()
    client = QdrantClient(path=str(path))
    client.create_collection(
        "chunks",
        vectors_config={DENSE_VECTOR: models.VectorParams(size=DENSE_DIM, distance=models.Distance.COSINE)},
        sparse_vectors_config=sparse_vectors_config(),
    )
    tokenize = build_tokenizer(BM25TokenizerConfig())
    avgdl = float(np.mean([len(tokenize(t)) for t in chunk_texts(2000)]))  # frozen from the first batch, as HybridIndex does
    try:
        storage = _collection_storage(client, "chunks")
    except AttributeError:  # qdrant-client internals changed: every point goes in with fsync (slow)
        storage = None
        print("warning: cannot reach the collection's SQLite connection; inserting with default durability", flush=True)
    batch = 256

    def pragma(sync: str) -> None:
        if storage is not None:
            storage.execute(f"PRAGMA synchronous={sync}")

    def upsert(start: int, stop: int) -> Tuple[float, float, float]:
        """Insert points start..stop-1; returns (prepare s, upsert wall s, upsert cpu s)."""
        prep = wall = cpu = 0.0
        for s0 in range(start, stop, 10_000):
            t = time.perf_counter()
            pts = hybrid_points(s0, min(10_000, stop - s0), avgdl)
            prep += time.perf_counter() - t
            t, c = time.perf_counter(), time.process_time()
            for i in range(0, len(pts), batch):
                client.upsert("chunks", points=pts[i : i + batch], wait=True)
            wall += time.perf_counter() - t
            cpu += time.process_time() - c
        return prep, wall, cpu

    qs = queries()
    qvecs = unit_vectors(len(qs), start=50_000_000)
    svecs = [bm25_query_vector(tokenize(q)) for q in qs]
    flt = models.Filter(must=[models.FieldCondition(key="doc_id", match=models.MatchValue(value="doc-42"))])

    def hybrid(i: int) -> Any:  # the query QdrantHybridRetriever sends
        return client.query_points(
            "chunks",
            prefetch=[
                models.Prefetch(query=qvecs[i].tolist(), using=DENSE_VECTOR, limit=100),
                models.Prefetch(query=svecs[i], using=SPARSE_VECTOR, limit=100),
            ],
            query=models.RrfQuery(rrf=models.Rrf(k=61)),
            limit=TOP_K,
            with_payload=True,
        )

    rows = []
    cur = 0
    for target in sorted(steps):
        bulk_end = max(cur, target - durable)
        pragma("OFF")  # benchmark shortcut for the bulk of the points
        prep, bulk_wall, bulk_cpu = upsert(cur, bulk_end)
        pragma("FULL")  # SQLite's default: what HybridIndex runs with
        _, dur_wall, dur_cpu = upsert(bulk_end, target)
        cur = target
        gc.collect()
        few = 5 if target <= 10_000 else 3
        row = {
            "n": target,
            "rss_delta": rss() - base,
            "disk_bytes": dir_size(path),
            "dense": latency(
                lambda v: client.query_points("chunks", query=v.tolist(), using=DENSE_VECTOR, limit=TOP_K), list(qvecs)
            ),
            "dense_filtered": latency(
                lambda v: client.query_points(
                    "chunks", query=v.tolist(), using=DENSE_VECTOR, limit=TOP_K, query_filter=flt
                ),
                list(qvecs[: 2 * few]),
                warmup=1,
            ),
            "sparse": latency(
                lambda v: client.query_points("chunks", query=v, using=SPARSE_VECTOR, limit=TOP_K), svecs[:few], warmup=1
            ),
            "hybrid_rrf": latency(hybrid, list(range(few)), warmup=1),
        }
        seg = bulk_end - (rows[-1]["n"] if rows else 0)
        row.update(
            {
                "segment_bulk_points": seg,
                "bulk_points_per_s": seg / bulk_wall if bulk_wall else None,
                "bulk_points_per_cpu_s": seg / bulk_cpu if bulk_cpu else None,
                "prepare_points_per_s": seg / prep if prep else None,
                "durable_points": target - bulk_end,
                "durable_points_per_s": (target - bulk_end) / dur_wall if dur_wall else None,
                "durable_points_per_cpu_s": (target - bulk_end) / dur_cpu if dur_cpu else None,
            }
        )
        rows.append(row)
        print(f"qdrant {target}: {json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)})}", flush=True)
    client.close()
    emit({"kind": "qdrant_grow", "n": max(steps), "base_rss": base, "steps": rows})


def worker_qdrant_open(n: int, workdir: Path) -> None:
    from llama_index_retrieval_kit.retrievers.qdrant_hybrid import DENSE_VECTOR
    from qdrant_client import QdrantClient
    import warnings

    warnings.filterwarnings("ignore", message="Local mode is not recommended")
    path = workdir / "qdrant"
    meter = PhaseMeter()
    base = rss()
    client = meter.run("open", lambda: QdrantClient(path=str(path)))
    count = client.count("chunks").count
    gc.collect()
    opened = rss()
    qvecs = unit_vectors(20, start=50_000_000)
    dense = latency(lambda v: client.query_points("chunks", query=v.tolist(), using=DENSE_VECTOR, limit=TOP_K), list(qvecs))
    client.close()
    meter.close()
    emit({"kind": "qdrant_open", "n": n, "count": count, "base_rss": base, "rss_after_open": opened, "phases": meter.phases, "dense": dense})


def worker_dense_sweep(n: int, workdir: Path) -> None:
    from llama_index_retrieval_kit.retrievers.qdrant_hybrid import DENSE_VECTOR
    from qdrant_client import QdrantClient, models
    import warnings

    warnings.filterwarnings("ignore", message="Local mode is not recommended")
    meter = PhaseMeter()
    base = rss()
    client = QdrantClient(":memory:")
    client.create_collection("c", vectors_config={DENSE_VECTOR: models.VectorParams(size=DENSE_DIM, distance=models.Distance.COSINE)})
    client.upsert("c", points=[models.PointStruct(id=0, vector={DENSE_VECTOR: [1.0] * DENSE_DIM}, payload={"doc_id": "doc-0"})])

    def fill():
        coll = client._client.collections["c"]  # qdrant-client internals: what _add_point would build
        coll.vectors[DENSE_VECTOR] = unit_vectors(n)
        coll.deleted = np.zeros(n, dtype=bool)
        coll.deleted_per_vector[DENSE_VECTOR] = np.zeros(n, dtype=bool)
        coll.ids = {i: i for i in range(n)}
        coll.ids_inv = list(range(n))
        coll.payload = [{"doc_id": f"doc-{i // 8}"} for i in range(n)]

    meter.run("fill", fill)
    assert client.count("c").count == n
    qvecs = list(unit_vectors(QUERY_COUNT, start=50_000_000))
    nq = 50 if n <= 200_000 else 20
    dense = latency(lambda v: client.query_points("c", query=v.tolist(), using=DENSE_VECTOR, limit=TOP_K), qvecs[:nq])
    dense_f = None
    if n <= 100_000:
        flt = models.Filter(must=[models.FieldCondition(key="doc_id", match=models.MatchValue(value="doc-42"))])
        dense_f = latency(
            lambda v: client.query_points("c", query=v.tolist(), using=DENSE_VECTOR, limit=TOP_K, query_filter=flt),
            qvecs[:3],
            warmup=1,
        )
    meter.close()
    emit({"kind": "dense_sweep", "n": n, "base_rss": base, "rss": rss(), "phases": meter.phases, "dense": dense, "dense_filtered": dense_f})


WORKERS = {
    "bm25_build": worker_bm25_build,
    "bm25_load": worker_bm25_load,
    "bm25s_raw": worker_bm25s_raw,
    "qdrant_open": worker_qdrant_open,
    "dense_sweep": worker_dense_sweep,
}


# ============================================================================ parent: run children under a watchdog
class Runner:
    def __init__(self, mem_limit: int, timeout: float, workdir: Path, log: Callable[[str], None]) -> None:
        self.mem_limit = mem_limit
        self.timeout = timeout
        self.workdir = workdir
        self.log = log

    def run(self, kind: str, n: int, *extra: str) -> Dict[str, Any]:
        cmd = [sys.executable, __file__, "--worker", kind, "--n", str(n), "--workdir", str(self.workdir), *extra]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ps = psutil.Process(proc.pid)
        peak, reason = 0, None
        lines: List[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        while proc.poll() is None:
            try:
                mem = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
            except psutil.Error:
                mem = 0
            peak = max(peak, mem)
            if mem > self.mem_limit:
                reason = f"memory limit: RSS reached {mem / GIB:.2f} GiB > limit {self.mem_limit / GIB:.2f} GiB"
            elif time.perf_counter() - t0 > self.timeout:
                reason = f"time limit: still running after {self.timeout:.0f} s"
            if reason:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.05)
        reader.join(timeout=10)
        wall = time.perf_counter() - t0
        result = None
        for line in lines:
            if line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG) :])
        if result is None:
            tail = "".join(lines[-15:])
            result = {"kind": kind, "n": n, "aborted": reason or f"exit code {proc.returncode}", "output_tail": tail}
            self.log(f"  !! {kind} n={n:,} aborted: {result['aborted']}\n{tail}")
        result["watchdog_peak_rss"] = peak
        result["wall_seconds"] = wall
        self.log(f"  {kind} n={n:,}: {wall:.0f} s, peak RSS {peak / GIB:.2f} GiB")
        return result


# ============================================================================ report
def fmt_n(n: int) -> str:
    if n <= 0:
        return "0"
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)


def gib(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / GIB:.2f}"


def mib(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / MIB:.0f}"


def ms(d: Optional[Dict[str, float]], key: str = "p50_ms") -> str:
    if not d:
        return "-"
    v = d[key]
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _ok(results: Dict[str, Any], kind: str) -> List[Dict[str, Any]]:
    return sorted((r for r in results.get(kind, []) if "aborted" not in r), key=lambda r: r["n"])


def bm25_projection(results: Dict[str, Any], n: int = 1_000_000) -> Optional[Dict[str, float]]:
    """Linear projection to ``n`` chunks from the largest measured BM25Retriever size (bytes)."""
    builds = _ok(results, "bm25_build")
    if not builds:
        return None
    r = builds[-1]
    loads = {x["n"]: x for x in _ok(results, "bm25_load")}
    per = lambda b: b / r["n"] * n  # noqa: E731
    ph = r["phases"]
    out = {
        "from_n": r["n"],
        "build_process_peak": r["base_rss"] + per(r["process_peak_rss"] - r["base_rss"]),
        "caller_nodes": per(ph["make_nodes"]["retained_bytes"]),
        "retriever_steady": per(r["steady_rss_after_build"] - r["base_rss"]),
        "build_cpu_s": per(ph["build_total"]["cpu_seconds"]),
        "build_s": per(ph["build_total"]["seconds"]),
        "tokenize_cpu_s": per(ph["ctor_tokenize"]["cpu_seconds"]),
        "insert_cpu_s": per(ph["insert_100_nodes"]["cpu_seconds"]),
        "persist_bytes": per(r["persist_bytes"]),
    }
    if r["n"] in loads:
        ld = loads[r["n"]]
        out["loaded_steady"] = per(ld["rss_after_load"] - ld["base_rss"])
        out["load_cpu_s"] = per(ld["phases"]["load"]["cpu_seconds"])
    return out


def report(results: Dict[str, Any]) -> str:
    parts: List[str] = []
    builds = _ok(results, "bm25_build")
    loads = {r["n"]: r for r in _ok(results, "bm25_load")}
    raws = _ok(results, "bm25s_raw")
    if builds:
        rows = []
        for r in builds:
            ph = r["phases"]
            g = lambda k, f="seconds": ph[k][f]  # noqa: E731
            rows.append(
                [
                    fmt_n(r["n"]),
                    f"{g('build_total'):.0f} / {g('build_total', 'cpu_seconds'):.0f}",
                    f"{g('ctor_copy_nodes', 'cpu_seconds'):.1f}",
                    f"{g('ctor_tokenize', 'cpu_seconds'):.1f}",
                    f"{g('bm25s_index', 'cpu_seconds'):.1f}",
                    f"{g('ctor_snapshot', 'cpu_seconds') - g('bm25s_index', 'cpu_seconds'):.1f}",
                    f"{g('make_nodes', 'cpu_seconds'):.1f}",
                    gib(g("build_total", "peak_delta_bytes")),
                    gib(r["steady_rss_after_build"] - r["base_rss"]),
                    gib(r["process_peak_rss"]),
                ]
            )
        parts.append(
            "BM25Retriever build (wall / CPU seconds; phases in CPU seconds; memory in GiB; "
            "Δ = RSS over the process before the step)\n\n"
            + table(
                [
                    "chunks",
                    "build wall / cpu s",
                    "copy nodes",
                    "tokenize",
                    "bm25s index",
                    "token cache + tie order",
                    "caller makes TextNodes",
                    "build peak Δ",
                    "held after build Δ (caller's nodes dropped)",
                    "process peak",
                ],
                rows,
            )
        )
        rows = []
        for r in builds:
            ph = r["phases"]
            n = r["n"]
            per_chunk = lambda b: f"{b / n / 1024:.1f}"  # noqa: E731
            rows.append(
                [
                    fmt_n(n),
                    per_chunk(ph["make_nodes"]["retained_bytes"]),
                    per_chunk(ph["ctor_copy_nodes"]["retained_bytes"]),
                    per_chunk(ph["ctor_tokenize"]["retained_bytes"]),
                    per_chunk(ph["ctor_snapshot"]["retained_bytes"]),
                    per_chunk(r["bm25s_index_bytes"]),
                    per_chunk(ph["build_total"]["peak_delta_bytes"]),
                    per_chunk(loads[n]["rss_after_load"] - loads[n]["base_rss"]) if n in loads else "-",
                ]
            )
        parts.append(
            "BM25Retriever memory per chunk (KiB, RSS retained by each step)\n\n"
            + table(
                [
                    "chunks",
                    "caller's TextNode",
                    "retriever's node copy",
                    "token lists (tokenize)",
                    "snapshot (bm25s + token tuples)",
                    "of which bm25s score matrix",
                    "build peak",
                    "loaded index (fresh process)",
                ],
                rows,
            )
        )
        rows = []
        for r in builds:
            ph = r["phases"]
            ld = loads.get(r["n"])
            rows.append(
                [
                    fmt_n(r["n"]),
                    f"{r['tokens_total'] / r['n']:.0f}",
                    mib(r["persist_bytes"]),
                    mib(r["persist_files"].get("nodes.json")),
                    f"{ph['persist']['seconds']:.0f} / {ph['persist']['cpu_seconds']:.0f}",
                    f"{ld['phases']['load']['seconds']:.0f} / {ld['phases']['load']['cpu_seconds']:.0f}" if ld else "-",
                    gib(ld["rss_after_load"] - ld["base_rss"]) if ld else "-",
                    f"{ph['insert_100_nodes']['seconds']:.0f} / {ph['insert_100_nodes']['cpu_seconds']:.0f}",
                    gib(ph["insert_100_nodes"]["peak_delta_bytes"]),
                ]
            )
        parts.append(
            "BM25Retriever persist / load / update (wall / CPU seconds)\n\n"
            + table(
                [
                    "chunks",
                    "terms/chunk",
                    "on disk MiB",
                    "of which nodes.json",
                    "persist s",
                    "load s (fresh process)",
                    "RSS Δ after load GiB",
                    "insert_nodes(100) s",
                    "insert peak Δ GiB",
                ],
                rows,
            )
        )
        rows = []
        for r in builds:
            ld = loads.get(r["n"])
            rows.append(
                [
                    fmt_n(r["n"]),
                    f"{ms(r['query'])} / {ms(r['query'], 'p95_ms')}",
                    ms(r["query"], "cpu_p50_ms"),
                    f"{ms(r['query_filtered'])} / {ms(r['query_filtered'], 'p95_ms')} (n={r['query_filtered']['n']})",
                    ms(r["query_filtered"], "cpu_p50_ms"),
                    f"{r['candidates_per_query_mean']:,.0f}",
                    f"{ms(ld['query'])} / {ms(ld['query'], 'cpu_p50_ms')}" if ld else "-",
                ]
            )
        parts.append(
            f"BM25Retriever query latency ({QUERY_COUNT} queries unless noted, top {TOP_K}; ms)\n\n"
            + table(
                [
                    "chunks",
                    "p50 / p95",
                    "cpu p50",
                    "filtered (source = 1 of 20) p50 / p95",
                    "filtered cpu p50",
                    "postings per query",
                    "after load p50 / cpu p50",
                ],
                rows,
            )
        )
        proj = bm25_projection(results)
        if proj and proj["from_n"] < 1_000_000:
            parts.append(
                f"Linear projection to 1M chunks from {fmt_n(proj['from_n'])}: build process peak "
                f"{gib(proj['build_process_peak'])} GiB (of which the caller's TextNodes {gib(proj['caller_nodes'])} GiB), "
                f"retriever held after build {gib(proj['retriever_steady'])} GiB, loaded index "
                f"{gib(proj.get('loaded_steady'))} GiB; build {proj['build_cpu_s'] / 60:.1f} CPU min "
                f"(tokenize {proj['tokenize_cpu_s'] / 60:.1f}), one insert_nodes {proj['insert_cpu_s'] / 60:.1f} CPU min, "
                f"load {proj.get('load_cpu_s', float('nan')) / 60:.1f} CPU min, on disk {gib(proj['persist_bytes'])} GiB."
            )
    if raws:
        rows = []
        for r in raws:
            ph = r["phases"]
            rows.append(
                [
                    fmt_n(r["n"]),
                    f"{ph['tokenize']['seconds']:.0f} / {ph['tokenize']['cpu_seconds']:.0f}",
                    f"{ph['index']['seconds']:.0f} / {ph['index']['cpu_seconds']:.0f}",
                    gib(ph["tokenize"]["peak_delta_bytes"]),
                    gib(ph["index"]["peak_delta_bytes"]),
                    gib(r["steady_rss"] - r["base_rss"]),
                    gib(r["process_peak_rss"]),
                    mib(r["persist_bytes"]),
                    f"{ms(r['query'])} / {ms(r['query'], 'p95_ms')}",
                    ms(r["query"], "cpu_p50_ms"),
                ]
            )
        parts.append(
            "Raw bm25s (bm25s.tokenize + BM25.index on the same texts; no TextNodes, no token cache)\n\n"
            + table(
                [
                    "chunks",
                    "tokenize wall / cpu s",
                    "index wall / cpu s",
                    "tokenize peak Δ GiB",
                    "index peak Δ GiB",
                    "held after index Δ GiB",
                    "process peak GiB",
                    "saved MiB",
                    "query p50 / p95 ms",
                    "query cpu p50 ms",
                ],
                rows,
            )
        )
    grow = _ok(results, "qdrant_grow")
    opens = {r["n"]: r for r in _ok(results, "qdrant_open")}
    if grow:
        steps = grow[-1]["steps"]
        rows = []
        for st in steps:
            o = opens.get(st["n"])
            rows.append(
                [
                    fmt_n(st["n"]),
                    f"{st['durable_points_per_s']:.0f}" if st["durable_points_per_s"] else "-",
                    f"{st['bulk_points_per_s']:.0f} / {st['bulk_points_per_cpu_s']:.0f}" if st["bulk_points_per_s"] else "-",
                    f"{st['prepare_points_per_s']:.0f}" if st["prepare_points_per_s"] else "-",
                    mib(st["disk_bytes"]),
                    gib(st["rss_delta"]),
                    f"{o['phases']['open']['seconds']:.0f} / {o['phases']['open']['cpu_seconds']:.0f}" if o else "-",
                    gib(o["rss_after_open"] - o["base_rss"]) if o else "-",
                ]
            )
        parts.append(
            "Qdrant local mode on disk (HybridIndex schema: dense 384-d + BM25 sparse + node payload): ingest, size, reopen\n\n"
            + table(
                [
                    "points",
                    "durable upsert pts/s (default, fsync per point)",
                    "upsert pts/s with fsync off (wall / per CPU s)",
                    "make points pts/s (tokenize, payload)",
                    "on disk MiB",
                    "RSS Δ GiB",
                    "reopen wall / cpu s (fresh process)",
                    "RSS Δ after reopen GiB",
                ],
                rows,
            )
        )
        rows = []
        for st in steps:
            rows.append(
                [
                    fmt_n(st["n"]),
                    f"{ms(st['dense'])} / {ms(st['dense'], 'p95_ms')}",
                    ms(st["dense"], "cpu_p50_ms"),
                    f"{ms(st['dense_filtered'])} / {ms(st['dense_filtered'], 'cpu_p50_ms')} (n={st['dense_filtered']['n']})",
                    f"{ms(st['sparse'])} / {ms(st['sparse'], 'cpu_p50_ms')} (n={st['sparse']['n']})",
                    f"{ms(st['hybrid_rrf'])} / {ms(st['hybrid_rrf'], 'cpu_p50_ms')} (n={st['hybrid_rrf']['n']})",
                ]
            )
        parts.append(
            "Qdrant local mode query latency (top 10; ms)\n\n"
            + table(
                [
                    "points",
                    f"dense p50 / p95 ({QUERY_COUNT} q)",
                    "dense cpu p50",
                    "dense + doc_id filter p50 / cpu",
                    "sparse (BM25, IDF) p50 / cpu",
                    "hybrid RRF (2 prefetch) p50 / cpu",
                ],
                rows,
            )
        )
    ds = sorted(results.get("dense_sweep", []), key=lambda r: r["n"])
    if ds:
        rows = []
        for r in ds:
            if "aborted" in r:
                rows.append([fmt_n(r["n"]), "aborted: " + r["aborted"], "", "", ""])
                continue
            rows.append(
                [
                    fmt_n(r["n"]),
                    f"{ms(r['dense'])} / {ms(r['dense'], 'p95_ms')} (n={r['dense']['n']})",
                    ms(r["dense"], "cpu_p50_ms"),
                    f"{ms(r['dense_filtered'])} / {ms(r['dense_filtered'], 'cpu_p50_ms')}" if r["dense_filtered"] else "-",
                    gib(r["rss"] - r["base_rss"]),
                ]
            )
        parts.append(
            "Qdrant local mode, dense only, larger sizes (in-memory state filled directly, queried via query_points; ms)\n\n"
            + table(["points", "p50 / p95", "cpu p50", "doc_id filter p50 / cpu", "RSS Δ GiB"], rows)
        )
    fit = dense_fit(results)
    if fit:
        parts.append(
            "Dense query p50 vs points, least squares over all dense rows above: "
            + "; ".join(
                f"{label}: {a:.0f} ms + {b:.0f} ms per 100k points, "
                + ", ".join(f"{t} ms at ~{fmt_n(c)}" if c > 0 else f"{t} ms: intercept already above" for t, c in ((50, c50), (200, c200)))
                for label, (a, b, c50, c200) in fit.items()
            )
        )
    skipped = results.get("skipped", [])
    if skipped:
        parts.append("Skipped / aborted:\n" + "\n".join(f"- {s}" for s in skipped))
    return "\n\n".join(parts)


def dense_fit(results: Dict[str, Any]) -> Dict[str, Tuple[float, float, int, int]]:
    pts: List[Tuple[int, Dict[str, float]]] = []
    for g in _ok(results, "qdrant_grow"):
        pts += [(st["n"], st["dense"]) for st in g["steps"]]
    pts += [(r["n"], r["dense"]) for r in _ok(results, "dense_sweep")]
    if len({n for n, _ in pts}) < 2:
        return {}
    out = {}
    x = np.array([n for n, _ in pts], dtype=float)
    for label, key in (("wall", "p50_ms"), ("cpu", "cpu_p50_ms")):
        y = np.array([d[key] for _, d in pts])
        b, a = np.polyfit(x, y, 1)
        if b <= 0:
            continue
        cross = [int(round((t - a) / b / 1000) * 1000) for t in (50, 200)]
        out[label] = (a, b * 100_000, cross[0], cross[1])
    return out


# ============================================================================ main
def machine() -> Dict[str, Any]:
    import bm25s
    from importlib.metadata import version

    return {
        "cpus": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / GIB, 1),
        "python": platform.python_version(),
        "bm25s": bm25s.__version__,
        "qdrant_client": version("qdrant-client"),
        "llama_index_core": version("llama-index-core"),
        "loadavg_start": os.getloadavg(),
    }


def parse_sizes(s: str) -> List[int]:
    out = []
    for part in s.split(","):
        part = part.strip().lower().replace("_", "")
        if not part:
            continue
        mult = 1_000_000 if part.endswith("m") else 1000 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("mk")) * mult))
    return sorted(set(out))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100000,1000000", help="BM25 chunk counts (default 100000,1000000)")
    ap.add_argument(
        "--fallback-size",
        type=int,
        default=300_000,
        help="when our retriever at a size is projected past the memory limit, measure it here instead "
        "(and raw bm25s at the size itself); 0 disables",
    )
    ap.add_argument("--raw-sizes", default=None, help="raw bm25s sizes (default: the smallest of --sizes plus any size skipped for ours)")
    ap.add_argument("--qdrant-sizes", default="10000,50000,100000", help="Qdrant on-disk collection sizes (one collection grown through them)")
    ap.add_argument("--dense-sizes", default="100000,200000,400000,800000", help="dense-only sweep sizes")
    ap.add_argument("--parts", default="bm25,qdrant,dense", help="any of bm25,qdrant,dense")
    ap.add_argument("--durable-points", type=int, default=500, help="points per Qdrant size inserted with default SQLite sync")
    ap.add_argument("--mem-limit-gib", type=float, default=10.0, help="kill a measurement whose RSS passes this")
    ap.add_argument("--timeout", type=float, default=2400.0, help="kill a measurement running longer (s)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp dir, removed)")
    ap.add_argument("--json", type=Path, default=None, help="also write all results as JSON here")
    ap.add_argument("--report-from", default=None, help="only print the tables of earlier --json files (comma-separated, merged)")
    # internal: one measurement in a child process
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--steps", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        if args.worker == "qdrant_grow":
            worker_qdrant_grow(parse_sizes(args.steps), args.workdir, args.durable_points)
        else:
            WORKERS[args.worker](args.n, args.workdir)
        return 0

    if args.report_from:
        merged: Dict[str, Any] = {"skipped": []}
        for f in args.report_from.split(","):
            data = json.loads(Path(f).read_text())
            for k, v in data.items():
                if isinstance(v, list):
                    merged.setdefault(k, []).extend(v)
                elif k not in merged:
                    merged[k] = v
        measured = {
            (r["kind"], r["n"])
            for k, v in merged.items()
            if isinstance(v, list) and k != "skipped"
            for r in v
            if isinstance(r, dict) and "aborted" not in r
        }
        # a size skipped in one run but measured in another is not skipped
        merged["skipped"] = [x for x in merged["skipped"] if not any(f"{kind} at {n:,}:" in x for kind, n in measured)]
        print(report(merged))
        return 0

    parts = {p.strip() for p in args.parts.split(",")}
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rkit-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    mem_limit = int(args.mem_limit_gib * GIB)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f}s] {msg}", flush=True)

    runner = Runner(mem_limit, args.timeout, workdir, log)
    results: Dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "skipped": []}
    log(f"machine: {results['machine']}; scratch: {workdir}")

    def add(r: Dict[str, Any]) -> Dict[str, Any]:
        results.setdefault(r["kind"], []).append(r)
        if "aborted" in r:
            results["skipped"].append(f"{r['kind']} at {r['n']:,}: {r['aborted']}")
        return r

    def fits(kind: str, n: int) -> bool:
        """Project the peak RSS linearly (above the bare process) from the largest smaller size; 10 % margin."""
        done = [r for r in _ok(results, kind) if r["n"] < n]
        if not done:
            return True
        ref = done[-1]
        base = ref.get("base_rss", 0)
        projected = base + (ref["process_peak_rss"] - base) * n / ref["n"]
        if projected > 0.9 * mem_limit:
            results["skipped"].append(
                f"{kind} at {n:,}: projected peak RSS {projected / GIB:.1f} GiB (from {ref['process_peak_rss'] / GIB:.2f} GiB "
                f"at {ref['n']:,}) > 90 % of the {mem_limit / GIB:.1f} GiB limit"
            )
            log("  skip: " + results["skipped"][-1])
            return False
        return True

    def bm25_at(n: int) -> bool:
        if not fits("bm25_build", n):
            return False
        log(f"BM25Retriever at {n:,} chunks")
        r = add(runner.run("bm25_build", n))
        if "aborted" in r:
            return False
        add(runner.run("bm25_load", n))
        shutil.rmtree(workdir / f"bm25-{n}", ignore_errors=True)
        return True

    try:
        if "bm25" in parts:
            sizes = parse_sizes(args.sizes)
            raw = parse_sizes(args.raw_sizes) if args.raw_sizes is not None else sizes[:1]
            for n in sizes:
                if not bm25_at(n):
                    fb = args.fallback_size
                    if fb and fb < n and fb not in {r["n"] for r in results.get("bm25_build", [])}:
                        bm25_at(fb)
                    if args.raw_sizes is None and n not in raw:
                        raw.append(n)
            for n in sorted(set(raw)):
                if fits("bm25s_raw", n):
                    log(f"raw bm25s at {n:,} chunks")
                    add(runner.run("bm25s_raw", n))
        if "qdrant" in parts:
            steps = parse_sizes(args.qdrant_sizes)
            log(f"Qdrant local mode, one collection grown through {steps}")
            r = add(runner.run("qdrant_grow", max(steps), "--steps", ",".join(map(str, steps)), "--durable-points", str(args.durable_points)))
            if "aborted" not in r:
                add(runner.run("qdrant_open", max(steps)))
            shutil.rmtree(workdir / "qdrant", ignore_errors=True)
        if "dense" in parts:
            for n in parse_sizes(args.dense_sizes):
                if not fits("dense_sweep", n):
                    continue
                log(f"dense-only sweep at {n:,} points")
                add(runner.run("dense_sweep", n))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    results["machine"]["loadavg_end"] = os.getloadavg()
    results["total_seconds"] = time.perf_counter() - t_start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    results["children_cpu_seconds"] = children.ru_utime + children.ru_stime
    results["bm25_projection_1m"] = bm25_projection(results)
    results["dense_fit"] = dense_fit(results)
    text = report(results)
    print("\n" + text)
    la0, la1 = results["machine"]["loadavg_start"], results["machine"]["loadavg_end"]
    print(f"\ntotal {results['total_seconds'] / 60:.1f} min wall, {results['children_cpu_seconds'] / 60:.1f} CPU min; load average (1 min) {la0[0]:.1f} at start, {la1[0]:.1f} at end")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
