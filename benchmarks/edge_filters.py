"""Filtered Qdrant-side queries: metadata filters translated for the engine against the id-list
filter they replace, same index, same queries, same run.

    python benchmarks/edge_filters.py --docs 20000
    python benchmarks/edge_filters.py --docs 20000 --server   # also a server transport (local mode)

N one-chunk documents with a ``tenant`` key of 20 values and a ``year`` key of 25 values,
embedded by a constant-cost stand-in: a random unit vector (384-d) seeded by the text's hash
(``MockEmbedding`` gives every text one vector, and ties make the two routes' orders differ). For ``qdrant_hybrid`` and
``dense_search="qdrant"``, per filter: p50 ms with the translated filter (what ``HybridIndex``
now sends; route ``engine``) and with the id list of the matching chunks (what it sent before),
each with the query embedding given; and the first query's cost of building each filter
(translation + one count + creating the key's payload index, vs ``metadata_matches`` over every
chunk). ``--server`` pushes the index to qdrant-client's local mode and adds LlamaIndex's own
``QdrantVectorStore`` retriever (its filter translation) on the same collection; local mode is
numpy, so those rows show request shapes, not a server's speed. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_index.core import Document  # noqa: E402
import numpy as np  # noqa: E402
from llama_index.core.embeddings import BaseEmbedding  # noqa: E402
from llama_index.core.schema import QueryBundle  # noqa: E402
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters  # noqa: E402

from llama_index_retrieval_kit.indices import HybridIndex  # noqa: E402
from llama_index_retrieval_kit.retrievers import metadata_matches  # noqa: E402
from llama_index_retrieval_kit.retrievers.qdrant_hybrid import QdrantDenseRetriever, QdrantHybridRetriever  # noqa: E402

WORDS = "fee rate annual payment card credit late interest balance statement account limit cash advance penalty".split()
F = MetadataFilter
FILTERS: Dict[str, MetadataFilters] = {
    "tenant == t3 (5%)": MetadataFilters(filters=[F(key="tenant", value="t3")]),
    "tenant in 10 of 20 (50%)": MetadataFilters(filters=[F(key="tenant", value=[f"t{i}" for i in range(0, 20, 2)], operator=FilterOperator.IN)]),
    "tenant != t3 (95%)": MetadataFilters(filters=[F(key="tenant", value="t3", operator=FilterOperator.NE)]),
    "year >= 2020 and tenant in 3 (3%)": MetadataFilters(
        filters=[F(key="year", value=2020, operator=FilterOperator.GTE), F(key="tenant", value=["t1", "t2", "t5"], operator=FilterOperator.IN)]
    ),
    "not (tenant == t3 or year < 2005) (76%)": MetadataFilters(
        filters=[MetadataFilters(filters=[F(key="tenant", value="t3"), F(key="year", value=2005, operator=FilterOperator.LT)], condition=FilterCondition.OR)],
        condition=FilterCondition.NOT,
    ),
}


class HashEmbedding(BaseEmbedding):
    """A random unit vector per text, seeded by its blake2b hash (same in every process)."""

    @classmethod
    def class_name(cls) -> str:
        return "HashEmbedding"

    def _vector(self, text: str) -> List[float]:
        seed = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
        vec = np.random.default_rng(seed).standard_normal(384)
        return (vec / np.linalg.norm(vec)).tolist()

    def _get_text_embedding(self, text: str) -> List[float]:
        return self._vector(text)

    def _get_query_embedding(self, query: str) -> List[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> List[float]:
        return self._vector(query)


def documents(n: int, seed: int = 0) -> List[Document]:
    rng = random.Random(seed)
    return [
        Document(
            id_=f"doc-{i}",
            text=" ".join(rng.choice(WORDS) + str(rng.randrange(500)) for _ in range(60)),
            metadata={"tenant": f"t{i % 20}", "year": 2000 + (i * 7) % 25},
        )
        for i in range(n)
    ]


def p50_ms(run: Callable[[QueryBundle], Any], queries: List[QueryBundle]) -> float:
    run(queries[0])
    times = []
    for qb in queries:
        start = time.perf_counter()
        run(qb)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def same_ranking(got: List[Tuple[str, float]], want: List[Tuple[str, float]], tol: float = 1e-6) -> bool:
    """Equal scores position by position, and equal ids up to the order within tied scores (the
    last tie group may straddle the cut)."""
    if len(got) != len(want) or any(abs(g[1] - w[1]) > tol for g, w in zip(got, want)):
        return False
    groups: List[List[int]] = []
    for i, (_, score) in enumerate(want):
        if groups and abs(score - want[groups[-1][0]][1]) <= tol:
            groups[-1].append(i)
        else:
            groups.append([i])
    return all({got[i][0] for i in g} == {want[i][0] for i in g} for g in groups[:-1])


def id_list(index: HybridIndex, filters: MetadataFilters) -> Any:
    """The filter HybridIndex sent before: the ids of the matching chunks (the shorter list)."""
    allowed: List[str] = []
    excluded: List[str] = []
    for node in index.bm25.snapshot.nodes:
        (allowed if metadata_matches(node.metadata, filters) else excluded).append(node.node_id)
    return index.store.ids_filter(allowed, excluded)


def retrievers(index: HybridIndex, filters: MetadataFilters, point_filter: Any) -> Dict[str, Any]:
    common = {"similarity_top_k": 10, "filters": filters, "point_filter": lambda: point_filter}
    return {
        "qdrant_hybrid": QdrantHybridRetriever(index.store, index.config["collection"], index.embed_model, index.bm25.tokenize, **common),
        "dense (engine)": QdrantDenseRetriever(index.store, index.config["collection"], index.embed_model, **common),
    }


def measure(index: HybridIndex, queries: List[QueryBundle], where: str) -> List[Tuple[str, ...]]:
    rows = []
    nodes = index.bm25.snapshot.nodes
    for name, filters in FILTERS.items():
        start = time.perf_counter()
        engine = index.store.metadata_filter(filters, nodes)  # the first query's filter (creates the key's index)
        engine_build = (time.perf_counter() - start) * 1000
        start = time.perf_counter()
        ids = id_list(index, filters)
        ids_build = (time.perf_counter() - start) * 1000
        matching = sum(metadata_matches(n.metadata, filters) for n in nodes)
        by_route = {"translated": retrievers(index, filters, engine), "id list": retrievers(index, filters, ids)}
        for mode in by_route["translated"]:
            for qb in queries[:5]:
                got = [[(r.node.node_id, r.score) for r in rs[mode].retrieve(qb)] for rs in by_route.values()]
                if not same_ranking(*got):
                    raise AssertionError(f"{where} {mode} {name}: the two routes disagree: {got}")
            cells = [f"{p50_ms(rs[mode].retrieve, queries):.2f}" for rs in by_route.values()]
            rows.append((where, mode, name, f"{matching:,}", engine.route.value, *cells, f"{engine_build:.1f} / {ids_build:.1f}"))
    return rows


def llamaindex_rows(index: HybridIndex, client: Any, queries: List[QueryBundle]) -> List[Tuple[str, ...]]:
    """LlamaIndex's own QdrantVectorStore retriever on the pushed collection (its filter translation)."""
    from llama_index.core import VectorStoreIndex
    from llama_index.vector_stores.qdrant import QdrantVectorStore

    store = QdrantVectorStore(client=client, collection_name=index.config["collection"], dense_vector_name="text-dense")
    li_index = VectorStoreIndex.from_vector_store(store, embed_model=index.embed_model)
    rows = []
    for name, filters in list(FILTERS.items())[:3]:
        retriever = li_index.as_retriever(similarity_top_k=10, filters=filters)
        rows.append(("server (local mode)", "LlamaIndex QdrantVectorStore", name, "", "its own", f"{p50_ms(retriever.retrieve, queries):.2f}", "", ""))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20_000)
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--server", action="store_true", help="also push to qdrant-client's local mode and measure there")
    parser.add_argument("--server-queries", type=int, default=10)
    args = parser.parse_args()
    model = HashEmbedding(model_name="hash-384")
    rng = random.Random(1)
    queries = [
        QueryBundle(q, embedding=model.get_query_embedding(q))
        for q in (" ".join(rng.choice(WORDS) + str(rng.randrange(500)) for _ in range(6)) for _ in range(args.queries))
    ]
    rows: List[Tuple[str, ...]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "index"
        HybridIndex.from_documents(documents(args.docs), path, embed_model=model).close()
        with HybridIndex.load(path, embed_model=model) as index:
            rows += measure(index, queries, "Edge")
            if args.server:
                from qdrant_client import QdrantClient

                from llama_index_retrieval_kit.indices import hybrid_index as hybrid_index_module

                client = QdrantClient(location=":memory:")

                class Shared:  # one in-process "server" outliving the index's client
                    def __getattr__(self, name: str) -> Any:
                        return getattr(client, name)

                    def close(self, **kwargs: Any) -> None:
                        pass

                hybrid_index_module.server_client = lambda url, api_key=None: Shared()
                index.push_to("http://local-mode.invalid:6333")
        if args.server:
            with HybridIndex.load(path, embed_model=model, qdrant_url="http://local-mode.invalid:6333") as served:
                few = queries[: args.server_queries]
                rows += measure(served, few, "server (local mode)")
                rows += llamaindex_rows(served, client, few)
    header = ("store", "mode", "filter", "matching", "route", "translated p50 ms", "id list p50 ms", "filter build ms (translated / id list)")
    print(f"\n{args.docs:,} one-chunk documents, top 10, query embedding given\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
