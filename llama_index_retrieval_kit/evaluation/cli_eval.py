"""``rkit eval``: evaluate retriever configurations on a labelled dataset, write a report folder.

    rkit eval --dataset ../shared/datasets/beir/scifact --config llamaindex-bm25 --out runs/scifact
    rkit eval --dataset questions.jsonl --docs docs/ --config bm25 --config hybrid --config my.yaml --out runs/qa
    rkit eval --dataset questions.jsonl --config bm25 --config examples/pipeline.yaml --out runs/pipeline

Wire it into ``cli.py`` with ``add_eval_subparser(sub)`` in ``build_parser``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from .configs import RETRIEVERS
from .relevance import RELEVANCE_MODES

logger = logging.getLogger(__name__)


def parse_ks(text: str) -> tuple[int, ...]:
    """``"1,5,10,100"`` -> ``(1, 5, 10, 100)``; an argparse type (bad input: a usage error)."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ks must be comma-separated integers such as 1,5,10,100, got {text!r}") from None
    if not values or any(k < 1 for k in values):
        raise argparse.ArgumentTypeError(f"--ks needs at least one cutoff, each >= 1, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_eval_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``eval`` on an ``argparse`` subparsers object; returns the new parser."""
    parser = subparsers.add_parser(
        "eval",
        help="evaluate retriever configurations on a labelled dataset and write a report folder",
        description="Evaluate retriever configurations on a BEIR folder or a JSONL question file; writes "
        "metrics.json, per_query.csv, summary.md, runs/ and plots into --out.",
    )
    parser.add_argument("--dataset", required=True, help="BEIR folder (corpus, queries, qrels) or JSONL question file")
    parser.add_argument(
        "--config",
        action="append",
        required=True,
        metavar="CONFIG",
        help=f"built-in name ({', '.join(RETRIEVERS)}) or a YAML file (a retriever config, or a pipeline config "
        "whose retrieval and precision stages are evaluated); repeat to compare (the first is the baseline)",
    )
    parser.add_argument("--out", required=True, help="report folder (created); indexes are kept in OUT/indexes")
    parser.add_argument(
        "--docs", nargs="+", default=None, metavar="PATH",
        help="files/folders to index for a JSONL dataset (default for the bundled questions.jsonl: the bundled samples)",
    )
    parser.add_argument("--ks", type=parse_ks, default=(1, 5, 10, 100), help="cutoffs, comma-separated (default: 1,5,10,100)")
    parser.add_argument(
        "--split", default=None, metavar="NAME",
        help="BEIR split to evaluate on, one of the folder's (qrels_NAME.tsv), e.g. test, dev, train (default: test); "
        "not for a JSONL question file. The report records it",
    )
    parser.add_argument(
        "--limit-queries", type=_positive_int, default=None, metavar="N",
        help="evaluate the first N queries only (the report says N of how many)",
    )
    parser.add_argument(
        "--relevance", choices=RELEVANCE_MODES, default="auto",
        help="what counts as relevant: auto (text when the dataset has reference passages, else doc), doc, node, text",
    )
    parser.add_argument(
        "--embedding-cache", default=None, metavar="SQLITE",
        help="an embedding cache file (EmbeddingCache SQLite) to copy vectors from, read only",
    )
    parser.add_argument(
        "--allow-unmatched-references", action="store_true",
        help="score even when none of the dataset's reference doc ids names an indexed document "
        "(by default an error: --docs probably holds other documents than the dataset is about)",
    )
    parser.set_defaults(func=cmd_eval)
    return parser


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def cmd_eval(args: argparse.Namespace) -> int:
    """Run the evaluation job and print the headline table; 0 on success."""
    from .._extras import REPORT_MODULES, require_extra

    require_extra("eval", REPORT_MODULES, "rkit eval")  # before any work: the report needs them
    from .job import run_eval
    from .report import main_k

    result = run_eval(
        args.dataset,
        args.config,
        args.out,
        docs=args.docs,
        ks=args.ks,
        limit_queries=args.limit_queries,
        relevance=args.relevance,
        embedding_cache=args.embedding_cache,
        show_progress=not getattr(args, "quiet", False),
        allow_unmatched_references=getattr(args, "allow_unmatched_references", False),
        split=getattr(args, "split", None),
    )
    k = main_k(result.ks)
    keys = [f"ndcg@{k}", f"recall@{k}", f"mrr@{k}", f"recall@{max(result.ks)}"]
    if result.relevance == "text":
        keys += [f"coverage@{k}", f"chars@{k}"]
    keys = list(dict.fromkeys(keys))
    from .report import CAPPED_MARK

    first = next(iter(result.evaluations.values()))
    split = f" ({result.split} split)" if result.split else ""
    limited = f" of the first {len(result.dataset)} of {result.num_queries_available}" if result.limit_queries is not None else ""
    _out(
        f"{result.dataset.name}{split}: {first.num_scored} scored queries{limited} ({len(first.no_answer_ids)} no-answer), "
        f"{result.num_documents} documents, relevance={result.relevance}"
    )
    width = max(len("config"), *(len(name) for name in result.evaluations))
    _out("  ".join(["config".ljust(width), *(key.rjust(12) for key in keys), "p50 ms".rjust(8)]))
    for name, ev in result.evaluations.items():
        cells = [
            (f"{ev.mean[key]:.0f}" if key.startswith("chars@") else f"{ev.mean[key]:.4f}")
            + (CAPPED_MARK if ev.is_capped(key) else " ")
            for key in keys
        ]
        _out("  ".join([name.ljust(width), *(cell.rjust(12) for cell in cells), f"{ev.latency['p50_ms']:.1f}".rjust(8)]))
    if any(ev.is_capped(key) for ev in result.evaluations.values() for key in keys):
        _out(f"{CAPPED_MARK} the config returned fewer than k {first.item_unit} for most queries: depth, not ranking")
    for row in result.significance:
        if row["metric"] == f"ndcg@{k}":
            _out(
                f"{row['b']} vs {row['a']}: ndcg@{k} {row['mean_diff']:+.4f}, "
                f"Wilcoxon p={row['wilcoxon_p']:.4g}, randomization p={row['permutation_p']:.4g}"
                + (f" ({CAPPED_MARK} depth-capped: {row['depth']})" if row.get("capped") else "")
            )
    _out(f"report: {result.files['summary']} (metrics.json, per_query.csv, runs/, plots) in {result.timings['total_s']:.1f} s")
    return 0
