"""Context assembly vs plain top-k: evidence coverage at a fixed context budget.

For every answerable bundled question (``samples/questions.jsonl``) the hybrid retriever
returns its top 25 chunks (``index.as_retriever("hybrid", similarity_top_k=25)``). Then, at each
token budget:

* **assembled**: ``ContextAssembler(max_tokens=B)``: the node texts the LLM reads (citation
  hints included - ``--hint-style``, default the assembler's "compact" - tokens counted with the
  embedding model's tokenizer);
* **plain @chars**: the top-k chunk texts in rank order, cut to the same number of characters
  as the assembled context (the comparison the issue asks for);
* **plain @tokens**: the top-k chunk texts cut to the same token budget ``B`` (no hints).

Coverage is ``evaluation.relevance.coverage_at_k`` of each reference passage by the context
texts, averaged over passages then questions. Order does not change coverage, so each order
is also scored by where the evidence sits: ``edge`` = evidence-weighted mean of ``|2p - 1|``
over the context nodes, ``p`` the node's centre as a share of the context's characters
(1: evidence at the very start or end, 0: in the middle, which LLMs read worst - Liu et al.
2024, "Lost in the Middle"). A proxy, not an LLM measurement.

    .venv/bin/python benchmarks/context_assembly.py            # bundled text samples
    .venv/bin/python benchmarks/context_assembly.py --pdf      # also: the agreement as a multi-page PDF
    .venv/bin/python benchmarks/context_assembly.py --hint-style full   # every hint in full
"""

from __future__ import annotations

import argparse
import logging
import os
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

from llama_index_retrieval_kit.evaluation import load_jsonl  # noqa: E402
from llama_index_retrieval_kit.evaluation.relevance import coverage_at_k  # noqa: E402
from llama_index_retrieval_kit.postprocessor.context import ContextAssembler, ContextOrder, HintStyle  # noqa: E402
from llama_index_retrieval_kit.samples import QUESTIONS_FILE, sample_files, sample_pdf  # noqa: E402

logger = logging.getLogger("benchmarks.context_assembly")

BUDGETS = (256, 512, 1024)
TOP_K = 25


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


def read_corpus(pdf: bool, tmp: Path) -> list:
    from llama_index_retrieval_kit.ingest import read_documents

    files = list(sample_files())
    if pdf:
        files = [sample_pdf(tmp)] + [f for f in files if f.name != "credit_card_terms.md"]
    docs, failures = read_documents(files)
    if failures:
        raise RuntimeError(f"could not read {failures}")
    return docs


def run(pdf: bool, chunk_size: int = 200, chunk_overlap: int = 40, **assembler_args: object) -> List[Dict[str, object]]:
    from llama_index_retrieval_kit.indices import HybridIndex
    from llama_index_retrieval_kit.models import default_embed_model
    from llama_index_retrieval_kit.node_parser import SectionWindowNodeParser

    dataset = load_jsonl(QUESTIONS_FILE)
    qids = [q for q in dataset.answerable_ids() if dataset.reference_contexts.get(q)]
    with tempfile.TemporaryDirectory() as tmp:
        docs = read_corpus(pdf, Path(tmp))
        pages = sum(len(d.metadata.get("page_starts") or [0]) for d in docs)
        parser = SectionWindowNodeParser(chunk_size=chunk_size, chunk_overlap=chunk_overlap)
        with HybridIndex.from_documents(
            docs, Path(tmp) / "index", embed_model=default_embed_model(), node_parser=parser
        ) as index:
            retriever = index.as_retriever("hybrid", similarity_top_k=TOP_K)
            results = {q: retriever.retrieve(dataset.queries[q]) for q in qids}
    corpus = ("pdf+text" if pdf else "text") + f" ({pages} pages), chunks {chunk_size}/{chunk_overlap}"
    rows: List[Dict[str, object]] = []
    counter = ContextAssembler(max_tokens=1)
    for budget in BUDGETS:
        per_order: Dict[ContextOrder, Tuple[float, float]] = {}
        plain_chars, plain_llm, plain_tokens, chars, nodes, used = [], [], [], [], [], []
        for order in ContextOrder:
            assembler = ContextAssembler(max_tokens=budget, order=order, **assembler_args)
            cov, edge = [], []
            for q in qids:
                refs = dataset.reference_contexts[q]
                out = assembler.postprocess_nodes(results[q], query_str=dataset.queries[q])
                texts = [r.node.get_content(metadata_mode=MetadataMode.LLM) for r in out]
                cov.append(coverage(refs, texts))
                edge.append(edge_score(refs, texts))
                if order is ContextOrder.RELEVANCE:
                    n_chars = sum(len(t) for t in texts)
                    chars.append(n_chars)
                    nodes.append(len(texts))
                    used.append(assembler.last_report.used_tokens)
                    plain_chars.append(coverage(refs, plain_cut_chars(results[q], n_chars)))
                    plain_llm.append(coverage(refs, plain_cut_chars(results[q], n_chars, MetadataMode.LLM)))
                    plain_tokens.append(coverage(refs, plain_cut_tokens(results[q], budget, counter.count_tokens)))
            per_order[order] = (mean(cov), mean(edge))
        assembled = per_order[ContextOrder.RELEVANCE][0]
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
                **{f"edge {o.value}": per_order[o][1] for o in ContextOrder},
            }
        )
    return rows


def fmt(rows: List[Dict[str, object]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{v:.3f}" if isinstance(v, float) and k not in ("tokens used", "chars", "nodes") else
                 (f"{v:.1f}" if isinstance(v, float) else str(v)) for k, v in row.items()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pdf", action="store_true", help="also run with the agreement as a generated multi-page PDF")
    ap.add_argument("--hint-style", choices=[s.value for s in HintStyle], default=None,
                    help="the assembler's citation hints (default: its default, 'compact')")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    extra: Dict[str, object] = {"hint_style": args.hint_style} if args.hint_style else {}
    rows = run(pdf=False, **extra) + run(pdf=False, chunk_size=64, chunk_overlap=16, **extra)
    if args.pdf:
        rows += run(pdf=True, **extra)
    print(fmt(rows))
    # The bar (issue 12): +0.02 at 256 tokens, never below at larger budgets, against what the LLM
    # reads from plain top-k (chunk texts with their citation metadata). Bare chunk texts are shown too.
    failed = []
    for r in rows:
        for key in ("delta LLM@chars", "delta@chars"):
            if (r["budget"] == 256 and r[key] < 0.02) or r[key] < 0:
                logger.warning("below the bar (%s): %s at %s tokens: %.3f", key, r["corpus"], r["budget"], r[key])
                if key == "delta LLM@chars":
                    failed.append(r)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
