"""EdgePoints (Qdrant Edge) against qdrant-client's local mode, same random data, same run.

    .venv/bin/python benchmarks/edge_store.py                 # 20k points (Edge), 2k (local mode)
    .venv/bin/python benchmarks/edge_store.py --points 100000 --local-points 5000

Prints upsert points/s, dense top-100 p50 ms and filtered (``tenant == t``) dense top-100 p50 ms.
Local mode writes about 50-70 points/s (one SQLite commit per point), so it gets fewer points by
default to keep the run under two minutes; its query times are at ``--local-points``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
from llama_index.core.schema import TextNode
from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_index_retrieval_kit.indices.store import EdgePoints, node_payload, point_id  # noqa: E402

logger = logging.getLogger("edge_store_bench")
TENANTS = 20


def _data(n: int, dim: int, seed: int):
    rng = np.random.default_rng(seed)
    vectors = rng.normal(size=(n, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    sparse = [{int(t): 1.0 for t in rng.choice(30_000, 40, replace=False)} for _ in range(n)]
    nodes = [
        TextNode(id_=str(uuid.UUID(int=i + 1)), text=f"chunk {i}", metadata={"tenant": f"t{i % TENANTS}", "n": i})
        for i in range(n)
    ]
    return nodes, vectors, sparse, rng.normal(size=(50, dim)).astype(np.float32)


def _p50_ms(run: Callable[[np.ndarray], object], queries: np.ndarray) -> float:
    run(queries[0])
    times = []
    for query in queries:
        start = time.perf_counter()
        run(query)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def bench_edge(folder: Path, n: int, dim: int) -> Dict[str, float]:
    nodes, vectors, sparse, queries = _data(n, dim, 0)
    store = EdgePoints(folder / "edge")
    store.create(dim)
    only = MetadataFilters(filters=[MetadataFilter(key="tenant", value="t3")])
    start = time.perf_counter()
    store.upsert_points([point_id(n.node_id) for n in nodes], vectors, sparse, [node_payload(n) for n in nodes])
    store.flush()
    upsert_s = time.perf_counter() - start
    start = time.perf_counter()
    store.optimize()
    optimize_s = time.perf_counter() - start
    tenant = store.metadata_filter(only, nodes)  # translated for the engine; creates the tenant payload index
    result = {
        "points": n,
        "upsert points/s": n / upsert_s,
        "optimize s": optimize_s,
        "dense top-100 ms": _p50_ms(lambda q: store.search(q.tolist(), limit=100), queries),
        "filtered top-100 ms": _p50_ms(lambda q: store.search(q.tolist(), limit=100, filter=tenant), queries),
    }
    store.close()
    return result


def bench_local(folder: Path, n: int, dim: int) -> Dict[str, float]:
    from qdrant_client import QdrantClient, models

    nodes, vectors, _, queries = _data(n, dim, 0)
    client = QdrantClient(path=str(folder / "local"))
    client.create_collection("chunks", vectors_config={"d": models.VectorParams(size=dim, distance=models.Distance.COSINE)})
    points = [
        models.PointStruct(id=node.node_id, vector={"d": vectors[i].tolist()}, payload={"metadata": node.metadata})
        for i, node in enumerate(nodes)
    ]
    start = time.perf_counter()
    client.upsert("chunks", points)
    upsert_s = time.perf_counter() - start
    only = models.Filter(must=[models.FieldCondition(key="metadata.tenant", match=models.MatchValue(value="t3"))])

    def query(q: np.ndarray, flt=None) -> object:
        return client.query_points("chunks", query=q.tolist(), using="d", limit=100, query_filter=flt)

    result = {
        "points": n,
        "upsert points/s": n / upsert_s,
        "optimize s": 0.0,
        "dense top-100 ms": _p50_ms(query, queries[:20]),
        "filtered top-100 ms": _p50_ms(lambda q: query(q, only), queries[:20]),
    }
    client.close()
    return result


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=20_000)
    parser.add_argument("--local-points", type=int, default=2_000, help="points for qdrant-client local mode (0: skip)")
    parser.add_argument("--dim", type=int, default=384)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows["qdrant-edge EdgePoints"] = bench_edge(Path(tmp), args.points, args.dim)
        if args.local_points:
            rows["qdrant-client local mode"] = bench_local(Path(tmp), args.local_points, args.dim)
    columns = ["points", "upsert points/s", "optimize s", "dense top-100 ms", "filtered top-100 ms"]
    lines = ["| system | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:,.0f}" if c == "points" else f"{row[c]:,.2f}" for c in columns) + " |")
    logger.info("\n".join(lines))


if __name__ == "__main__":
    main()
