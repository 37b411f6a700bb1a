"""The evaluation report: metrics.json, per_query.csv, runs/, summary.md, plots, significance.

Significance: for each pair of configurations and each compared metric (``ndcg@10``,
``mrr@10``, ``recall@<max k>`` where those k were evaluated) the per-query values of the
queries both scored are compared with two paired, two-sided tests on the differences
``b - a``: the Wilcoxon signed-rank test (``scipy.stats.wilcoxon``, zero differences dropped,
as Wilcoxon's original method) and a paired randomization test (random sign flips of the
differences, statistic = mean difference, ``scipy.stats.permutation_test``; exact when
``2**n`` is at most the resample count). When every difference is zero both p-values are 1.0.
p-values are not corrected for multiple comparisons.

Ranking order: every configuration's results are scored ordered by score (stable sort, highest
first; see :func:`~.evaluate.ranked_by_score`), so a context assembler's presentation order is
not scored as a ranking. Depth: a ``metric@k`` where a configuration returned fewer than ``k``
items for most scored queries is marked :data:`CAPPED_MARK` in the tables, named in the
significance rows (``capped``) and listed in metrics.json (``capped_metrics``): it measures how
many items came back, not how they were ranked. Abstention (empty results) is reported per
configuration when the dataset has no-answer questions.

Plots are drawn with matplotlib's Agg canvas (no display, no global backend change) at a fixed
size (:data:`METRICS_PLOT_SIZE`, :data:`DELTA_PLOT_SIZE`, in pixels).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from .._files import atomic_writer, write_text_atomic
from .evaluate import RetrieverEvaluation
from .metrics import METRIC_NAMES

if TYPE_CHECKING:  # pragma: no cover
    from .job import EvalJobResult

logger = logging.getLogger(__name__)

DPI = 100
#: Pixel size (width, height) of ``metrics_vs_k.png``.
METRICS_PLOT_SIZE = (1200, 800)
#: Pixel size (width, height) of each ``delta_*.png``.
DELTA_PLOT_SIZE = (1000, 450)
PERMUTATION_RESAMPLES = 10_000
#: Marks a metric@k of a config that returned fewer than k items for most scored queries.
CAPPED_MARK = "†"
METRIC_LABELS = {
    "ndcg": "nDCG",
    "recall": "Recall",
    "precision": "Precision",
    "mrr": "MRR",
    "hit_rate": "Hit rate",
    "map": "MAP",
    "coverage": "Coverage",
    "chars": "Chars",
}


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def safe_name(name: str) -> str:
    """``name`` usable in a file name: runs of other characters become ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "config"


def main_k(ks: Sequence[int]) -> int:
    """The cutoff headline metrics use: 10 when evaluated, else the largest k below 10, else the smallest."""
    if 10 in ks:
        return 10
    below = [k for k in ks if k < 10]
    return max(below) if below else min(ks)


def compared_metrics(ks: Sequence[int]) -> list[str]:
    """Metrics the significance tests compare: nDCG and MRR at :func:`main_k`, recall at max k."""
    k = main_k(ks)
    keys = [f"ndcg@{k}", f"mrr@{k}", f"recall@{max(ks)}"]
    return list(dict.fromkeys(keys))


def best_configs(evaluations: Mapping[str, RetrieverEvaluation], key: str) -> list[str]:
    """Names of the configs with the highest mean ``key`` (ties within 1e-12 all count)."""
    values = {name: ev.mean[key] for name, ev in evaluations.items() if key in ev.mean}
    if not values:
        return []
    top = max(values.values())
    return [name for name, value in values.items() if value >= top - 1e-12]


# --------------------------------------------------------------------------------------------
# Significance
# --------------------------------------------------------------------------------------------


def paired_tests(a: Sequence[float], b: Sequence[float], resamples: int = PERMUTATION_RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """Paired two-sided tests of ``b - a`` (see the module doc): mean difference and p-values."""
    from scipy import stats

    x = np.asarray(a, dtype=float)
    y = np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired samples must be two 1-D lists of the same length, got {x.shape} and {y.shape}")
    diff = y - x
    n = int(diff.size)
    result: dict[str, Any] = {
        "n": n,
        "mean_a": float(x.mean()) if n else 0.0,
        "mean_b": float(y.mean()) if n else 0.0,
        "mean_diff": float(diff.mean()) if n else 0.0,
        "wins": int((diff > 0).sum()),
        "losses": int((diff < 0).sum()),
        "ties": int((diff == 0).sum()),
        "wilcoxon_p": 1.0,
        "permutation_p": 1.0,
        "note": "",
    }
    nonzero = diff[diff != 0]
    if n == 0 or nonzero.size == 0:
        result["note"] = "all differences are zero" if n else "no paired queries"
        return result
    # Exact null distribution for small samples without tied |differences|, else the normal
    # approximation with tie correction (scipy's "auto" would resample, which is slow).
    exact = nonzero.size <= 50 and np.unique(np.abs(nonzero)).size == nonzero.size
    wilcoxon = stats.wilcoxon(nonzero, zero_method="wilcox", alternative="two-sided", method="exact" if exact else "approx")
    result["wilcoxon_p"] = float(wilcoxon.pvalue)
    perm = stats.permutation_test(
        (x, y),
        lambda u, v, axis: np.mean(v - u, axis=axis),
        permutation_type="samples",
        vectorized=True,
        n_resamples=resamples,
        alternative="two-sided",
        random_state=seed,
    )
    result["permutation_p"] = float(min(1.0, perm.pvalue))
    if nonzero.size < 6:
        result["note"] = f"only {nonzero.size} non-zero differences: little power"
    return result


def capped_note(name: str, evaluation: RetrieverEvaluation, key: str) -> str:
    """Why ``key`` of config ``name`` is depth-capped, e.g. "plain returned < 10 documents for 48/60 queries"."""
    k = int(key.rpartition("@")[2])
    return f"{name} returned < {k} {evaluation.item_unit} for {evaluation.short_of_k()[k]}/{evaluation.num_scored} queries"


def significance_tests(evaluations: Mapping[str, RetrieverEvaluation], metrics: Sequence[str]) -> list[dict[str, Any]]:
    """Paired tests for every pair of configs (a before b, in the given order) and metric.

    ``capped`` lists the configs of the pair whose ``metric@k`` is depth-capped
    (:meth:`~.evaluate.RetrieverEvaluation.capped_ks`) and ``depth`` says how ("" when none).
    """
    names = list(evaluations)
    rows: list[dict[str, Any]] = []
    for i, name_a in enumerate(names):
        for name_b in names[i + 1 :]:
            ev_a, ev_b = evaluations[name_a], evaluations[name_b]
            for key in metrics:
                if key not in ev_a.mean or key not in ev_b.mean:
                    continue
                va, vb = ev_a.values(key), ev_b.values(key)
                common = [qid for qid in va if qid in vb]
                test = paired_tests([va[q] for q in common], [vb[q] for q in common])
                capped = [name for name, ev in ((name_a, ev_a), (name_b, ev_b)) if ev.is_capped(key)]
                depth = "; ".join(capped_note(name, evaluations[name], key) for name in capped)
                rows.append({"a": name_a, "b": name_b, "metric": key, **test, "capped": capped, "depth": depth})
    return rows


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def metric_keys(evaluation: RetrieverEvaluation) -> list[str]:
    """The per-query metric columns of ``evaluation``, in report order."""
    names = list(METRIC_NAMES) + (["coverage", "chars"] if evaluation.relevance == "text" else [])
    return [f"{name}@{k}" for name in names for k in evaluation.ks if f"{name}@{k}" in evaluation.mean]


def per_query_rows(evaluations: Mapping[str, RetrieverEvaluation]) -> list[dict[str, Any]]:
    """One row per (config, query): flags, metric values (blank when not scored), retrieval facts."""
    rows: list[dict[str, Any]] = []
    for name, ev in evaluations.items():
        keys = metric_keys(ev)
        for qid, q in ev.per_query.items():
            row: dict[str, Any] = {
                "config": name,
                "query_id": qid,
                "answerable": q.answerable,
                "scored": q.answerable and q.labelled,
            }
            row.update({key: q.metrics.get(key, "") for key in keys})
            scores = [s for s in q.retrieval.scores if s is not None]
            row["num_retrieved"] = len(q.retrieval.node_ids)
            row["top_score"] = scores[0] if scores else ""
            row["latency_ms"] = round(q.retrieval.latency_s * 1000.0, 3)
            rows.append(row)
    return rows


def _fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}f}"
    return str(value)


def _fmt_p(p: float) -> str:
    return "<0.0001" if p < 1e-4 else f"{p:.4f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def comparison_table(evaluations: Mapping[str, RetrieverEvaluation], keys: Sequence[str], bold: Sequence[str]) -> str:
    """Configs x metric means; the best value of each column in ``bold`` is bold; a depth-capped
    value (see :meth:`~.evaluate.RetrieverEvaluation.is_capped`) is followed by :data:`CAPPED_MARK`."""
    rows = []
    for name, ev in evaluations.items():
        row = [name]
        for key in keys:
            if key not in ev.mean:
                row.append("-")
                continue
            cell = f"{ev.mean[key]:.0f}" if key.startswith("chars@") else _fmt(ev.mean[key])
            cell = f"**{cell}**" if key in bold and name in best_configs(evaluations, key) else cell
            row.append(cell + (f" {CAPPED_MARK}" if ev.is_capped(key) else ""))
        rows.append(row)
    return markdown_table(["config", *keys], rows)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def returned_table(result: "EvalJobResult") -> str:
    """Per config: chunks asked for (top_k), mean chunks and documents returned per scored query,
    queries returned in another order than by score, and per k the queries with fewer than k items."""
    rows = []
    for name, ev in result.evaluations.items():
        returned = ev.returned()
        short = [
            f"{n}{f' {CAPPED_MARK}' if k in returned['capped_ks'] else ''}"
            for k, n in ((int(k), n) for k, n in returned["short_of_k"].items())
        ]
        rows.append(
            [name, str(result.depths[name]), f"{returned['mean_chunks']:.1f}", f"{returned['mean_docs']:.1f}",
             str(returned["reordered_queries"]), *short]
        )
    first = next(iter(result.evaluations.values()))
    header = ["config", "top_k (chunks)", "chunks/query", "documents/query", "reordered by score"]
    header += [f"< {k} {first.item_unit}" for k in first.ks]
    return markdown_table(header, rows)


def abstention_table(evaluations: Mapping[str, RetrieverEvaluation]) -> str:
    """Per config: abstention recall and precision, answerable questions kept, empty results."""
    rows = []
    for name, ev in evaluations.items():
        a = ev.abstention()
        if a is None:
            continue
        rows.append(
            [name, _ratio(a["recall"]), _ratio(a["precision"]), _ratio(a["answerable_kept"]),
             f"{a['abstained']} ({a['abstained_no_answer']} no-answer, {a['abstained_answerable']} answerable)"]
        )
    return markdown_table(["config", "abstention recall", "abstention precision", "answerable kept", "empty results"], rows)


def dataset_line(result: "EvalJobResult") -> str:
    """The summary's dataset line: path, split, queries kept of the split's, scored/no-answer counts."""
    first = next(iter(result.evaluations.values()))
    split = f", split `{result.split}`" if result.split else ""
    total = result.num_queries_available or len(result.dataset)
    kept = (
        f"first {len(result.dataset)} of {total} queries (--limit-queries {result.limit_queries})"
        if result.limit_queries is not None and len(result.dataset) < total
        else f"{len(result.dataset)} queries"
    )
    return (
        f"- dataset: `{result.dataset_path}`{split} ({kept}; {first.num_scored} scored, "
        f"{len(first.no_answer_ids)} no-answer, {len(first.unlabelled_ids)} without {first.relevance}-level labels)"
    )


def summary_markdown(result: "EvalJobResult") -> str:
    """summary.md: dataset, comparison tables, significance, timings, settings, plots."""
    evaluations = result.evaluations
    first = next(iter(evaluations.values()))
    ks = first.ks
    k = main_k(ks)
    text = first.relevance == "text"
    headline = [f"{m}@{k}" for m in METRIC_NAMES] + ([f"recall@{max(ks)}"] if max(ks) != k else [])
    if text:
        headline += [f"coverage@{k}", f"chars@{k}"]
    bold_keys = [key for key in headline if not key.startswith("chars@")]

    any_capped = any(ev.capped_ks() for ev in evaluations.values())
    parts = [
        f"# Retrieval evaluation: {result.dataset.name or result.dataset_path}",
        "",
        dataset_line(result),
        f"- documents: {result.num_documents} ({result.documents_source})",
        f"- relevance: **{first.relevance}** ({_relevance_note(first.relevance)})",
        "- ranking: each config's results are scored ordered by score (stable sort, highest first) when every "
        "result has one, else in the order returned; a context assembler's presentation order (e.g. bookends) "
        "is not scored as a ranking",
        f"- cutoffs k: {', '.join(map(str, ks))}; best value per column in **bold**",
        "",
        f"## Main metrics (k = {k})",
        "",
        comparison_table(evaluations, headline, bold_keys),
        "",
    ]
    if any_capped:
        parts += [
            f"{CAPPED_MARK} depth-capped: the config returned fewer than k {first.item_unit} for most scored queries "
            "(see *Returned per query*); the value measures how many came back, not how they were ranked.",
            "",
        ]
    if text:
        parts += [
            "chars@k = characters in the top-k chunks: compare configurations at similar chars@k "
            "(bigger chunks find more passages by holding more text). coverage@k = share of each reference "
            "passage found in the top-k chunks (chunking-independent).",
            "",
        ]
    for name in ("ndcg", "recall") + (("coverage", "chars") if text else ()):
        keys = [f"{name}@{kk}" for kk in ks]
        parts += [f"### {METRIC_LABELS[name]}@k", "", comparison_table(evaluations, keys, [] if name == "chars" else keys), ""]

    parts += [
        "## Returned per query",
        "",
        returned_table(result),
        "",
        f"Means over the scored queries; k counts {first.item_unit}. top_k = chunks asked for per query (a "
        "config's own similarity_top_k counts chunks); a gate, reranker or context budget can return fewer. "
        f"{CAPPED_MARK}: more than half of the scored queries returned fewer than k {first.item_unit}.",
        "",
    ]
    if first.no_answer_ids:
        parts += [
            "## No-answer questions",
            "",
            abstention_table(evaluations),
            "",
            f"{len(first.no_answer_ids)} no-answer questions. An empty result counts as abstaining (e.g. a no-answer "
            "gate). Abstention recall = no-answer questions with an empty result / no-answer questions; abstention "
            "precision = no-answer questions with an empty result / empty results; answerable kept = answerable "
            "questions with a non-empty result / answerable questions.",
            "",
        ]
    parts += ["## Significance (paired, two-sided)", ""]
    if result.significance:
        rows = [
            [
                f"{row['b']} vs {row['a']}",
                row["metric"],
                f"{row['mean_diff']:+.4f}",
                f"{row['wins']}/{row['ties']}/{row['losses']}",
                _fmt_p(row["wilcoxon_p"]),
                _fmt_p(row["permutation_p"]),
                str(row["n"]),
                row["note"],
                f"{CAPPED_MARK} {row['depth']}" if row.get("capped") else "",
            ]
            for row in result.significance
        ]
        parts += [
            markdown_table(
                ["pair (b vs a)", "metric", "mean b - a", "wins/ties/losses", "Wilcoxon p", "randomization p", "n", "note",
                 "depth-capped"],
                rows,
            ),
            "",
            f"Wilcoxon signed-rank test (zero differences dropped) and paired randomization test "
            f"({PERMUTATION_RESAMPLES} sign flips, seed 0) on per-query values; not corrected for multiple comparisons.",
            "",
        ]
    else:
        parts += ["(one configuration: nothing to compare)", ""]

    parts += ["## Timings", ""]
    rows = []
    for name, ev in evaluations.items():
        t = result.timings["configs"][name]
        shared = [c for c in t["index_shared_with"] if c != name]
        rows.append(
            [
                name,
                f"{t['chunk_s']:.2f}",
                f"{t['index_s']:.2f}" + (f" (shared with {', '.join(shared)})" if shared else ""),
                str(t["embedded"]) + (" (reused)" if t["index_reused"] else ""),
                f"{t['retrieve_s']:.2f}",
                f"{ev.latency['p50_ms']:.1f}",
                f"{ev.latency['p95_ms']:.1f}",
                f"{t['score_s']:.2f}",
                str(result.depths[name]),
            ]
        )
    parts += [
        f"Reading the dataset and documents: {result.timings['read_s']:.2f} s.",
        "",
        markdown_table(
            ["config", "chunk s", "index s", "texts embedded", "retrieve s", "p50 ms/query", "p95 ms/query", "score s", "top_k"],
            rows,
        ),
        "",
        "Chunking and index builds are shared by configurations with the same chunking (and embedding model and "
        "BM25 settings); top_k = chunks retrieved per query.",
        "",
        "## Configurations",
        "",
    ]
    for config in result.configs:
        parts.append(f"- **{config.name}**: `{json.dumps(config.to_dict(), default=str)}`")
    plots = [p for key, p in result.files.items() if key.startswith("plot")]
    if plots:
        parts += ["", "## Plots", ""]
        parts += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(parts) + "\n"


def _relevance_note(mode: str) -> str:
    return {
        "doc": "chunks mapped to their documents, each document taking its best chunk's score (max-score "
        "aggregation) and ranked by it; k counts documents",
        "node": "node ids against node-level labels; k counts chunks",
        "text": "a chunk is relevant when it holds a reference passage not found higher up, and finds every such "
        "passage it holds; k counts chunks",
    }[mode]


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def _figure(size_px: tuple[int, int]) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(size_px[0] / DPI, size_px[1] / DPI), dpi=DPI)


def _save(fig: Any, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=DPI, format="png")
    return path


def plot_metrics_vs_k(evaluations: Mapping[str, RetrieverEvaluation], path: str | Path) -> Path:
    """One panel per metric: mean value against k, one line per configuration."""
    first = next(iter(evaluations.values()))
    names = list(METRIC_NAMES) + (["coverage"] if first.relevance == "text" else [])
    fig = _figure(METRICS_PLOT_SIZE)
    columns = 4 if len(names) > 6 else 3
    rows = math.ceil(len(names) / columns)
    axes = fig.subplots(rows, columns, squeeze=False)
    for position, name in enumerate(names):
        ax = axes[position // columns][position % columns]
        for config, ev in evaluations.items():
            ks = [k for k in ev.ks if f"{name}@{k}" in ev.mean]
            ax.plot(ks, [ev.mean[f"{name}@{k}"] for k in ks], marker="o", label=config)
        if max(first.ks) / min(first.ks) >= 10:
            ax.set_xscale("log")
        ax.set_xticks(list(first.ks))
        ax.set_xticklabels([str(k) for k in first.ks])
        ax.set_title(f"{METRIC_LABELS[name]}@k")
        ax.set_xlabel("k")
        ax.set_ylim(0.0, 1.02)
        ax.grid(True, alpha=0.3)
    for position in range(len(names), rows * columns):
        axes[position // columns][position % columns].set_visible(False)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"{first.dataset_name}: metrics vs k ({first.relevance}-level relevance, {first.num_scored} queries)")
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.07, top=0.9, wspace=0.25, hspace=0.4)
    return _save(fig, Path(path))


def plot_deltas(base: RetrieverEvaluation, other: RetrieverEvaluation, key: str, labels: tuple[str, str], path: str | Path) -> Path:
    """Per-query ``other - base`` of ``key``, sorted, as bars (green: better, red: worse)."""
    va, vb = base.values(key), other.values(key)
    common = [qid for qid in va if qid in vb]
    deltas = np.sort(np.asarray([vb[q] - va[q] for q in common], dtype=float))[::-1]
    fig = _figure(DELTA_PLOT_SIZE)
    ax = fig.subplots()
    colors = ["#2a9d8f" if d > 0 else "#e76f51" if d < 0 else "#999999" for d in deltas]
    ax.bar(np.arange(len(deltas)), deltas, width=1.0, color=colors)
    ax.axhline(0.0, color="black", linewidth=0.8)
    wins, losses = int((deltas > 0).sum()), int((deltas < 0).sum())
    mean = float(deltas.mean()) if len(deltas) else 0.0
    ax.set_title(
        f"{key}: {labels[1]} - {labels[0]} per query (mean {mean:+.4f}; "
        f"{wins} better, {len(deltas) - wins - losses} same, {losses} worse)"
    )
    ax.set_xlabel("queries, sorted by difference")
    ax.set_ylabel(f"delta {key}")
    ax.set_ylim(-1.05, 1.05)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.12, top=0.9)
    return _save(fig, Path(path))


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def metrics_document(result: "EvalJobResult") -> dict[str, Any]:
    """The content of metrics.json."""
    from importlib.metadata import PackageNotFoundError, version

    def _version(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    first = next(iter(result.evaluations.values()))
    keys = metric_keys(first)
    configs = []
    for config in result.configs:
        ev = result.evaluations[config.name]
        configs.append(
            {
                "name": config.name,
                "settings": config.to_dict(),
                "top_k": result.depths[config.name],
                "mean": ev.mean,
                "latency": ev.latency,
                "timings": result.timings["configs"][config.name],
                "num_scored": ev.num_scored,
                "num_no_answer": len(ev.no_answer_ids),
                **({"abstention": ev.abstention()} if ev.no_answer_ids else {}),
                "returned": ev.returned(),
                "capped_metrics": [key for key in metric_keys(ev) if ev.is_capped(key)],
            }
        )
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            _REPORT_WRITER: _version(_REPORT_WRITER),
            "llama-index-core": _version("llama-index-core"),
        },
        "dataset": {
            "path": result.dataset_path,
            "name": result.dataset.name,
            "split": result.split or None,
            "num_queries": len(result.dataset),
            "num_queries_available": result.num_queries_available or len(result.dataset),
            "limit_queries": result.limit_queries,
            "num_scored": first.num_scored,
            "no_answer_ids": list(first.no_answer_ids),
            "unlabelled_ids": list(first.unlabelled_ids),
            "relevance": first.relevance,
            "ks": list(first.ks),
        },
        "documents": {"count": result.num_documents, "source": result.documents_source},
        "configs": configs,
        "best": {key: best_configs(result.evaluations, key) for key in keys if not key.startswith("chars@")},
        "significance": result.significance,
        "builds": [build.to_dict() for build in result.builds],
        "timings": result.timings,
        "files": {key: str(path.relative_to(result.out_dir)) for key, path in result.files.items()},
    }


def write_metrics_json(result: "EvalJobResult") -> Path:
    """Write ``metrics.json`` into the report folder."""
    path = result.out_dir / "metrics.json"
    write_text_atomic(path, json.dumps(metrics_document(result), indent=2, default=str))
    result.files["metrics"] = path
    return path


def write_per_query_csv(evaluations: Mapping[str, RetrieverEvaluation], path: str | Path) -> Path:
    """Write ``per_query.csv`` (see :func:`per_query_rows`)."""
    rows = per_query_rows(evaluations)
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    out = Path(path)
    with atomic_writer(out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return out


def write_runs(evaluations: Mapping[str, RetrieverEvaluation], folder: str | Path) -> dict[str, Path]:
    """``runs/<config>.jsonl``: per query the retrieved node ids, scores, doc ids and scored ranking."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, ev in evaluations.items():
        path = out / f"{safe_name(name)}.jsonl"
        with atomic_writer(path) as handle:
            for qid, q in ev.per_query.items():
                record = {**q.retrieval.to_dict(), "answerable": q.answerable, "ranking": list(q.ranking)}
                record["query_id"] = qid
                handle.write(json.dumps(record) + "\n")
        paths[name] = path
    return paths


#: Files a report folder holds (besides ``indexes/``); ``runs/`` holds one JSONL file per config.
REPORT_FILES = ("metrics.json", "per_query.csv", "summary.md", "metrics_vs_k.png")
#: Report files named after the configs compared: an earlier run's may be stale.
PER_CONFIG_PATTERNS = ("delta_*.png", "runs/*.jsonl")


#: The package name a report's ``metrics.json`` records its version under (``versions``).
_REPORT_WRITER = "llama-index-retrieval-kit"


def _report_metrics(path: Path) -> dict[str, Any] | None:
    """The content of ``path`` when it is the ``metrics.json`` of a report this package wrote (a
    JSON object whose ``versions`` name this package, :func:`metrics_document`); else None (someone
    else's ``metrics.json``, unreadable or damaged)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(data, dict) and isinstance(data.get("versions"), dict) and _REPORT_WRITER in data["versions"]:
        return data
    return None


def earlier_report_files(out: Path) -> list[Path]:
    """The files an earlier report in ``out`` wrote, as its ``metrics.json`` lists them (only
    paths inside ``out``); [] without a readable one."""
    files = (_report_metrics(out / "metrics.json") or {}).get("files", {})
    found = []
    for rel in files.values() if isinstance(files, dict) else []:
        path = Path(str(rel))
        if path.is_absolute() or ".." in path.parts:
            continue
        found.append(out / path)
    return found


def check_report_folder(out: str | Path) -> None:
    """Refuse a report folder that holds files of the report's names but no earlier report (a
    ``metrics.json`` this package wrote; someone else's ``metrics.json`` is one of those files):
    writing the report would replace someone's own files."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a folder for the report")
    if not out.is_dir() or _report_metrics(out / "metrics.json") is not None:
        return
    clashes = [out / name for name in REPORT_FILES if (out / name).exists()]
    clashes += [p for pattern in PER_CONFIG_PATTERNS for p in sorted(out.glob(pattern))]
    if clashes:
        names = ", ".join(str(p.relative_to(out)) for p in clashes[:5]) + (" ..." if len(clashes) > 5 else "")
        raise ValueError(
            f"{out} holds {names} but no earlier report (a metrics.json written by rkit eval): the report would "
            "replace them. Choose an empty or new folder for --out / out_dir"
        )


def write_report(result: "EvalJobResult") -> dict[str, Path]:
    """Write every report file into ``result.out_dir``; fills ``result.significance``/``files``.

    Delta plots and run files that the earlier report there listed (its ``metrics.json``) and
    this run does not write are removed, so the folder describes this run only; nothing else is
    deleted (indexes/ is kept for reuse).
    """
    out = result.out_dir
    out.mkdir(parents=True, exist_ok=True)
    earlier = earlier_report_files(out)
    evaluations = result.evaluations
    first = next(iter(evaluations.values()))
    result.significance = significance_tests(evaluations, compared_metrics(first.ks))

    stale = {p for p in earlier if any(p.relative_to(out).match(pattern) for pattern in PER_CONFIG_PATTERNS)}
    files: dict[str, Path] = {}
    files["per_query"] = write_per_query_csv(evaluations, out / "per_query.csv")
    for name, path in write_runs(evaluations, out / "runs").items():
        files[f"run:{name}"] = path
    files["plot:metrics_vs_k"] = plot_metrics_vs_k(evaluations, out / "metrics_vs_k.png")
    names = list(evaluations)
    key = f"ndcg@{main_k(first.ks)}"
    for other in names[1:]:
        path = out / f"delta_{safe_name(key)}_{safe_name(other)}_vs_{safe_name(names[0])}.png"
        files[f"plot:delta:{other}"] = plot_deltas(evaluations[names[0]], evaluations[other], key, (names[0], other), path)
    result.files.update(files)
    for path in stale - set(files.values()):  # an earlier run's configs this run does not compare
        if path.is_file() and not path.is_symlink():
            path.unlink()
    summary = out / "summary.md"
    result.files["summary"] = summary
    write_text_atomic(summary, summary_markdown(result))
    write_metrics_json(result)
    logger.info("report written to %s", out)
    return dict(result.files)
