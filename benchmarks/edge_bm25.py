"""Where should the BM25 leg run? Three candidates on the same chunks (issue 11, section 1):

  (a) ``bm25s``: the index's in-process BM25 (``as_retriever("sparse")``);
  (b) ``edge-sparse-idf``: the index's own Edge shard, sparse BM25 vectors with ``Modifier.IDF``
      searched alone (the sparse prefetch of ``qdrant_hybrid``: ``HybridIndex.store.search`` with
      no dense vector and ``bm25_query_vector`` of the index tokenizer's terms);
  (c) ``edge-text``: Qdrant Edge's own scored full-text index (``TextIndexParams(scoring=True)``
      on a ``text`` payload field + ``TextQuery``), in a separate Edge shard built here in a temp
      dir from the same chunks and the same payloads (plus the chunk text). Its tokenizer options
      (stopwords, stemmer, minimum token length; lowercase and the ``Word`` tokenizer always) are
      chosen on the tuning split (SciFact train, NFCorpus dev); test is run once with the choice.

    nice -n 10 .venv/bin/python benchmarks/edge_bm25.py [--datasets scifact nfcorpus] [--json benchmarks/results/edge_bm25.json]

Chunks: those of the cached default index (benchmarks/no_answer.py ``open_index``; default
chunking, nothing embedded here). BM25 k1/b are the index's for all three legs. Documents: a
document's score is its best chunk's; every leg returns ``--depth`` chunks (default 130, so that
100 documents fill up). Latency: one query at a time, the three legs back to back per query in
rotating order, wall-clock ms including tokenizing the query and reading the results' payloads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C  # noqa: E402
import no_answer  # noqa: E402

TEXT_FIELD = "text"
UPSERT_BATCH = 512

# One leg: query text -> (doc id, score) per chunk, best first.
Leg = Callable[[str], List[Tuple[str, float]]]


# ------------------------------------------------------------------------------- Edge text index
def text_index_options() -> Dict[str, Dict[str, Any]]:
    """The tokenizer options tried for Edge's text index (name -> TextIndexParams kwargs)."""
    import bm25s.stopwords as bm25s_stopwords
    import qdrant_edge as qe

    stopwords = {
        "none": None,
        "edge-english": qe.Language.English,
        "bm25s-en": qe.StopwordsSet(custom=set(bm25s_stopwords.STOPWORDS_EN)),  # the index tokenizer's list
    }
    stemmers = {"none": qe.DisabledStemmer(), "snowball-en": qe.SnowballParams(qe.SnowballLanguage.English)}
    options = {}
    for (sw_name, sw), (st_name, st), min_len in itertools.product(stopwords.items(), stemmers.items(), (None, 2)):
        name = f"stop={sw_name} stem={st_name} min_len={min_len or 1}"
        options[name] = {"stopwords": sw, "stemmer": st, "min_token_len": min_len}
    return options


class EdgeTextShard:
    """A Qdrant Edge shard holding the index's chunks with their payloads plus the chunk text in
    ``text``, ranked by Edge's BM25 over a scored text index on that field."""

    def __init__(self, folder: Path, payloads: Sequence[Mapping[str, Any]], point_ids: Sequence[str]) -> None:
        import qdrant_edge as qe

        self._qe = qe
        # Edge wants at least one vector; the points carry an empty sparse vector there.
        config = qe.EdgeConfig(sparse_vectors={"unused": qe.EdgeSparseVectorParams()})
        self.shard = qe.EdgeShard.create(str(folder), config)
        for start in range(0, len(payloads), UPSERT_BATCH):
            points = [
                qe.Point(pid, {"unused": qe.SparseVector([], [])}, dict(payload))
                for pid, payload in zip(point_ids[start : start + UPSERT_BATCH], payloads[start : start + UPSERT_BATCH])
            ]
            self.shard.update(qe.UpdateOperation.upsert_points(points))
        self.shard.flush()
        self.indexed = False

    def index_text(self, options: Mapping[str, Any]) -> float:
        """(Re)build the scored text index on ``text`` with ``options``; seconds taken."""
        qe = self._qe
        t0 = time.perf_counter()
        if self.indexed:
            self.shard.update(qe.UpdateOperation.delete_field_index(TEXT_FIELD))
        params = qe.TextIndexParams(tokenizer=qe.TokenizerType.Word, lowercase=True, scoring=True, **options)
        self.shard.update(qe.UpdateOperation.create_field_index(TEXT_FIELD, params))
        self.indexed = True
        return time.perf_counter() - t0

    def leg(self, depth: int, k1: float, b: float) -> Leg:
        qe = self._qe
        scoring = qe.Bm25Params(k=k1, b=b)
        without_text = qe.PayloadSelector.Exclude([TEXT_FIELD])  # return what the index's store returns

        def search(query: str) -> List[Tuple[str, float]]:
            request = qe.QueryRequest(limit=depth, query=qe.TextQuery(TEXT_FIELD, query, scoring), with_payload=without_text)
            hits = [(dict(p.payload or {}), float(p.score)) for p in self.shard.query(request)]
            return [(payload["doc_id"], score) for payload, score in hits]

        return search

    def close(self) -> None:
        self.shard.close()


# ------------------------------------------------------------------------------- the other legs
def bm25s_leg(index: Any, depth: int) -> Leg:
    from llama_index.core.schema import QueryBundle

    retriever = index.as_retriever("sparse", similarity_top_k=depth)

    def search(query: str) -> List[Tuple[str, float]]:
        return [(C.node_doc_id(r.node), float(r.score)) for r in retriever.retrieve(QueryBundle(query))]

    return search


def edge_sparse_leg(index: Any, depth: int) -> Leg:
    from llama_index_retrieval_kit.retrievers.qdrant_hybrid import bm25_query_vector

    def search(query: str) -> List[Tuple[str, float]]:
        sparse = bm25_query_vector(index.bm25.tokenize(query))
        return [(payload["doc_id"], score) for payload, score in index.store.search(None, sparse, limit=depth)]

    return search


# ------------------------------------------------------------------------------- measuring
def run_legs(legs: Mapping[str, Leg], data: C.BeirData) -> Dict[str, Dict[str, float]]:
    """nDCG@10, R@100 (documents) and p50 ms of each leg; per query the legs run back to back,
    their order rotating from one query to the next."""
    names = list(legs)
    runs: Dict[str, Dict[str, List[Tuple[str, float]]]] = {n: {} for n in names}
    times: Dict[str, List[float]] = {n: [] for n in names}
    for i, (qid, text) in enumerate(data.queries.items()):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            hits = legs[name](text)
            times[name].append((time.perf_counter() - t0) * 1000)
            runs[name][qid] = C.docs_from_chunks(hits)
    out = {}
    for name in names:
        metrics = C.evaluate(runs[name], data.qrels)
        out[name] = {"ndcg@10": metrics["ndcg@10"], "recall@100": metrics["recall@100"], "p50_ms": statistics.median(times[name])}
    return out


def limited(data: C.BeirData, limit: int) -> C.BeirData:
    if not limit:
        return data
    queries = dict(list(data.queries.items())[:limit])
    return C.BeirData(data.name, data.corpus, queries, {q: data.qrels[q] for q in queries}, data.split)


def check_same_text(index: Any, nodes: Sequence[Any], texts: Sequence[str]) -> None:
    """The text given to Edge must be what the BM25 index tokenized (else the comparison is off)."""
    for node, text in zip(nodes[:200], texts[:200]):
        if index.bm25.node_tokens(node) != index.bm25.tokenize(text):
            raise RuntimeError(f"chunk {node.node_id}: the BM25 index tokenized other text than get_content() gives")


def run_dataset(name: str, depth: int, limit: int, log: Callable[[str], None]) -> Dict[str, Any]:
    from llama_index.core.schema import MetadataMode

    from llama_index_retrieval_kit.indices.store import node_payload, point_id

    folder = C.DEFAULT_BEIR / name
    corpus = C.read_corpus(folder)
    tune_split = C.tuning_splits(folder)[0]
    splits = {s: limited(C.load_split(folder, s, corpus), limit) for s in (tune_split, "test")}
    result: Dict[str, Any] = {"dataset": name, "tune_split": tune_split, "rows": [], "options": []}
    with no_answer.open_index(folder) as index, tempfile.TemporaryDirectory(prefix="edge_bm25_") as tmp:
        k1, b = index.bm25.params["k1"], index.bm25.params["b"]
        nodes = index.bm25.nodes
        texts = [n.get_content(metadata_mode=MetadataMode.NONE) for n in nodes]
        check_same_text(index, nodes, texts)
        t0 = time.perf_counter()
        payloads = [{**node_payload(n), TEXT_FIELD: t} for n, t in zip(nodes, texts)]
        edge = EdgeTextShard(Path(tmp) / "shard", payloads, [point_id(n.node_id) for n in nodes])
        log(f"{name}: {len(nodes)} chunks, k1={k1} b={b}; Edge text shard written in {time.perf_counter() - t0:.1f} s")
        try:
            # (c) tokenizer options, on the tuning split only
            options = text_index_options()
            for option, kwargs in options.items():
                secs = edge.index_text(kwargs)
                scores = run_legs({"edge-text": edge.leg(depth, k1, b)}, splits[tune_split])["edge-text"]
                result["options"].append({"option": option, "index_s": secs, **scores})
                log(f"{name} {tune_split} edge-text [{option}] index {secs:.1f}s " + fmt(scores))
            best = max(result["options"], key=lambda r: r["ndcg@10"])
            result["best_option"] = best["option"]
            edge.index_text(options[best["option"]])
            legs = {
                "bm25s (as_retriever('sparse'))": bm25s_leg(index, depth),
                "Edge sparse + IDF modifier": edge_sparse_leg(index, depth),
                f"Edge text index [{best['option']}]": edge.leg(depth, k1, b),
            }
            for split, data in splits.items():
                for leg, scores in run_legs(legs, data).items():
                    result["rows"].append({"dataset": name, "split": split, "queries": len(data.queries), "leg": leg, **scores})
                    log(f"{name} {split} {leg}: " + fmt(scores))
        finally:
            edge.close()
    return result


def fmt(scores: Mapping[str, float]) -> str:
    return f"nDCG@10={scores['ndcg@10']:.4f} R@100={scores['recall@100']:.4f} p50={scores['p50_ms']:.2f}ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["scifact", "nfcorpus"])
    parser.add_argument("--depth", type=int, default=130, help="chunks each leg returns (default 130)")
    parser.add_argument("--limit", type=int, default=0, help="first N queries of each split only (0: all)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    if args.depth < 100:
        parser.error(f"--depth must be >= 100 (R@100 needs 100 documents), got {args.depth}")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    results = [run_dataset(name, args.depth, args.limit, log) for name in args.datasets]
    load = os.getloadavg()
    for res in results:
        print(f"\n{res['dataset']} {res['tune_split']}: Edge text index options (best: {res['best_option']})\n")
        print("| option | nDCG@10 | R@100 | p50 ms | index s |\n|---|---:|---:|---:|---:|")
        for row in res["options"]:
            print(f"| {row['option']} | {row['ndcg@10']:.4f} | {row['recall@100']:.4f} | {row['p50_ms']:.2f} | {row['index_s']:.1f} |")
    print("\n| dataset | split | leg | nDCG@10 | R@100 | p50 ms |\n|---|---|---|---:|---:|---:|")
    for res in results:
        for row in res["rows"]:
            print(f"| {row['dataset']} | {row['split']} ({row['queries']} q) | {row['leg']} | {row['ndcg@10']:.4f} | {row['recall@100']:.4f} | {row['p50_ms']:.2f} |")
    print(f"\nload average at the end (1/5/15 min): {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} on {os.cpu_count()} cores: latencies are indicative only")
    if args.json:
        args.json.write_text(json.dumps({"depth": args.depth, "loadavg": load, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
