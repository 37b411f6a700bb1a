"""Context assembly vs plain top-k: evidence coverage at a fixed context budget.

For every answerable bundled question (``samples/questions.jsonl``) the hybrid retriever
returns its top 25 chunks (``index.as_retriever("hybrid", similarity_top_k=25)``). Then, at each
token budget:

* **assembled**: ``ContextAssembler(max_tokens=B)``: the node texts the LLM reads (citation
  hints included - ``--hint-style``, default the assembler's "compact" - tokens counted with the
  embedding model's tokenizer; ``--cut``, default the assembler's "query");
* **plain @chars**: the top-k chunk texts in rank order, cut to the same number of characters
  as the assembled context (the comparison the issue asks for);
* **plain @tokens**: the top-k chunk texts cut to the same token budget ``B`` (no hints).

Coverage is ``evaluation.relevance.coverage_at_k`` of each reference passage by the context
texts, averaged over passages then questions. Order does not change coverage, so each order
is also scored by where the evidence sits: ``edge`` = evidence-weighted mean of ``|2p - 1|``
over the context nodes, ``p`` the node's centre as a share of the context's characters
(1: evidence at the very start or end, 0: in the middle, which LLMs read worst - Liu et al.
2024, "Lost in the Middle"). A proxy, not an LLM measurement.

``--pdf`` adds the agreement as a generated A4 PDF (with the other two samples as text) and all
three samples as A6 PDFs (small pages: sections run over several pages), the latter also at
4,608 tokens (about 19k characters). ``--scifact DIR`` adds the issue's "real multi-page PDFs"
check at that size: SciFact abstracts (a BEIR folder) rendered as A6 PDFs (each abstract a
section over 2-3 pages), the claims with rationale sentences as questions and those sentences
as the reference evidence; the assembler gets the top 25 or top 50 chunks, plain the same
ranking cut to the assembled context's characters, and "plain top-25" is the top 25 uncut.

    .venv/bin/python benchmarks/context_assembly.py            # bundled text samples
    .venv/bin/python benchmarks/context_assembly.py --pdf      # also: the samples as multi-page PDFs
    .venv/bin/python benchmarks/context_assembly.py --hint-style full   # every hint in full
    .venv/bin/python benchmarks/context_assembly.py --cut prefix        # cuts keep a chunk's prefix
    .venv/bin/python benchmarks/context_assembly.py --scifact /work/shared/datasets/beir/scifact
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import random
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llama_index.core.schema import MetadataMode, NodeWithScore  # noqa: E402

from llama_index_retrieval_kit.evaluation import load_beir, load_jsonl  # noqa: E402
from llama_index_retrieval_kit.evaluation.relevance import coverage_at_k  # noqa: E402
from llama_index_retrieval_kit.postprocessor.context import ContextAssembler, ContextOrder, CutMode, HintStyle  # noqa: E402
from llama_index_retrieval_kit.samples import QUESTIONS_FILE, sample_files, sample_pdf  # noqa: E402
from llama_index_retrieval_kit.samples.pdf_writer import latin1, text_to_blocks, write_pdf  # noqa: E402

logger = logging.getLogger("benchmarks.context_assembly")

BUDGETS = (256, 512, 1024)
#: About 19k characters of context: the size of plain top-25 in the issue's PDF goal.
PDF_GOAL_BUDGET = 4608
TOP_K = 25
#: A6 paper (mm): small pages, so a section runs over several of them.
A6 = (105.0, 148.0)
#: SciFact's abstracts are their sentences joined by one space (BEIR): split them back.
_SCIFACT_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\[])")


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def coverage(references: Sequence[str], texts: Sequence[str]) -> float:
    """Mean coverage of the reference passages by ``texts`` taken together."""
    return mean([coverage_at_k(ref, list(texts)) for ref in references])


def plain_cut_chars(results: Sequence[NodeWithScore], max_chars: int, mode: MetadataMode = MetadataMode.NONE) -> List[str]:
    """Top-k chunk texts in rank order (``mode``: bare, or as the LLM reads them with their
    citation metadata), the last one cut so the total is ``max_chars``."""
    out, left = [], max_chars
    for r in results:
        if left <= 0:
            break
        text = r.node.get_content(metadata_mode=mode)[:left]
        out.append(text)
        left -= len(text)
    return out


def plain_cut_tokens(results: Sequence[NodeWithScore], max_tokens: int, count: Callable[[str], int]) -> List[str]:
    """Top-k chunk texts in rank order while they fit ``max_tokens``; the next one cut (by words) to fit."""
    out, left = [], max_tokens
    for r in results:
        text = r.node.get_content(metadata_mode=MetadataMode.NONE)
        n = count(text)
        if n <= left:
            out.append(text)
            left -= n
            continue
        words = text.split(" ")
        lo, hi = 0, len(words)
        while lo < hi:  # longest word prefix that fits
            mid = (lo + hi + 1) // 2
            if count(" ".join(words[:mid])) <= left:
                lo = mid
            else:
                hi = mid - 1
        if lo:
            out.append(" ".join(words[:lo]))
        break
    return out


def edge_score(references: Sequence[str], texts: Sequence[str]) -> float:
    """Evidence-weighted mean of ``|2p - 1|`` (``p``: a node's centre as a share of the context)."""
    total = sum(len(t) for t in texts)
    if not total:
        return 0.0
    weight = weighted = 0.0
    pos = 0
    for t in texts:
        centre = (pos + len(t) / 2) / total
        pos += len(t)
        w = mean([coverage_at_k(ref, [t]) for ref in references])
        weight += w
        weighted += w * abs(2 * centre - 1)
    return weighted / weight if weight else 0.0


def read_files(files: Sequence[Path]) -> list:
    from llama_index_retrieval_kit.ingest import read_documents

    docs, failures = read_documents(files)
    if failures:
        raise RuntimeError(f"could not read {failures}")
    return docs


def sample_corpus(kind: str, tmp: Path) -> list:
    """The bundled samples: "text"; "pdf" (the agreement as an A4 PDF, the others as text);
    "pdf-a6" (all three as A6 PDFs, so sections run over several pages)."""
    files = list(sample_files())
    if kind == "pdf":
        files = [sample_pdf(tmp)] + [f for f in files if f.name != "credit_card_terms.md"]
    elif kind == "pdf-a6":
        files = [
            write_pdf(text_to_blocks(f.read_text(encoding="utf-8")), tmp / f"{f.stem}.pdf", header=f.stem.replace("_", " "),
                      title=f.stem, page_format=A6)
            for f in files
        ]
    return read_files(files)


def bundled_questions(pdf: bool) -> Tuple[Dict[str, str], Dict[str, List[str]]]:
    """The answerable bundled questions and their reference passages (as a PDF renders them when ``pdf``)."""
    dataset = load_jsonl(QUESTIONS_FILE)
    qids = [q for q in dataset.answerable_ids() if dataset.reference_contexts.get(q)]
    refs = {q: [latin1(r) if pdf else r for r in dataset.reference_contexts[q]] for q in qids}
    return {q: dataset.queries[q] for q in qids}, refs


def scifact_pdf_corpus(
    folder: Path, tmp: Path, n_docs: int, seed: int = 13, per_pdf: int = 40
) -> Tuple[list, Dict[str, str], Dict[str, List[str]]]:
    """SciFact as multi-page PDFs: ``(documents, queries, reference sentences)``.

    The abstracts cited as evidence by the test claims, plus randomly drawn others up to
    ``n_docs``, shuffled and rendered ``per_pdf`` to an A6 PDF (title a heading, abstract a
    paragraph, a running header and page numbers). Questions: the claims with rationale
    sentences (in the queries file's metadata); references: those sentences as rendered.
    """
    dataset = load_beir(folder)
    evidence: Dict[str, Dict[str, List[int]]] = {}
    with gzip.open(folder / "queries.jsonl.gz", "rt", encoding="utf-8") as fh:
        for line in fh:
            obj = json.loads(line)
            meta = obj.get("metadata") or {}
            if obj["_id"] in dataset.queries and meta:
                evidence[obj["_id"]] = {d: sorted({i for item in items for i in item["sentences"]}) for d, items in meta.items()}
    refs: Dict[str, List[str]] = {}
    for q, per_doc in evidence.items():
        passages = []
        for doc_id, indexes in per_doc.items():
            sentences = _SCIFACT_SENTENCE.split(dataset.corpus[doc_id]["text"])
            passages += [latin1(sentences[i]) for i in indexes if i < len(sentences)]
        if passages:
            refs[q] = passages
    relevant = sorted({d for per_doc in evidence.values() for d in per_doc})
    rng = random.Random(seed)
    others = sorted(set(dataset.corpus) - set(relevant))
    chosen = relevant + rng.sample(others, max(0, n_docs - len(relevant)))
    rng.shuffle(chosen)
    files = []
    for part, first in enumerate(range(0, len(chosen), per_pdf), start=1):
        blocks = [("h1", f"SciFact abstracts, part {part}")]
        for doc_id in chosen[first : first + per_pdf]:
            blocks += [("h2", dataset.corpus[doc_id]["title"].strip() or doc_id), ("p", dataset.corpus[doc_id]["text"])]
        files.append(write_pdf(blocks, tmp / f"scifact_{part:03d}.pdf", header="SciFact abstracts (BEIR)",
                               title=f"SciFact abstracts, part {part}", page_format=A6))
    return read_files(files), {q: dataset.queries[q] for q in refs}, refs


def retrieve(docs: list, queries: Dict[str, str], tmp: Path, top_k: int, chunk_size: int, chunk_overlap: int) -> Dict[str, list]:
    """The hybrid retriever's top ``top_k`` for every query over ``docs`` (a fresh index in ``tmp``)."""
    from llama_index_retrieval_kit.indices import HybridIndex
    from llama_index_retrieval_kit.models import default_embed_model
    from llama_index_retrieval_kit.node_parser import SectionWindowNodeParser

    parser = SectionWindowNodeParser(chunk_size=chunk_size, chunk_overlap=chunk_overlap)
    with HybridIndex.from_documents(docs, tmp / "index", embed_model=default_embed_model(), node_parser=parser) as index:
        retriever = index.as_retriever("hybrid", similarity_top_k=top_k)
        return {q: retriever.retrieve(text) for q, text in queries.items()}


def pages_of(docs: list) -> int:
    return sum(len(d.metadata.get("page_starts") or [0]) for d in docs)


def evaluate(
    corpus: str,
    results: Dict[str, list],
    queries: Dict[str, str],
    refs: Dict[str, List[str]],
    budgets: Sequence[int],
    orders: Sequence[ContextOrder] = tuple(ContextOrder),
    **assembler_args: object,
) -> List[Dict[str, object]]:
    """One row per budget: assembled (relevance order) vs plain top-k at equal characters, edge per order."""
    rows: List[Dict[str, object]] = []
    counter = ContextAssembler(max_tokens=1)
    qids = list(refs)
    for budget in budgets:
        per_order: Dict[ContextOrder, Tuple[float, float]] = {}
        plain_chars, plain_llm, plain_tokens, chars, nodes, used = [], [], [], [], [], []
        for order in orders:
            assembler = ContextAssembler(max_tokens=budget, order=order, **assembler_args)
            cov, edge = [], []
            for q in qids:
                out = assembler.postprocess_nodes(results[q], query_str=queries[q])
                texts = [r.node.get_content(metadata_mode=MetadataMode.LLM) for r in out]
                cov.append(coverage(refs[q], texts))
                edge.append(edge_score(refs[q], texts))
                if order is orders[0]:
                    n_chars = sum(len(t) for t in texts)
                    chars.append(n_chars)
                    nodes.append(len(texts))
                    used.append(assembler.last_report.used_tokens)
                    plain_chars.append(coverage(refs[q], plain_cut_chars(results[q], n_chars)))
                    plain_llm.append(coverage(refs[q], plain_cut_chars(results[q], n_chars, MetadataMode.LLM)))
                    plain_tokens.append(coverage(refs[q], plain_cut_tokens(results[q], budget, counter.count_tokens)))
            per_order[order] = (mean(cov), mean(edge))
        assembled = per_order[orders[0]][0]
        rows.append(
            {
                "corpus": corpus,
                "budget": budget,
                "questions": len(qids),
                "assembled": assembled,
                "plain@chars": mean(plain_chars),
                "plain LLM@chars": mean(plain_llm),
                "plain@tokens": mean(plain_tokens),
                "delta@chars": assembled - mean(plain_chars),
                "delta LLM@chars": assembled - mean(plain_llm),
                "tokens used": mean(used),
                "chars": mean(chars),
                "nodes": mean(nodes),
                **{f"edge {o.value}": per_order[o][1] for o in orders},
            }
        )
    return rows


def run(kind: str, chunk_size: int = 200, chunk_overlap: int = 40, budgets: Sequence[int] = BUDGETS,
        **assembler_args: object) -> List[Dict[str, object]]:
    """The bundled questions over the bundled samples (``kind``: see :func:`sample_corpus`)."""
    queries, refs = bundled_questions(pdf=kind != "text")
    with tempfile.TemporaryDirectory() as tmp:
        docs = sample_corpus(kind, Path(tmp))
        results = retrieve(docs, queries, Path(tmp), TOP_K, chunk_size, chunk_overlap)
    corpus = f"{kind} ({pages_of(docs)} pages), chunks {chunk_size}/{chunk_overlap}"
    return evaluate(corpus, results, queries, refs, budgets, **assembler_args)


def run_scifact(folder: Path, n_docs: int, budgets: Sequence[int] = (256, 1024, 2048, PDF_GOAL_BUDGET),
                **assembler_args: object) -> List[Dict[str, object]]:
    """The PDF goal: SciFact as A6 PDFs, assembled from the top 25 and the top 50 against plain."""
    with tempfile.TemporaryDirectory() as tmp:
        docs, queries, refs = scifact_pdf_corpus(folder, Path(tmp), n_docs)
        results = retrieve(docs, queries, Path(tmp), 2 * TOP_K, 200, 40)
    rows = []
    for top_k in (TOP_K, 2 * TOP_K):
        cut = {q: r[:top_k] for q, r in results.items()}
        corpus = f"scifact pdf ({len(docs)} files, {pages_of(docs)} pages, {n_docs} abstracts), top {top_k}"
        rows += evaluate(corpus, cut, queries, refs, budgets, orders=(ContextOrder.RELEVANCE,), **assembler_args)
    top = {q: [r.node.get_content(metadata_mode=MetadataMode.NONE) for r in res[:TOP_K]] for q, res in results.items()}
    rows.append({"corpus": f"scifact pdf, plain top-{TOP_K} uncut", "budget": "-", "questions": len(refs),
                 "plain@chars": mean([coverage(refs[q], top[q]) for q in refs]),
                 "chars": mean([float(sum(len(t) for t in top[q])) for q in refs])})
    return rows


def fmt(rows: List[Dict[str, object]]) -> str:
    keys: List[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = []
        for k in keys:
            v = row.get(k, "")
            if isinstance(v, float):
                v = f"{v:.1f}" if k in ("tokens used", "chars", "nodes") else f"{v:.3f}"
            cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pdf", action="store_true", help="also run with the samples as generated multi-page PDFs")
    ap.add_argument("--hint-style", choices=[s.value for s in HintStyle], default=None,
                    help="the assembler's citation hints (default: its default, 'compact')")
    ap.add_argument("--cut", choices=[c.value for c in CutMode], default=None,
                    help="what the assembler keeps of a chunk that does not fit whole (default: its default, 'query')")
    ap.add_argument("--scifact", type=Path, default=None, metavar="DIR",
                    help="a BEIR SciFact folder: also run the PDF goal on it, rendered as A6 PDFs")
    ap.add_argument("--scifact-docs", type=int, default=1500, help="abstracts in the SciFact PDFs (default 1500)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    extra: Dict[str, object] = {}
    if args.hint_style:
        extra["hint_style"] = args.hint_style
    if args.cut:
        extra["cut"] = args.cut
    rows = run("text", **extra) + run("text", chunk_size=64, chunk_overlap=16, **extra)
    if args.pdf:
        rows += run("pdf", **extra) + run("pdf-a6", budgets=BUDGETS + (PDF_GOAL_BUDGET,), **extra)
    print(fmt(rows))
    goal: List[Dict[str, object]] = []
    if args.scifact is not None:
        goal = run_scifact(args.scifact, args.scifact_docs, **extra)
        print()
        print(fmt(goal))
    # The bar (issue 12): +0.02 at 256 tokens, never below at larger budgets, against what the LLM
    # reads from plain top-k (chunk texts with their citation metadata) and against bare chunk texts.
    # The SciFact rows are for information (the bar is set on the bundled questions).
    failed = []
    for r in rows:
        for key in ("delta LLM@chars", "delta@chars"):
            if (r["budget"] == 256 and r[key] < 0.02) or r[key] < 0:
                logger.warning("below the bar (%s): %s at %s tokens: %.3f", key, r["corpus"], r["budget"], r[key])
                failed.append(r)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
