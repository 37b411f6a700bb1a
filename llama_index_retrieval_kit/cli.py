"""``rkit``: the command line of llama_index_retrieval_kit.

    rkit demo                                # the main job on the bundled samples
    rkit ingest FILE_OR_DIR ...              # chunk documents, print a summary, write JSONL
    rkit index FILE_OR_DIR ... --storage DIR # build or update a hybrid index folder
    rkit query --storage DIR "question"      # retrieve from an index folder (--json, --gate, --trace)
    rkit calibrate --storage DIR --dataset PATH --out gate.json   # fit a no-answer gate
    rkit inspect FILE                        # pages, sections and chunks of one file
    rkit eval --dataset PATH --config NAME_OR_YAML ... --out DIR   # compare retrievers, write a report
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

logger = logging.getLogger("llama_index_retrieval_kit")


EXIT_OK = 0
EXIT_PARTIAL = 1  # done, but some input files could not be read (or nothing was readable)
EXIT_USAGE = 2  # bad arguments or input: the message says what to change
EXIT_BUSY = 3  # the index folder is open in another process
EXIT_DAMAGED = 4  # the index folder is damaged: the message names the file and the repair
EXIT_INTERNAL = 70  # a bug: rerun with --verbose for the traceback
EXIT_INTERRUPTED = 130
#: Exit codes of every command, documented in the README ("Command line").
EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_PARTIAL: "finished, but some files could not be read (listed), or nothing could be indexed",
    EXIT_USAGE: "bad arguments or input (the message says what to change)",
    EXIT_BUSY: "the index is open or being written by another process (or read-only after a failed write): "
    "close it, or serve the index from a Qdrant server",
    EXIT_DAMAGED: "the index folder is damaged (the message names the file and how to rebuild)",
    EXIT_INTERNAL: "internal error (a bug): rerun with --verbose for the traceback",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


class CLIError(ValueError):
    """An expected condition the CLI reports in one line (exit code 2)."""


def _table(rows: Sequence[dict]) -> str:
    """A plain-text table of dict rows (same keys)."""
    if not rows:
        return "(no rows)"
    keys = list(rows[0])
    widths = {k: max(len(str(k)), *(len(_fmt(r[k])) for r in rows)) for k in keys}
    line = "  ".join(str(k).ljust(widths[k]) for k in keys)
    sep = "  ".join("-" * widths[k] for k in keys)
    body = ["  ".join(_fmt(r[k]).ljust(widths[k]) for k in keys) for r in rows]
    return "\n".join([line, sep, *body])


def _fmt(v: object) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def cmd_ingest(args: argparse.Namespace) -> int:
    from .ingest import ingest, make_parser, write_chunks_jsonl

    parser = make_parser(args.parser, args.chunk_size, args.chunk_overlap)
    result = ingest(args.paths, parser, show_progress=not args.quiet)
    _out(_table(result.summary_rows()))
    if result.failures:
        _out(f"\n{len(result.failures)} file(s) could not be read:")
        for f in result.failures:
            _out(f"  - {f}")
    if args.out:
        path = write_chunks_jsonl(result.nodes, args.out)
        _out(f"\nwrote {len(result.nodes)} chunks to {path}")
    for node in result.nodes[: args.show]:
        m = node.metadata
        _out(f"\n[{m['doc_id']} #{m['chunk_index']}] {' > '.join(m['section_path']) or '(preamble)'} "
             f"pages {m['page_start']}-{m['page_end']} chars {m['char_start']}-{m['char_end']}")
        _out("  " + node.get_content().strip().replace("\n", "\n  ")[:400])
    return 1 if result.failures and not result.nodes else 0


def _print_results(results: Sequence, width: int = 240) -> None:
    for rank, r in enumerate(results, 1):
        m = r.node.metadata
        legs = getattr(r, "leg_ranks", None)
        leg_text = f"  legs {legs}" if legs else ""
        _out(f"{rank:>2}. {r.score:.4f}  {m.get('doc_id')}  {m.get('section_header') or '(preamble)'}  "
             f"p.{m.get('page_start')}-{m.get('page_end')}{leg_text}")
        _out("      " + " ".join(r.node.get_content().split())[:width])


def cmd_index(args: argparse.Namespace) -> int:
    from .indices import HybridIndex
    from .ingest import make_parser, read_documents

    documents, failures = read_documents(args.paths, show_progress=not args.quiet)
    for f in failures:
        _out(f"could not read {f}")
    if not documents:
        _out("nothing to index")
        return EXIT_PARTIAL
    storage = Path(args.storage)
    if (storage / "index.json").exists() and not args.rebuild:
        with HybridIndex.load(storage) as index:
            rekeyed = _same_files_other_ids(index, documents)
            if rekeyed and not args.migrate_ids:
                raise CLIError(
                    f"{len(rekeyed)} file(s) are already in {storage} under another document id, and indexing them "
                    "again would store them twice:\n"
                    + "\n".join(f"  - {old!r} -> {new!r}" for old, new in rekeyed[:10])
                    + "\nIndex the same folder as before (ids are paths relative to the folder given), or add "
                    "--migrate-ids to replace the old entries with the new ids"
                )
            stats = index.upsert(documents, show_progress=not args.quiet, allow_source_change=args.allow_source_change)
            for old, _ in rekeyed:
                index.delete(old)  # after the upsert committed: the file is never missing from the index
            if rekeyed:
                stats["migrated"] = len(rekeyed)
            total = len(index)
    else:
        parser = make_parser(args.parser, args.chunk_size, args.chunk_overlap)
        with HybridIndex.from_documents(
            documents, storage, node_parser=parser, overwrite=args.rebuild, show_progress=not args.quiet
        ) as index:
            stats = {"documents": len(documents), "chunks": len(index)}
            total = len(index)
    _out(f"indexed {stats}; {total} chunks in {storage}")
    return EXIT_PARTIAL if failures else EXIT_OK


def _same_files_other_ids(index, documents) -> list[tuple[str, str]]:
    """(indexed id, new id) for files already indexed under a different document id."""
    from .indices.hybrid_index import document_origin

    by_origin: dict[str, str] = {}
    for doc_id, origin in index.document_origins().items():
        if origin is not None:
            by_origin.setdefault(origin, doc_id)
    new_ids = {d.id_ for d in documents}
    pairs = []
    for doc in documents:
        old = by_origin.get(document_origin(doc.metadata) or "")
        if old is not None and old != doc.id_ and old not in new_ids:
            pairs.append((old, doc.id_))
    return pairs


QUERY_MODES = ("hybrid", "hybrid_score", "hybrid_rrf", "dense", "sparse", "qdrant_hybrid")
DEFAULT_QUERY_MODE = "hybrid"
DEFAULT_QUERY_TOP_K = 5


def _require_index(storage: str | Path) -> None:
    if not (Path(storage) / "index.json").exists():
        raise CLIError(f"{storage} holds no index: build one first with `rkit index FILES_OR_FOLDERS --storage {storage}`")


def _positive_k(k: int) -> int:
    if k < 1:
        raise CLIError(f"-k/--top-k must be at least 1, got {k}")
    return k


def _json_safe(value: object) -> object:
    """Plain JSON values: numpy scalars as floats/ints, NaN and infinities as null."""
    import math

    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return _json_safe(value.item())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)


def _result_dict(rank: int, r) -> dict:
    """One retrieved chunk as a JSON-ready dict."""
    m = r.node.metadata or {}
    out = {
        "rank": rank,
        "score": None if r.score is None else float(r.score),
        "node_id": r.node.node_id,
        "doc_id": m.get("doc_id") or r.node.ref_doc_id,
        "section_header": m.get("section_header"),
        "page_start": m.get("page_start"),
        "page_end": m.get("page_end"),
        "char_start": m.get("char_start"),
        "char_end": m.get("char_end"),
    }
    for key in ("leg_ranks", "leg_scores"):
        legs = getattr(r, key, None)
        if legs:
            out[key] = dict(legs)
    out["text"] = r.node.get_content()
    return out


def _load_gate(path: str):
    from .postprocessor.no_answer import NoAnswerPostprocessor

    if not Path(path).is_file():
        raise CLIError(f"--gate {path}: no such gate file: write one with `rkit calibrate --storage DIR --dataset PATH --out {path}`")
    return NoAnswerPostprocessor.load(path)


def _apply_gate(gate, question: str, results: list) -> tuple[list, dict]:
    """The gate's decision on ``results``: (kept results, decision for the output)."""
    from llama_index.core.schema import QueryBundle

    confidence = gate.confidence(results, question) if gate.is_fitted else None
    kept = gate.postprocess_nodes(list(results), query_bundle=QueryBundle(question))
    abstained = not kept
    decision = {
        "abstained": abstained,
        "confidence": confidence,
        "threshold": float(gate.threshold),
        "kept": len(kept),
        "best_rejected": _result_dict(1, results[0]) if abstained and results else None,
    }
    return kept, decision


def cmd_query(args: argparse.Namespace) -> int:
    _require_index(args.storage)
    gate = _load_gate(args.gate) if args.gate else None
    # a gate is calibrated on one retriever: unless told otherwise, query with the same mode and k
    fitted_with = ((gate.fit_report or {}).get("retriever") or {}) if gate is not None else {}
    mode = args.mode or fitted_with.get("mode") or DEFAULT_QUERY_MODE
    top_k = _positive_k(args.top_k if args.top_k is not None else int(fitted_with.get("similarity_top_k") or DEFAULT_QUERY_TOP_K))
    if gate is not None and fitted_with and (mode, top_k) != (fitted_with.get("mode"), fitted_with.get("similarity_top_k")):
        logger.warning(
            "the gate was calibrated with --mode %s -k %s, this query uses --mode %s -k %s: its confidences may be off",
            fitted_with.get("mode"), fitted_with.get("similarity_top_k"), mode, top_k,
        )

    from contextlib import nullcontext

    from .indices import HybridIndex

    traces: list = []
    with HybridIndex.load(args.storage) as index:
        retriever = index.as_retriever(mode=mode, similarity_top_k=top_k)
        if args.trace:
            from .tracing import collect_traces

            context = collect_traces()
        else:
            context = nullcontext(None)
        with context as collector:
            results = retriever.retrieve(args.question)
            kept, decision = _apply_gate(gate, args.question, results) if gate is not None else (results, None)
        if collector is not None:
            traces = list(collector.traces)

    if args.json:
        payload = {
            "question": args.question,
            "mode": mode,
            "top_k": top_k,
            "results": [_result_dict(rank, r) for rank, r in enumerate(kept, 1)],
        }
        if decision is not None:
            payload["gate"] = {"path": str(args.gate), **decision}
        if args.trace:
            payload["traces"] = [t.to_dict() for t in traces]
        _out(json.dumps(_json_safe(payload), ensure_ascii=False))
        return EXIT_OK

    if decision is not None and decision["abstained"]:
        conf = decision["confidence"]
        conf_text = f"confidence {conf:.4f} < threshold {decision['threshold']:.4f}" if conf is not None else "every chunk was below the similarity cutoff"
        _out(f"NO ANSWER: the gate abstained ({conf_text}): the answer is probably not in the index.")
        if results:
            _out("best rejected candidate:")
            _print_results(results[:1])
        else:
            _out("(nothing was retrieved)")
    else:
        if decision is not None:
            conf = decision["confidence"]
            conf_text = f"confidence {conf:.4f} >= threshold {decision['threshold']:.4f}" if conf is not None else "similarity cutoff only"
            _out(f"answer gate: passed ({conf_text})")
        _print_results(kept)
    if traces:
        from .tracing import format_trace

        for trace in traces:
            _out("\n" + format_trace(trace))
    return EXIT_OK


def cmd_calibrate(args: argparse.Namespace) -> int:
    _require_index(args.storage)
    top_k = _positive_k(args.top_k)
    if not 0.0 < args.target_recall <= 1.0:
        raise CLIError(f"--target-recall must be in (0, 1], got {args.target_recall}")
    out = Path(args.out)
    if out.is_dir():
        raise CLIError(f"--out {out} is a folder: give a file name such as {out / 'gate.json'}")

    from .evaluation import load_dataset
    from .indices import HybridIndex
    from .postprocessor.no_answer import NoAnswerPostprocessor

    dataset = load_dataset(args.dataset)
    with HybridIndex.load(args.storage) as index:
        exclusion = (
            (lambda f: index.as_retriever(args.mode, similarity_top_k=top_k, filters=f)) if args.exclude_relevant else None
        )
        try:
            gate = NoAnswerPostprocessor.calibrate(
                index.as_retriever(args.mode, similarity_top_k=top_k),
                dataset,
                target_answerable_recall=args.target_recall,
                exclusion_retriever=exclusion,
                show_progress=not args.quiet,
            )
        except ValueError as exc:
            raise CLIError(
                f"cannot calibrate on {args.dataset}: {exc}. The dataset needs questions with answers (with reference "
                "doc ids) and without; --exclude-relevant turns answerable ones into unanswerable ones"
            ) from None
    report = dict(gate.fit_report or {})
    report["retriever"] = {"mode": args.mode, "similarity_top_k": top_k, "exclude_relevant": bool(args.exclude_relevant)}
    report["dataset"] = str(args.dataset)
    gate.fit_report = report
    path = gate.save(out)
    _out(f"no-answer gate calibrated on {args.dataset} (--mode {args.mode} -k {top_k}"
         f"{', relevant documents excluded for extra unanswerable questions' if args.exclude_relevant else ''}):")
    rows = [
        {"metric": "AUROC", "value": report.get("auroc")},
        {"metric": "threshold", "value": report.get("threshold")},
        {"metric": "answerable kept", "value": report.get("answerable_kept")},
        {"metric": "target answerable kept", "value": report.get("target_answerable_recall")},
        {"metric": "abstention precision", "value": report.get("abstention_precision")},
        {"metric": "abstention recall", "value": report.get("abstention_recall")},
        {"metric": "answerable questions", "value": report.get("answerable")},
        {"metric": "unanswerable questions", "value": report.get("unanswerable")},
    ]
    _out(_table(rows))
    _out(f"\nwrote {path}; use it with `rkit query QUESTION --storage {args.storage} --gate {path}`")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.exists():
        raise CLIError(f"{path}: no such file")
    if path.is_dir():
        raise CLIError(f"{path} is a folder: `rkit inspect` takes one file (use `rkit ingest {path}` for a folder summary)")
    if args.show < 0:
        raise CLIError(f"--show must be 0 or more, got {args.show}")

    from .ingest import make_parser
    from .node_parser.metadata import page_of
    from .readers import DocumentReadError
    from .readers.text import DocumentFolderReader

    try:
        documents = DocumentFolderReader().load_data(path)
    except DocumentReadError as err:
        raise CLIError("; ".join(str(f) for f in err.failures) or str(err)) from None
    parser = make_parser(args.parser, args.chunk_size, args.chunk_overlap)
    for doc in documents:
        text = doc.get_content()
        page_starts = list(doc.metadata.get("page_starts") or [0])
        _out(f"== {doc.id_}: {len(text)} chars, {len(page_starts)} page(s) ==")
        _out("\npages:")
        bounds = [*page_starts[1:], len(text)]
        _out(_table([{"page": i, "char_start": s, "char_end": e, "chars": e - s}
                     for i, (s, e) in enumerate(zip(page_starts, bounds), 1)]))

        sections = parser.sections_of(doc)
        _out(f"\nsections ({len(sections)}):")
        _out(_table([
            {
                "section": " > ".join(sec.path) or "(preamble)",
                "chars": f"{sec.start}-{sec.end}",
                "pages": f"{page_of(page_starts, sec.start)}-{page_of(page_starts, max(sec.start, sec.end - 1))}",
            }
            for sec in sections
        ]))

        nodes = parser.get_nodes_from_documents([doc])
        shown = nodes if args.show == 0 else nodes[: args.show]
        _out(f"\nchunks ({len(nodes)}, parser {args.parser}):")
        rows = []
        for n in shown:
            m = n.metadata
            rows.append({
                "#": m.get("chunk_index"),
                "kind": m.get("node_kind"),
                "section": m.get("section_header") or "(preamble)",
                "pages": f"{m.get('page_start')}-{m.get('page_end')}",
                "chars": f"{m.get('char_start')}-{m.get('char_end')}",
                "text": " ".join(n.get_content().split())[:80],
            })
        _out(_table(rows))
        if len(shown) < len(nodes):
            _out(f"... {len(nodes) - len(shown)} more chunk(s): --show 0 lists all")
        _out()
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from .ingest import ingest, write_chunks_jsonl
    from .node_parser import SectionWindowNodeParser
    from .samples import sample_files, sample_pdf

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pdf = sample_pdf(out)
    files = [pdf, *sample_files()[1:]]
    _out(f"Bundled samples: {', '.join(p.name for p in files)}")
    result = ingest(files, SectionWindowNodeParser(), show_progress=not args.quiet)
    _out("\n== Ingestion (PagedPDFReader + SectionWindowNodeParser, chunk_size=200, overlap=40) ==")
    _out(_table(result.summary_rows()))
    path = write_chunks_jsonl(result.nodes, out / "chunks.jsonl")
    _out(f"\nwrote {len(result.nodes)} chunks to {path}")
    for node in [n for n in result.nodes if n.metadata["doc_id"] == pdf.name][3:5]:
        m = node.metadata
        _out(f"\n[{m['doc_id']} #{m['chunk_index']}] {' > '.join(m['section_path'])} "
             f"(pages {m['page_start']}-{m['page_end']}, chars {m['char_start']}-{m['char_end']})")
        _out("  " + node.get_content().strip().replace("\n", "\n  ")[:300])

    from .indices import HybridIndex

    _out("\n== Hybrid index (BM25 + all-MiniLM-L6-v2 on Qdrant local mode, fused by normalised score fusion) ==")
    with HybridIndex.from_documents(
        result.documents, out / "index", overwrite=True, show_progress=not args.quiet
    ) as index:
        _out(f"{len(index)} chunks indexed in {out / 'index'}")
        for question in ("How much is the late payment fee?", "How often should I replace the filter cartridge?"):
            _out(f"\nQ: {question}")
            _print_results(index.as_retriever(mode="hybrid", similarity_top_k=3).retrieve(question), width=160)

    from .evaluation.cli_eval import cmd_eval
    from .samples import QUESTIONS_FILE

    _out("\n== Evaluation on the bundled labelled questions (BM25 vs dense vs hybrid) ==")
    eval_args = argparse.Namespace(
        dataset=str(QUESTIONS_FILE),
        config=["bm25", "dense", "hybrid"],
        out=str(out / "eval"),
        docs=None,
        ks=(1, 3, 5, 10),
        limit_queries=None,
        relevance="auto",
        embedding_cache=str(out / "index" / "embeddings.sqlite"),
        quiet=args.quiet,
    )
    return cmd_eval(eval_args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rkit",
        description="Production-grade retrieval for LlamaIndex apps.",
        epilog="exit codes:\n" + "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the main job on the bundled sample documents")
    demo.add_argument("--out", default="rkit_output/demo", help="output folder (default: %(default)s)")
    demo.set_defaults(func=cmd_demo)

    ing = sub.add_parser("ingest", help="read and chunk files or folders (PDF, Markdown, text)")
    ing.add_argument("paths", nargs="+", help="files or folders")
    ing.add_argument("--parser", choices=["window", "hierarchy"], default="window", help="node parser (default: %(default)s)")
    ing.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (children for hierarchy)")
    ing.add_argument("--chunk-overlap", type=int, default=None, help="tokens of overlap")
    ing.add_argument("--out", default=None, help="write chunks as JSONL here")
    ing.add_argument("--show", type=int, default=3, help="print the first N chunks (default: %(default)s)")
    ing.set_defaults(func=cmd_ingest)

    idx = sub.add_parser("index", help="build or update a hybrid index folder from files or folders")
    idx.add_argument("paths", nargs="+", help="files or folders")
    idx.add_argument("--storage", required=True, help="index folder (created, or updated in place)")
    idx.add_argument("--parser", choices=["window", "hierarchy"], default="window", help="node parser (default: %(default)s)")
    idx.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (children for hierarchy)")
    idx.add_argument("--chunk-overlap", type=int, default=None, help="tokens of overlap")
    idx.add_argument("--rebuild", action="store_true", help="replace an existing index instead of updating it")
    idx.add_argument(
        "--allow-source-change",
        action="store_true",
        help="let a file replace an indexed document of the same id that came from a different file "
        "(default: refuse, so that no file silently drops another from the index)",
    )
    idx.add_argument(
        "--migrate-ids",
        action="store_true",
        help="files already indexed under another id (e.g. by an older version, or from another folder "
        "root) are re-keyed to their new id instead of refused",
    )
    idx.set_defaults(func=cmd_index)

    qry = sub.add_parser("query", help="retrieve chunks for a question from an index folder")
    qry.add_argument("question", help="the question to retrieve chunks for")
    qry.add_argument("--storage", required=True, help="index folder written by `rkit index`")
    qry.add_argument(
        "--mode", choices=QUERY_MODES, default=None,
        help=f"retriever (default: the gate's calibration mode with --gate, else {DEFAULT_QUERY_MODE})",
    )
    qry.add_argument(
        "-k", "--top-k", type=int, default=None,
        help=f"number of chunks to retrieve (default: the gate's calibration k with --gate, else {DEFAULT_QUERY_TOP_K})",
    )
    qry.add_argument(
        "--trace", action="store_true", help="print what each stage returned and dropped, and why (a table per stage)"
    )
    qry.add_argument(
        "--json", action="store_true",
        help="print one JSON object for programs: question, mode, results (scores, ids, sections, pages, offsets, "
        "leg ranks, text), the gate's decision with --gate and the traces with --trace",
    )
    qry.add_argument(
        "--gate", default=None, metavar="PATH",
        help="a no-answer gate written by `rkit calibrate`: abstain (return nothing, show the best rejected "
        "candidate) when the answer is probably not in the index",
    )
    qry.set_defaults(func=cmd_query)

    cal = sub.add_parser("calibrate", help="fit a no-answer gate on labelled questions (for `rkit query --gate`)")
    cal.add_argument("--storage", required=True, help="index folder written by `rkit index`")
    cal.add_argument(
        "--dataset", required=True,
        help="labelled questions: a JSONL question file (no reference_doc_ids = no answer) or a BEIR folder",
    )
    cal.add_argument("--out", required=True, help="gate file to write (JSON), e.g. gate.json")
    cal.add_argument("--mode", choices=QUERY_MODES, default="hybrid", help="retriever to calibrate (default: %(default)s)")
    cal.add_argument("-k", "--top-k", type=int, default=10, help="chunks retrieved per question (default: %(default)s)")
    cal.add_argument(
        "--target-recall", type=float, default=0.95,
        help="share of answerable questions the gate must keep; sets the threshold (default: %(default)s)",
    )
    cal.add_argument(
        "--exclude-relevant", action=argparse.BooleanOptionalAction, default=True,
        help="also ask each answerable question with its relevant documents filtered out, as extra unanswerable "
        "questions (default: on)",
    )
    cal.set_defaults(func=cmd_calibrate)

    ins = sub.add_parser("inspect", help="show how one file is read and chunked: pages, sections, chunks")
    ins.add_argument("file", help="a PDF, Markdown or text file")
    ins.add_argument("--parser", choices=["window", "hierarchy"], default="window", help="node parser (default: %(default)s)")
    ins.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (children for hierarchy)")
    ins.add_argument("--chunk-overlap", type=int, default=None, help="tokens of overlap")
    ins.add_argument("--show", type=int, default=20, help="list the first N chunks, 0 for all (default: %(default)s)")
    ins.set_defaults(func=cmd_inspect)

    from .evaluation.cli_eval import add_eval_subparser

    add_eval_subparser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rkit``; returns the exit code (see :data:`EXIT_CODES`)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # before any onnxruntime import (no device id under $HOME)
    args = build_parser().parse_args(argv)
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"  # also the libraries' own bars (e.g. transformers' "Loading weights")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        sys.stderr.write("rkit: interrupted\n")
        return EXIT_INTERRUPTED
    except Exception as exc:  # every expected condition becomes one line, never a traceback
        code = _exit_code(exc)
        if code == EXIT_INTERNAL:
            if args.verbose:
                raise
            sys.stderr.write(
                f"rkit: internal error: {type(exc).__name__}: {exc}\n"
                "rkit: run again with --verbose for the traceback, and please report it\n"
            )
        else:
            sys.stderr.write(f"rkit: error: {exc}\n")
        return code


def _exit_code(exc: BaseException) -> int:
    """The exit code for an exception (see :data:`EXIT_CODES`)."""
    from .indices import DamagedIndexError, IndexBusyError, IndexReadOnlyError, IndexWriteLockedError

    if isinstance(exc, (IndexBusyError, IndexWriteLockedError, IndexReadOnlyError)):
        return EXIT_BUSY
    if isinstance(exc, DamagedIndexError):
        return EXIT_DAMAGED
    if isinstance(exc, (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return EXIT_USAGE
    return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
