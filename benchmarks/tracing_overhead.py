"""Cost of per-stage tracing: hybrid retriever + no-answer gate + context assembler, tracing off vs on.

    python benchmarks/tracing_overhead.py [--reps 30] [--top-k 8] [--max-tokens 256]

Builds the bundled samples index in a temporary folder, calibrates the gate on the bundled
questions (as the tests do), then times on every bundled question (38), ``--reps`` rounds:

* the pipeline ``retrieve -> gate -> assembler`` called directly (query kinds ``text`` and
  ``embedded``): the retriever opens a trace, the gate and the assembler run outside it, so a
  collector makes three traces per question (and the JSON-lines writer three lines);
* the same stages in a LlamaIndex ``RetrieverQueryEngine`` (``node_postprocessors=[gate,
  assembler]``) with LlamaIndex's ``NoText`` synthesizer (``response_mode="no_text"``, given a
  ``MockLLM``: no LLM call, a constant and small cost, so the ratio is the largest a real engine
  would see) (query kinds ``engine`` and ``engine-embedded``): one query, one trace attached to
  the response (``response.metadata["trace"]``), one JSON line; what users run.

Modes, interleaved per question (the order rotating with the round and the question) so drift
on a shared machine hits all modes alike:

* off: no listener (the stages check the dispatcher and build nothing);
* li-spans: LlamaIndex's built-in ``SimpleSpanHandler`` (span timings only, no node ids: the
  built-in reference; our stages build nothing, as no event handler listens);
* collector: a ``TraceCollector`` installed (traces grouped and attached; with only plain
  collectors listening the stages hand them each stage directly as one tuple: no event is built,
  and no ``StageTrace`` record until ``trace.stages`` is read);
* events: a ``TraceCollector`` subclass with its own ``handle`` (as any other handler, e.g.
  OpenInference's: the records travel as ``StageTraceEvent`` / ``NodesDroppedEvent`` through the dispatcher);
* jsonl: a ``JsonlTraceWriter`` (the same, plus the JSON lines). Its background thread is kept
  idle (``flush_interval_s`` of an hour); after each round the lines are flushed on the measured
  thread and that flush's time (serialising what was not serialised yet, and one append to the
  file) is shared out over the round's queries, so the writer's whole cost is counted. A round
  is one batch of 38 queries; the writer's own batches (up to ``max_pending`` = 256 or one
  second of queries) are larger, so this over-counts the file write slightly.

Query kinds ``text`` / ``engine`` (the query is embedded each time, as in serving) and
``embedded`` / ``engine-embedded`` (``QueryBundle`` with a precomputed embedding: less work per
query, so the larger ratio).
Each query is timed twice: CPU time (``time.process_time``, every thread of the process: what a
busy shared machine disturbs least) and wall time. Per question the median over rounds is
taken; the table reports the mean of those medians and ``ratio = sum(median on) / sum(median
off)``, with its noise (half the gap between the ratio on the even and on the odd rounds). The
bar is CPU ratio < 1.02 for the collector. A last table times the tracing work alone (the trace
hooks, and the collector's handling of LlamaIndex's own events) against the untraced query.
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
from typing import Callable, Dict, List, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.llms import MockLLM  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.response_synthesizers.no_text import NoText  # noqa: E402
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler  # noqa: E402
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
MODES = ("off", "li-spans", "collector", "events", "jsonl")
TRACED = ("collector", "events", "jsonl")  # modes in which our stages build records
KINDS = ("text", "embedded", "engine", "engine-embedded")


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


def make_engine(retriever, gate, assembler) -> RetrieverQueryEngine:
    """The engine users run: the hybrid retriever, then the gate and the assembler, and LlamaIndex's
    ``NoText`` synthesizer (``response_mode="no_text"``; its LLM, a ``MockLLM``, is never called)."""
    return RetrieverQueryEngine(retriever, response_synthesizer=NoText(llm=MockLLM()), node_postprocessors=[gate, assembler])


class EventReadingCollector(TraceCollector):
    """A collector with a ``handle`` of its own: the stages dispatch their events (as for any other handler)."""

    def handle(self, event, **kwargs):
        return super().handle(event, **kwargs)


def handler_for(mode: str, folder: Path):
    """The listener a mode installs (None for off)."""
    if mode == "li-spans":
        return SimpleSpanHandler()
    if mode == "collector":
        return TraceCollector()  # keeps the last 1000 traces, as by default
    if mode == "events":
        return EventReadingCollector()
    if mode == "jsonl":  # flushed by time_modes after each round (its background thread stays idle)
        return JsonlTraceWriter(path=str(folder / "traces.jsonl"), flush_interval_s=3600.0, max_pending=1_000_000)
    return None


def install(handler) -> None:
    """Put ``handler`` on the root dispatcher (span handlers beside event handlers)."""
    if isinstance(handler, SimpleSpanHandler):
        get_dispatcher().add_span_handler(handler)
    elif handler is not None:
        handler.install()


def uninstall(handler) -> None:
    """Take ``handler`` off the root dispatcher again."""
    if isinstance(handler, SimpleSpanHandler):
        root = get_dispatcher()
        root.span_handlers = [h for h in root.span_handlers if h is not handler]
        handler.completed_spans.clear()
    elif isinstance(handler, JsonlTraceWriter):  # stop listening without JsonlTraceWriter.uninstall's flush:
        TraceCollector.uninstall(handler)  # time_modes flushes once per round and counts it
    elif handler is not None:
        handler.uninstall()


def time_modes(run: Callable[[object], float], queries: Sequence[object], reps: int, folder: Path) -> Dict[str, Dict[str, List[List[float]]]]:
    """Per mode and clock ("cpu", "wall"), per query, the seconds of each round (modes interleaved per query, order rotating).

    The JSON-lines writer is flushed after each round, timed, and the flush's time is added to
    each of the round's JSON-lines queries in equal shares: the writer's whole cost is counted,
    none of it left to its background thread (which stays idle) or to another mode's time.
    """
    times = {m: {"cpu": [[] for _ in queries], "wall": [[] for _ in queries]} for m in MODES}
    handlers = {m: handler_for(m, folder) for m in MODES}
    writer = handlers["jsonl"]
    try:
        for r in range(reps):
            for i, query in enumerate(queries):
                for mode in MODES[(r + i) % len(MODES):] + MODES[: (r + i) % len(MODES)]:
                    handler = handlers[mode]
                    install(handler)
                    try:
                        if tracing_enabled() != (mode in TRACED):
                            raise RuntimeError(f"mode {mode}: tracing_enabled() is {tracing_enabled()}")
                        cpu, wall = time.process_time(), time.perf_counter()
                        run(query)
                        times[mode]["cpu"][i].append(time.process_time() - cpu)
                        times[mode]["wall"][i].append(time.perf_counter() - wall)
                    finally:
                        uninstall(handler)
            if isinstance(writer, JsonlTraceWriter):
                cpu, wall = time.process_time(), time.perf_counter()
                written = writer.flush()
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                if written < len(queries):
                    raise RuntimeError(f"round {r}: the JSON-lines writer wrote {written} lines for {len(queries)} queries")
                for i in range(len(queries)):
                    times["jsonl"]["cpu"][i][-1] += cpu / len(queries)
                    times["jsonl"]["wall"][i][-1] += wall / len(queries)
    finally:
        if isinstance(handlers["jsonl"], JsonlTraceWriter):
            handlers["jsonl"].close()
    return times


def summarise(on: Sequence[Sequence[float]], off: Sequence[Sequence[float]]) -> Tuple[float, float, float]:
    """(mean per-query median of ``on`` in seconds, ratio, noise).

    ``ratio = sum of per-query medians on / sum of per-query medians off``; ``noise``: half the
    gap between that ratio on the even and on the odd rounds (how much it moves with the samples).
    """

    def ratio(rounds: slice) -> float:
        return sum(statistics.median(q[rounds]) for q in on) / sum(statistics.median(q[rounds]) for q in off)

    mean = sum(statistics.median(q) for q in on) / len(on)
    noise = abs(ratio(slice(0, None, 2)) - ratio(slice(1, None, 2))) / 2 if len(on[0]) > 1 else float("nan")
    return mean, ratio(slice(None)), noise


def hook_cost(run: Callable[[object], float], queries: Sequence[object], reps: int) -> float:
    """Seconds per query spent tracing, collector on: inside the trace hooks (record building,
    handing the records to the collector) and in the collector's handling of LlamaIndex's own
    events (opening and closing traces). A direct measurement of the tracing work, apart from the noise on whole queries
    (wall time: ``perf_counter`` costs far less per call than ``process_time``; a garbage collection
    that starts inside a hook is counted there).
    """
    import llama_index_retrieval_kit.retrievers.fused_index as fused
    import llama_index_retrieval_kit.postprocessor.context as context
    import llama_index_retrieval_kit.postprocessor.no_answer as gate

    spent = [0.0]
    depth = [0]

    def timed(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started
                depth[0] -= 1

        return wrapper

    collector = TraceCollector()
    hooks = [(fused, "trace_index_fusion"), (gate, "trace_gate"), (context, "trace_assembly")]
    originals = [getattr(module, name) for module, name in hooks]
    for (module, name), fn in zip(hooks, originals):
        setattr(module, name, timed(fn))
    handle = TraceCollector.handle
    TraceCollector.handle = timed(handle)  # LlamaIndex's own events too (still a plain collector: no drop events)
    try:
        with collector:
            for _ in range(reps):
                for query in queries:
                    run(query)
    finally:
        TraceCollector.handle = handle
        for (module, name), fn in zip(hooks, originals):
            setattr(module, name, fn)
    return spent[0] / (reps * len(queries))


def table(rows: List[tuple]) -> str:
    """Markdown table of (query kind, mode, (cpu mean, ratio, noise), (wall mean, ratio, noise))."""
    out = [
        "| queries | tracing | CPU ms/query | CPU ratio to off (± noise) | CPU added/query (us) | wall ms/query | wall ratio to off (± noise) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, mode, (cpu, cpu_ratio, cpu_noise), off_cpu, (wall, wall_ratio, wall_noise) in rows:
        out.append(f"| {kind} | {mode} | {1000 * cpu:.3f} | {cpu_ratio:.4f} ± {cpu_noise:.4f} | {1e6 * (cpu - off_cpu):.1f} | "
                   f"{1000 * wall:.3f} | {wall_ratio:.4f} ± {wall_noise:.4f} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="rounds over the bundled questions")
    parser.add_argument("--top-k", type=int, default=8, help="fused results handed to the gate")
    parser.add_argument("--max-tokens", type=int, default=256, help="context budget of the assembler")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="query kinds to time (default: all)")
    args = parser.parse_args(argv)
    for name in ("reps", "top_k", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        index, retriever, gate, assembler, questions = build_pipeline(folder, args.top_k, args.max_tokens)
        try:
            embed = index.embed_model if hasattr(index, "embed_model") else default_embed_model()
            bundles = [QueryBundle(q, embedding=embed.get_query_embedding(q)) for q in questions]
            engine = make_engine(retriever, gate, assembler)
            pipeline = lambda query: run_once(retriever, gate, assembler, query)  # noqa: E731
            kinds = {"text": (pipeline, [QueryBundle(q) for q in questions]), "embedded": (pipeline, bundles),
                     "engine": (engine.query, [QueryBundle(q) for q in questions]), "engine-embedded": (engine.query, bundles)}
            for query in kinds["text"][1][:5]:  # warm up (ONNX session, tokenizer, the engine's first query)
                pipeline(query)
                engine.query(query)
            rows, hooks = [], []
            for kind in args.kinds:
                run, queries = kinds[kind]
                times = time_modes(run, queries, args.reps, folder)
                off = summarise(times["off"]["cpu"], times["off"]["cpu"])[0]
                for mode in MODES:
                    rows.append((kind, mode, summarise(times[mode]["cpu"], times["off"]["cpu"]), off,
                                 summarise(times[mode]["wall"], times["off"]["wall"])))
                cost = hook_cost(run, queries, max(1, args.reps // 3))
                hooks.append((kind, 1e6 * cost, 100 * cost / off))
        finally:
            index.close()
    logger.info("%d questions x %d rounds, top_k=%d, max_tokens=%d", len(questions), args.reps, args.top_k, args.max_tokens)
    print(table(rows))  # the tables are the script's output
    print("\n| queries | time in tracing per query (us) | share of the untraced query's CPU time |\n|---|---|---|")
    print("\n".join(f"| {kind} | {us:.1f} | {pct:.2f}% |" for kind, us, pct in hooks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
