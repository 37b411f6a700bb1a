"""``rkit``: the command line of llama_index_retrieval_kit.

    rkit demo                                # the main job on the bundled samples
    rkit ingest FILE_OR_DIR ...              # chunk documents, print a summary, write JSONL
    rkit index FILE_OR_DIR ... --storage DIR # build or update a hybrid index folder
    rkit query --storage DIR "question"      # retrieve from an index folder
    rkit eval --dataset PATH --config NAME_OR_YAML ... --out DIR   # compare retrievers, write a report
"""

from __future__ import annotations

import argparse
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


def cmd_query(args: argparse.Namespace) -> int:
    from .indices import HybridIndex

    if not (Path(args.storage) / "index.json").exists():
        raise CLIError(f"{args.storage} holds no index: build one first with `rkit index FILES_OR_FOLDERS --storage {args.storage}`")
    with HybridIndex.load(args.storage) as index:
        retriever = index.as_retriever(mode=args.mode, similarity_top_k=args.top_k)
        if args.trace:
            from .tracing import collect_traces, format_trace

            with collect_traces() as collector:
                results = retriever.retrieve(args.question)
            _print_results(results)
            for trace in collector.traces:
                _out("\n" + format_trace(trace))
        else:
            _print_results(retriever.retrieve(args.question))
    return 0


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
    ing.add_argument("--parser", choices=["window", "hierarchy"], default="window")
    ing.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (children for hierarchy)")
    ing.add_argument("--chunk-overlap", type=int, default=None, help="tokens of overlap")
    ing.add_argument("--out", default=None, help="write chunks as JSONL here")
    ing.add_argument("--show", type=int, default=3, help="print the first N chunks (default: %(default)s)")
    ing.set_defaults(func=cmd_ingest)

    idx = sub.add_parser("index", help="build or update a hybrid index folder from files or folders")
    idx.add_argument("paths", nargs="+", help="files or folders")
    idx.add_argument("--storage", required=True, help="index folder (created, or updated in place)")
    idx.add_argument("--parser", choices=["window", "hierarchy"], default="window")
    idx.add_argument("--chunk-size", type=int, default=None)
    idx.add_argument("--chunk-overlap", type=int, default=None)
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
    qry.add_argument("question")
    qry.add_argument("--storage", required=True)
    qry.add_argument("--mode", choices=["hybrid", "hybrid_score", "hybrid_rrf", "dense", "sparse", "qdrant_hybrid"], default="hybrid")
    qry.add_argument("-k", "--top-k", type=int, default=5, help="number of chunks to show (default: %(default)s)")
    qry.add_argument(
        "--trace", action="store_true", help="print what each stage returned and dropped, and why (a table per stage)"
    )
    qry.set_defaults(func=cmd_query)

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
