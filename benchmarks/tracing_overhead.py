"""Cost of per-stage tracing: hybrid retriever + no-answer gate + context assembler, tracing off vs on.

    python benchmarks/tracing_overhead.py [--reps 30] [--top-k 8] [--max-tokens 256]

Builds the bundled samples index in a temporary folder, calibrates the gate on the bundled
questions (as the tests do), then times the pipeline ``retrieve -> gate -> assembler`` on every
bundled question (38), ``--reps`` rounds. Modes, interleaved per question (the order rotates
each round) so drift on a shared machine hits all modes alike:

* off: no listener (the stages check the dispatcher and build nothing);
* collector: a ``TraceCollector`` installed (records built, events dispatched, traces grouped);
* jsonl: a ``JsonlTraceWriter`` (the same, plus one JSON line per retrieval written to disk).

Two query kinds: ``text`` (the query is embedded each time, as in serving) and ``embedded``
(``QueryBundle`` with a precomputed embedding: less work per query, so the larger ratio).
Per question the median over rounds is taken; the table reports the mean of those medians
and ``ratio = sum(median on) / sum(median off)``. The bar is ratio < 1.02.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_index.core.schema import QueryBundle  # noqa: E402

from llama_index_retrieval_kit import NoAnswerPostprocessor  # noqa: E402
from llama_index_retrieval_kit.evaluation import load_jsonl  # noqa: E402
from llama_index_retrieval_kit.indices import HybridIndex  # noqa: E402
from llama_index_retrieval_kit.ingest import read_documents  # noqa: E402
from llama_index_retrieval_kit.models import default_embed_model  # noqa: E402
from llama_index_retrieval_kit.postprocessor.context import ContextAssembler  # noqa: E402
from llama_index_retrieval_kit.samples import QUESTIONS_FILE, sample_files  # noqa: E402
from llama_index_retrieval_kit.tracing import JsonlTraceWriter, TraceCollector, tracing_enabled  # noqa: E402

logger = logging.getLogger("tracing_overhead")
MODES = ("off", "collector", "jsonl")


def build_pipeline(folder: Path, top_k: int, max_tokens: int) -> tuple:
    """(index, retriever, gate, assembler, questions) over the bundled samples."""
    docs, failures = read_documents(sample_files())
    if failures:
        raise SystemExit(f"could not read the samples: {failures}")
    embed = default_embed_model()
    index = HybridIndex.from_documents(docs, folder / "index", embed_model=embed)
    dataset = load_jsonl(QUESTIONS_FILE)
    gate = NoAnswerPostprocessor.calibrate(
        index.as_retriever("hybrid", similarity_top_k=top_k),
        dataset,
        exclusion_retriever=lambda f: index.as_retriever("hybrid", similarity_top_k=top_k, filters=f),
    )
    assembler = ContextAssembler(max_tokens=max_tokens)
    questions = [dataset.queries[q] for q in dataset.queries]
    return index, index.as_retriever("hybrid", similarity_top_k=top_k), gate, assembler, questions


def run_once(retriever, gate, assembler, query) -> float:
    """Seconds for one query through retrieve -> gate -> assembler."""
    started = time.perf_counter()
    nodes = retriever.retrieve(query)
    kept = gate.postprocess_nodes(nodes, query_bundle=query)
    assembler.postprocess_nodes(kept, query_bundle=query)
    return time.perf_counter() - started


def handler_for(mode: str, folder: Path):
    """The listener a mode installs (None for off)."""
    if mode == "collector":
        return TraceCollector(max_traces=100)
    if mode == "jsonl":
        return JsonlTraceWriter(path=str(folder / "traces.jsonl"))
    return None


def time_modes(run: Callable[[object], float], queries: Sequence[object], reps: int, folder: Path) -> Dict[str, List[float]]:
    """Per mode, the median seconds per query over ``reps`` rounds (modes interleaved, order rotating)."""
    samples: Dict[str, List[List[float]]] = {m: [[] for _ in queries] for m in MODES}
    handlers = {m: handler_for(m, folder) for m in MODES}
    for r in range(reps):
        order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
        for i, query in enumerate(queries):
            for mode in order:
                handler = handlers[mode]
                if handler is not None:
                    handler.install()
                try:
                    assert tracing_enabled() == (handler is not None)
                    samples[mode][i].append(run(query))
                finally:
                    if handler is not None:
                        handler.uninstall()
    return {m: [statistics.median(s) for s in per_query] for m, per_query in samples.items()}


def hook_cost(run: Callable[[object], float], queries: Sequence[object], reps: int) -> float:
    """Seconds per query spent inside the trace hooks (record building + dispatch + collecting), collector on.

    A direct measurement of the tracing work, independent of the machine's noise on whole queries.
    """
    import llama_index_retrieval_kit.indices.fused_retriever as fused
    import llama_index_retrieval_kit.postprocessor.context as context
    import llama_index_retrieval_kit.postprocessor.no_answer as gate

    spent = [0.0]

    def timed(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started

        return wrapper

    hooks = [(fused, "trace_index_fusion"), (gate, "trace_gate"), (context, "trace_assembly")]
    originals = [getattr(module, name) for module, name in hooks]
    for (module, name), fn in zip(hooks, originals):
        setattr(module, name, timed(fn))
    try:
        with TraceCollector(max_traces=100):
            for _ in range(reps):
                for query in queries:
                    run(query)
    finally:
        for (module, name), fn in zip(hooks, originals):
            setattr(module, name, fn)
    return spent[0] / (reps * len(queries))


def table(rows: List[tuple]) -> str:
    """Markdown table of (query kind, mode, mean ms, ratio, added us)."""
    out = ["| queries | tracing | mean of per-query medians (ms) | ratio to off | added per query (us) |", "|---|---|---|---|---|"]
    out += [f"| {k} | {m} | {ms:.3f} | {ratio:.4f} | {added:.1f} |" for k, m, ms, ratio, added in rows]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="rounds over the bundled questions")
    parser.add_argument("--top-k", type=int, default=8, help="fused results handed to the gate")
    parser.add_argument("--max-tokens", type=int, default=256, help="context budget of the assembler")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        index, retriever, gate, assembler, questions = build_pipeline(folder, args.top_k, args.max_tokens)
        try:
            embed = index.embed_model if hasattr(index, "embed_model") else default_embed_model()
            bundles = [QueryBundle(q, embedding=embed.get_query_embedding(q)) for q in questions]
            kinds = {"text": [QueryBundle(q) for q in questions], "embedded": bundles}
            run = lambda query: run_once(retriever, gate, assembler, query)  # noqa: E731
            for query in kinds["text"][:5]:  # warm up (ONNX session, tokenizer)
                run(query)
            rows, hooks = [], []
            for kind, queries in kinds.items():
                medians = time_modes(run, queries, args.reps, folder)
                off = sum(medians["off"])
                for mode in MODES:
                    total = sum(medians[mode])
                    rows.append((kind, mode, 1000 * total / len(queries), total / off, 1e6 * (total - off) / len(queries)))
                cost = hook_cost(run, queries, max(1, args.reps // 3))
                hooks.append((kind, 1e6 * cost, 100 * cost / (off / len(queries))))
        finally:
            index.close()
    logger.info("%d questions x %d rounds, top_k=%d, max_tokens=%d", len(questions), args.reps, args.top_k, args.max_tokens)
    print(table(rows))  # the tables are the script's output
    print("\n| queries | time in trace hooks per query (us) | share of the untraced query time |\n|---|---|---|")
    print("\n".join(f"| {kind} | {us:.1f} | {pct:.2f}% |" for kind, us, pct in hooks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
