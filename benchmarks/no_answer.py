"""No-answer gate on BEIR: does the gate keep answerable questions and abstain on the others?

    python benchmarks/no_answer.py --dataset ../shared/datasets/beir/scifact [--json PATH]
    python benchmarks/no_answer.py --dataset ../shared/datasets/beir/nfcorpus --fit-split dev

Data (issue 10, section 3):

* answerable: the split's queries on the full index with the default ``hybrid`` retriever;
* in-domain unanswerable: the same queries with their relevant documents filtered out
  (``doc_id`` NIN relevant, a filter every leg applies);
* off-topic: the bundled ``samples/questions.jsonl`` questions asked of the BEIR index.

The gate is fitted with ``NoAnswerPostprocessor.fit`` on the fit split (SciFact ``train``,
NFCorpus ``dev``) and judged on ``test``. Rows, same run and same retrieval results:

* ours: ``NoAnswerPostprocessor`` (retrieval features of the fused results);
* design-document rule: abstain when the top-1 dense similarity is below the median top-1
  dense similarity of the unanswerable calibration questions;
* LlamaIndex ``SimilarityPostprocessor`` on the dense retriever's results, cutoff picked on the
  fit split so that 95% of answerable questions keep a node (abstain = it drops every node).

Columns: AUROC (answerable vs in-domain unanswerable, test), answerable kept, in-domain
unanswerable abstained, off-topic abstained, added latency per query (the postprocessor alone,
median over the test queries). The index and the retrieval results are cached under
``benchmarks/.cache/`` so a re-run only re-fits.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import _common as C  # noqa: E402  (sets threads and sys.path)
import numpy as np

from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores.types import FilterOperator, MetadataFilter, MetadataFilters

from llama_index_retrieval_kit.postprocessor.no_answer import NoAnswerPostprocessor, abstention_report, auroc
from llama_index_retrieval_kit.retrievers.fusion import FusedNodeWithScore

logger = logging.getLogger("benchmarks.no_answer")
TOP_K = 10
TARGET = 0.95


# ------------------------------------------------------------------------------ index and retrieval
def open_index(folder: Path):
    """The default HybridIndex over the corpus (built once, vectors from the benchmark cache)."""
    from llama_index_retrieval_kit.indices import HybridIndex

    storage = C.CACHE_DIR / f"noanswer_{folder.name}_index"
    if (storage / "index.json").exists():
        return HybridIndex.load(storage, embed_model=C.embed_model())
    corpus = C.read_corpus(folder)
    docs = C.our_documents(corpus)
    nodes = C.our_parser().get_nodes_from_documents(docs)
    C.cached_embeddings([C.embed_text_of(n) for n in nodes], show_progress=True)  # fill the shared cache first
    if storage.exists():
        shutil.rmtree(storage)
    return HybridIndex.from_documents(  # every vector is already computed
        docs, storage, node_parser=C.our_parser(), embed_model=C.embed_model(), show_progress=True, embedding_cache=C.CACHE_FILE
    )


def _pack(results: Sequence[NodeWithScore]) -> List[Dict[str, Any]]:
    return [
        {
            "id": r.node.node_id,
            "doc": C.node_doc_id(r.node),
            "text": r.node.get_content(),
            "score": r.score,
            "ranks": getattr(r, "leg_ranks", None),
            "scores": getattr(r, "leg_scores", None),
        }
        for r in results
    ]


def _unpack(rows: Sequence[Dict[str, Any]]) -> List[NodeWithScore]:
    out: List[NodeWithScore] = []
    for row in rows:
        node = TextNode(id_=row["id"], text=row.get("text", ""), metadata={"doc_id": row["doc"]})
        if row["ranks"] is None:
            out.append(NodeWithScore(node=node, score=row["score"]))
        else:
            out.append(FusedNodeWithScore(node=node, score=row["score"], leg_ranks=row["ranks"], leg_scores=row["scores"]))
    return out


def retrieval_runs(index, folder: Path, splits: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """Per split: {qid: {"query", "hybrid", "excluded", "dense", "dense_excluded"}} packed results."""
    from llama_index_retrieval_kit.evaluation import load_jsonl
    from llama_index_retrieval_kit.samples import QUESTIONS_FILE

    cache = C.CACHE_DIR / f"noanswer_{folder.name}_runs.json"
    runs: Dict[str, Dict[str, Any]] = json.loads(cache.read_text()) if cache.exists() else {}
    embed = C.embed_model()
    hybrid = index.as_retriever("hybrid", similarity_top_k=TOP_K)
    dense = index.as_retriever("dense", similarity_top_k=TOP_K)
    wanted = {s: C.load_split(folder, s).__dict__ for s in splits}
    wanted["offtopic"] = {"queries": dict(load_jsonl(QUESTIONS_FILE).queries), "qrels": {}}
    for split, data in wanted.items():
        if split in runs:
            continue
        out: Dict[str, Any] = {}
        queries = data["queries"]
        vectors = C.cached_embeddings(list(queries.values()))
        t0 = time.perf_counter()
        for (qid, text), vec in zip(queries.items(), vectors):
            qb = lambda: QueryBundle(text, embedding=list(map(float, vec)))  # noqa: E731
            row = {"query": text, "hybrid": _pack(hybrid.retrieve(qb())), "dense": _pack(dense.retrieve(qb()))}
            relevant = sorted(d for d, rel in data["qrels"].get(qid, {}).items() if rel > 0)
            if relevant:
                f = MetadataFilters(filters=[MetadataFilter(key="doc_id", value=relevant, operator=FilterOperator.NIN)])
                row["excluded"] = _pack(index.as_retriever("hybrid", similarity_top_k=TOP_K, filters=f).retrieve(qb()))
                row["dense_excluded"] = _pack(index.as_retriever("dense", similarity_top_k=TOP_K, filters=f).retrieve(qb()))
            out[qid] = row
        print(f"[{folder.name}/{split}] {len(out)} queries retrieved ({time.perf_counter() - t0:.0f}s)", flush=True)
        runs[split] = out
        cache.write_text(json.dumps(runs))
    return runs


# ------------------------------------------------------------------------------ systems
def labelled(run: Dict[str, Any], key: str) -> List[Tuple[str, List[NodeWithScore]]]:
    return [(row["query"], _unpack(row[key])) for row in run.values() if key in row]


def dense_top1(pairs: Sequence[Tuple[str, List[NodeWithScore]]]) -> np.ndarray:
    return np.array([nodes[0].score if nodes else 0.0 for _, nodes in pairs])


def timed(fn, pairs) -> Tuple[np.ndarray, float]:
    """Scores of ``fn`` over ``pairs`` and the median milliseconds per call."""
    scores, times = [], []
    for query, nodes in pairs:
        t0 = time.perf_counter()
        scores.append(fn(query, nodes))
        times.append(time.perf_counter() - t0)
    return np.asarray(scores, dtype=np.float64), float(np.median(times) * 1000)


def evaluate_dataset(folder: Path, fit_split: str) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    from llama_index.core.postprocessor import SimilarityPostprocessor

    index = open_index(folder)
    try:
        runs = retrieval_runs(index, folder, [fit_split, "test"])
    finally:
        index.close()
    fit, test, off = runs[fit_split], runs["test"], runs["offtopic"]
    t_ans, t_una, t_off = labelled(test, "hybrid"), labelled(test, "excluded"), labelled(off, "hybrid")
    rows: List[Dict[str, Any]] = []

    def row(name: str, ans: np.ndarray, una: np.ndarray, offt: np.ndarray, threshold: float, ms: float) -> Dict[str, Any]:
        rep = abstention_report(ans, una, threshold)
        return {
            "system": name,
            "AUROC": rep["auroc"],
            "answerable kept": rep["answerable_kept"],
            "in-domain unanswerable abstained": rep["abstention_recall"],
            "off-topic abstained": float((offt < threshold).mean()),
            "added ms/query": ms,
            "threshold": threshold,
        }

    # ours
    gate = NoAnswerPostprocessor.fit(labelled(fit, "hybrid"), labelled(fit, "excluded"), target_answerable_recall=TARGET)
    conf = lambda q, nodes: gate.confidence(nodes, q)  # noqa: E731
    a, ms = timed(conf, t_ans)
    u, _ = timed(conf, t_una)
    o, _ = timed(conf, t_off)
    rows.append(row("ours: NoAnswerPostprocessor (hybrid, retrieval features)", a, u, o, gate.threshold, ms))
    per_question = [
        {"question": q, "confidence": float(c), "abstained": bool(c < gate.threshold)} for (q, _), c in zip(t_off, o)
    ]
    # design-document rule on the dense top-1 similarity
    d_ans, d_una, d_off = labelled(test, "dense"), labelled(test, "dense_excluded"), labelled(off, "dense")
    rule = float(np.median(dense_top1(labelled(fit, "dense_excluded"))))
    top1 = lambda q, nodes: nodes[0].score if nodes else 0.0  # noqa: E731
    rows.append(row("design-doc rule: median unanswerable dense top-1", dense_top1(d_ans), dense_top1(d_una), dense_top1(d_off), rule, 0.0))
    # LlamaIndex SimilarityPostprocessor, cutoff for 95% answerable kept on the fit split
    from llama_index_retrieval_kit.postprocessor.no_answer import threshold_for_recall

    cutoff = threshold_for_recall(dense_top1(labelled(fit, "dense")), TARGET)
    sim = SimilarityPostprocessor(similarity_cutoff=cutoff)
    kept = lambda q, nodes: float(bool(sim.postprocess_nodes(list(nodes), query_str=q)))  # noqa: E731
    _, sim_ms = timed(kept, d_ans)
    r = row("LlamaIndex SimilarityPostprocessor (dense, cutoff fit for 95%)", dense_top1(d_ans), dense_top1(d_una), dense_top1(d_off), cutoff, sim_ms)
    rows.append(r)
    extra = {"fit_report": gate.fit_report, "offtopic_questions": per_question, "fit_split": fit_split}
    return rows, extra


def bundled_no_answer_report() -> List[Dict[str, Any]]:
    """The bundled no-answer questions on the bundled documents, each judged by a gate fitted
    without it (leave-one-out over the 38 bundled questions, hard unanswerable ones made by
    excluding each answerable question's documents)."""
    import tempfile

    from llama_index_retrieval_kit.evaluation import load_jsonl
    from llama_index_retrieval_kit.indices import HybridIndex
    from llama_index_retrieval_kit.ingest import read_documents
    from llama_index_retrieval_kit.samples import QUESTIONS_FILE, sample_files

    dataset = load_jsonl(QUESTIONS_FILE)
    docs, _ = read_documents(sample_files())
    with tempfile.TemporaryDirectory() as tmp, HybridIndex.from_documents(docs, Path(tmp) / "index", embed_model=C.embed_model()) as index:
        retriever = index.as_retriever("hybrid", similarity_top_k=TOP_K)
        results = {qid: retriever.retrieve(q) for qid, q in dataset.queries.items()}
        excluded = {}
        for qid in dataset.answerable_ids():
            relevant = sorted(d for d, rel in dataset.qrels.get(qid, {}).items() if rel > 0)
            if relevant:
                f = MetadataFilters(filters=[MetadataFilter(key="doc_id", value=relevant, operator=FilterOperator.NIN)])
                excluded[qid] = index.as_retriever("hybrid", similarity_top_k=TOP_K, filters=f).retrieve(dataset.queries[qid])
    answerable = [(dataset.queries[q], results[q]) for q in dataset.answerable_ids()]
    report = []
    for qid in dataset.no_answer_ids():
        others = [(dataset.queries[q], results[q]) for q in dataset.no_answer_ids() if q != qid]
        others += [(dataset.queries[q], nodes) for q, nodes in excluded.items()]
        gate = NoAnswerPostprocessor.fit(answerable, others, target_answerable_recall=TARGET)
        conf = gate.confidence(results[qid], dataset.queries[qid])
        top = results[qid][0].node.metadata if results[qid] else {}
        report.append(
            {
                "question": dataset.queries[qid],
                "confidence": conf,
                "threshold": gate.threshold,
                "abstained": conf < gate.threshold,
                "best candidate": f"{top.get('doc_id')} / {top.get('section_header')}",
            }
        )
    return report


def fmt(rows: List[Dict[str, Any]]) -> str:
    keys = list(rows[0])
    cells = [[f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", type=Path, action="append", default=[], help="BEIR folder (repeatable)")
    ap.add_argument("--fit-split", default=None, help="split to fit on (default: train for scifact, dev otherwise)")
    ap.add_argument("--json", type=Path, default=None, help="write rows and fit reports here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out: Dict[str, Any] = {}
    for folder in args.dataset:
        split = args.fit_split or ("train" if (folder / "qrels_train.tsv").exists() and folder.name == "scifact" else "dev")
        rows, extra = evaluate_dataset(folder, split)
        print(f"\n== {folder.name}: fit on {split}, judged on test ==")
        print(fmt(rows))
        print("\nbundled no-answer questions (off-topic for this corpus):")
        for q in extra["offtopic_questions"]:
            print(f"  {'abstained' if q['abstained'] else 'ANSWERED '} {q['confidence']:.3f}  {q['question'][:90]}")
        out[folder.name] = {"rows": rows, **extra}
    bundled = bundled_no_answer_report()
    print("\n== bundled no-answer questions on the bundled documents (gate fitted leave-one-out) ==")
    for q in bundled:
        verdict = "abstained" if q["abstained"] else "ANSWERED "
        print(f"  {verdict} {q['confidence']:.3f} (threshold {q['threshold']:.3f})  {q['question'][:70]}  [best: {q['best candidate']}]")
    out["bundled_no_answer"] = bundled
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
