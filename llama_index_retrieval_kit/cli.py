"""``rkit``: the command line of llama_index_retrieval_kit.

    rkit demo                                # the main job on the bundled samples
    rkit ingest FILE_OR_DIR ...              # chunk documents, print a summary, write JSONL
    rkit index FILE_OR_DIR ... --storage DIR # build or update a hybrid index folder (--prune: drop deleted files)
    rkit delete --storage DIR DOC_ID ...     # remove documents from an index folder
    rkit purge --storage DIR                 # erase deleted documents' leftovers from the folder's files
    rkit query --storage DIR "question"      # retrieve from an index folder (--json, --gate, --trace)
    rkit calibrate --storage DIR --dataset PATH --out gate.json   # fit a no-answer gate
    rkit inspect FILE                        # pages, sections and chunks of one file
    rkit eval --dataset PATH --config NAME_OR_YAML ... --out DIR   # compare retrievers, write a report

``index``, ``delete``, ``purge``, ``query``, ``calibrate`` and ``eval`` take ``--config pipeline.yaml`` (a
:class:`~llama_index_retrieval_kit.pipeline.PipelineConfig`); an option given on the command line
overrides the config.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ._enums import RetrieverMode

if TYPE_CHECKING:  # pragma: no cover - annotations only (importing the CLI stays light)
    from .pipeline import PipelineConfig

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
    EXIT_USAGE: "bad arguments or input (the message says what to change), a Qdrant server that does not answer "
    "or refuses the API key, or a missing optional extra (the message names it: pip install 'llama-index-retrieval-kit[EXTRA]')",
    EXIT_BUSY: "the index is open or being written by another process (or read-only after a failed write, "
    "being published by a build, a BM25 folder locked by another process for over 60 s, or its cache write "
    "was interrupted: the message says what to do): "
    "close it, or serve the index from a Qdrant server (rkit query and calibrate read it read-only beside "
    "it, but for --mode qdrant_hybrid)",
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
    from .ingest import check_chunks_target, ingest, make_parser, write_chunks_jsonl

    if args.out:
        check_chunks_target(args.out, args.overwrite)  # before anything is read: the file would be replaced
    parser = make_parser(args.parser, args.chunk_size, args.chunk_overlap)
    result = ingest(args.paths, parser, show_progress=not args.quiet)
    _out(_table(result.summary_rows()))
    if result.failures:
        _out(f"\n{len(result.failures)} file(s) could not be read:")
        for f in result.failures:
            _out(f"  - {f}")
    _print_unsupported(args.paths, None)
    if not result.documents:  # nothing read: nothing written (--out keeps what it held)
        _out("\nnothing to ingest: give files or folders holding PDF, Markdown or text files")
        return EXIT_PARTIAL
    if args.out:
        path = write_chunks_jsonl(result.nodes, args.out, overwrite=args.overwrite)
        _out(f"\nwrote {len(result.nodes)} chunks to {path}")
    for node in result.nodes[: args.show]:
        m = node.metadata
        kind = "" if m.get("node_kind", "chunk") == "chunk" else f" {m['node_kind']}"  # hierarchy parents told apart
        _out(f"\n[{m['doc_id']} #{m['chunk_index']}{kind}] {' > '.join(m['section_path']) or '(preamble)'} "
             f"pages {m['page_start']}-{m['page_end']} chars {m['char_start']}-{m['char_end']}")
        _out("  " + node.get_content().strip().replace("\n", "\n  ")[:400])
    return 1 if result.failures and not result.nodes else 0


def _print_results(results: Sequence, width: int = 240) -> None:
    for rank, r in enumerate(results, 1):
        m = r.node.metadata
        legs = getattr(r, "leg_ranks", None)
        leg_text = f"  legs {legs}" if legs else ""
        start, end = m.get("page_start"), m.get("page_end")
        pages = "" if start is None else f"  p.{start}" if end in (None, start) else f"  pp.{start}-{end}"
        _out(f"{rank:>2}. {r.score:.4f}  {m.get('doc_id')}  {m.get('section_header') or '(preamble)'}{pages}{leg_text}")
        _out("      " + " ".join(r.node.get_content().split())[:width])


#: ``--parser`` names -> registered node parser components (pipeline configs).
PARSER_COMPONENTS = {"window": "section_window", "hierarchy": "section_hierarchy"}


def _pipeline_config(args: argparse.Namespace, overrides: dict | None = None):
    """The ``--config`` pipeline with the command line's explicit options applied (None without --config)."""
    path = getattr(args, "config", None)
    if not path:
        return None
    from .pipeline import PipelineConfig

    config = PipelineConfig.from_yaml(path)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    return config.with_overrides(overrides, source=f"{path} with the command line's options") if overrides else config


def _chunking_override(args: argparse.Namespace, config) -> dict | None:
    """The ``chunking`` section after ``--parser`` / ``--chunk-size`` / ``--chunk-overlap`` (None: none given)."""
    if args.parser is None and args.chunk_size is None and args.chunk_overlap is None:
        return None
    from .components import resolve_component
    from .node_parser import SectionHierarchyNodeParser

    section = dict(config.to_dict()["chunking"])
    if args.parser is not None and PARSER_COMPONENTS[args.parser] != section["component"]:
        section = {"component": PARSER_COMPONENTS[args.parser]}  # another parser: the config's options were its own
    hierarchy = issubclass(resolve_component(section["component"]), SectionHierarchyNodeParser)
    if args.chunk_size is not None:
        section["child_chunk_size" if hierarchy else "chunk_size"] = args.chunk_size
    if args.chunk_overlap is not None:
        section["child_chunk_overlap" if hierarchy else "chunk_overlap"] = args.chunk_overlap
    return section


def _index_config(args: argparse.Namespace):
    config = _pipeline_config(args)
    if config is None:
        return None
    overrides = {"index.storage_dir": args.storage, "chunking": _chunking_override(args, config)}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return config.with_overrides(overrides, source=f"{args.config} with the command line's options") if overrides else config


#: ``--parser`` names by the class they build, and the settings ``--chunk-size`` / ``--chunk-overlap`` set.
PARSER_NAMES = {"SectionWindowNodeParser": "window", "SectionHierarchyNodeParser": "hierarchy"}
SIZE_SETTINGS = {"window": ("chunk_size", "chunk_overlap"), "hierarchy": ("child_chunk_size", "child_chunk_overlap")}


def _check_update_chunking(args: argparse.Namespace, storage: Path) -> None:
    """Refuse ``--parser`` / ``--chunk-size`` / ``--chunk-overlap`` that differ from the chunking of
    the index an update writes to: it keeps its own (one chunking per index); ``--rebuild`` changes it."""
    if args.parser is None and args.chunk_size is None and args.chunk_overlap is None:
        return
    from .indices import IndexManifest

    built = IndexManifest.read(storage / "index.json").node_parser
    kind = PARSER_NAMES.get(built.get("class_name"))
    given = [("--chunk-size", args.chunk_size, 0), ("--chunk-overlap", args.chunk_overlap, 1)]
    if kind is None:
        describe = f"node parser {built.get('class_name')}"
        differ = [f"--parser {args.parser}"] if args.parser is not None else []
        differ += [f"{option} {value}" for option, value, _ in given if value is not None]
    else:
        keys = SIZE_SETTINGS[kind]
        describe = f"--parser {kind} --chunk-size {built.get(keys[0])} --chunk-overlap {built.get(keys[1])}"
        differ = [f"--parser {args.parser}"] if args.parser not in (None, kind) else []
        if not differ:  # sizes of the same parser (another parser's sizes mean other settings)
            differ = [f"{option} {value}" for option, value, i in given if value is not None and value != built.get(keys[i])]
    if differ:
        raise CLIError(
            f"{storage} was built with {describe}, and an update keeps the index's chunking; asked for: "
            f"{' '.join(differ)}. Add --rebuild to rebuild the index with the new chunking, or drop these options"
        )


def cmd_index(args: argparse.Namespace) -> int:
    from .indices import HybridIndex
    from .ingest import make_parser, read_documents

    if args.switch and not args.push:
        raise CLIError("--switch moves the index to the server given by --push URL: add --push")
    if args.push_overwrite and not args.push:
        raise CLIError("--push-overwrite is for the collection --push URL writes: add --push")
    if args.push:
        check_server_url(args.push, "--push")  # before anything is read or built
    config = _index_config(args)
    paths = list(args.paths) or (list(config.reader.paths) if config is not None else [])
    if not paths:
        raise CLIError(
            "nothing to index: give files or folders" + (f" (or list them in reader.paths of {args.config})" if args.config else "")
        )
    if args.storage is None and (config is None or config.index.storage_dir is None):
        raise CLIError("--storage is required" + (f" (or index.storage_dir in {args.config})" if args.config else ""))
    storage = Path(args.storage) if args.storage is not None else config.storage_dir
    want_hnsw = bool(args.hnsw or (config is not None and config.index.build_hnsw))
    if config is None and not args.rebuild and (storage / "index.json").exists():
        _check_update_chunking(args, storage)  # (with --config, open_index compares the whole chunking)
    # before reading anything: sizes the parser refuses (overlap >= size) are a usage error at once
    node_parser = make_parser(args.parser or "window", args.chunk_size, args.chunk_overlap) if config is None else None
    reader = _index_reader(args, config)
    documents, failures = read_documents(paths, show_progress=not args.quiet, reader=reader)
    _print_unsupported(paths, reader)
    for f in failures:
        _out(f"could not read {f}")
    folders = _given_folders(paths)
    updating = (storage / "index.json").exists() and not args.rebuild
    if args.prune and not folders:
        _out("--prune: nothing to prune, no folder was given (only documents of files under the folders given are pruned)")
    if not documents:
        _out("nothing to index")
        if not (updating and folders):
            return EXIT_PARTIAL
        with _open_index_to_update(config, storage, show_progress=not args.quiet) as index:  # a folder emptied: its documents may be gone
            vanished = _VanishedDocuments.find(index, folders, keep=(), prune=args.prune)
        vanished.report(_delete_command(args, storage, vanished.doc_ids), folders)
        return EXIT_PARTIAL if failures or not vanished.chunks_deleted else EXIT_OK
    vanished = None
    if updating:
        with _open_index_to_update(config, storage, show_progress=not args.quiet) as index:
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
            vanished = _VanishedDocuments.find(index, folders, keep={d.id_ for d in documents}, prune=args.prune)
            if vanished.chunks_deleted:
                stats["pruned"] = len(vanished.doc_ids)
            if want_hnsw:
                stats["hnsw"] = "optimised" if index.optimize(show_progress=not args.quiet) else "up to date"
            total = len(index)
            _prepare_fast_queries(index)
    else:
        if config is not None:
            from .pipeline import index_build_kwargs

            build_kwargs = index_build_kwargs(config)
            build_kwargs["build_hnsw"] = False  # built below, as for an update (and reported)
        else:
            build_kwargs = {"node_parser": node_parser}
        with HybridIndex.from_documents(
            documents, storage, overwrite=args.rebuild, show_progress=not args.quiet, **build_kwargs
        ) as index:
            stats = {"documents": len(documents), "chunks": len(index)}
            indexed_ids = set(index.doc_ids())
            empty = [d.id_ for d in documents if d.id_ not in indexed_ids]
            if empty:
                stats["empty"] = empty
            if want_hnsw:
                stats["hnsw"] = "optimised" if index.optimize(show_progress=not args.quiet) else "up to date"
            total = len(index)
            _prepare_fast_queries(index)
    empty = stats.pop("empty", None)
    _out(f"indexed {stats}; {total} chunks in {storage}")
    if empty:
        _out(f"{len(empty)} document(s) gave no chunks (no text to index) and are not in the index: {_name_list(empty)}")
    if vanished is not None:
        vanished.report(_delete_command(args, storage, vanished.doc_ids), folders)
    if args.push:
        with HybridIndex.load(storage, show_progress=not args.quiet) as index:
            # its own earlier copy is replaced; another index's or application's collection only with --push-overwrite
            copied = index.push_to(args.push, api_key=os.environ.get("QDRANT_API_KEY"), overwrite=args.push_overwrite, switch=args.switch,
                                   show_progress=not args.quiet)
        where = "the index now lives there" if args.switch else f"serve it with HybridIndex.load({str(storage)!r}, qdrant_url={args.push!r})"
        _out(f"copied {copied} points to {args.push}; {where}")
    return EXIT_PARTIAL if failures else EXIT_OK


def check_server_url(url: str, option: str) -> str:
    """``url`` when it can name a Qdrant server (``[http(s)://]HOST[:PORT][/PATH]``, the forms
    qdrant-client takes: without a scheme it uses http), else a CLIError naming ``option``."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as exc:
        raise CLIError(f"{option} {url!r} is not a server URL ({exc}): give http(s)://HOST:PORT, e.g. http://localhost:6333") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CLIError(f"{option} {url!r} is not a server URL: give http(s)://HOST:PORT, e.g. http://localhost:6333")
    return url


def _open_index_to_update(config, storage: Path, show_progress: bool = False):
    """The existing index ``rkit index`` updates: ``pipeline.open_index(config)`` with a config
    (refusing an index built with other settings than the config's), else ``HybridIndex.load``
    (``show_progress``: the bars of a roll-back or migration on open)."""
    if config is not None:
        from .pipeline import open_index

        return open_index(config, show_progress=show_progress)
    from .indices import HybridIndex

    return HybridIndex.load(storage, show_progress=show_progress)


def _given_folders(paths: Sequence[str | Path]) -> list[Path]:
    """The folders among ``paths``, absolute and resolved (as ``document_origin`` records files)."""
    return [Path(p).resolve() for p in paths if Path(p).is_dir()]


def _holds_nothing(folder: Path) -> bool:
    """Whether ``folder`` is empty (or cannot be listed): ``--prune`` then deletes nothing."""
    try:
        return next(os.scandir(folder), None) is None
    except OSError:
        return True


def file_is_gone(path: str | Path) -> bool:
    """Whether ``path`` no longer exists: its ``stat`` fails with "no such file" (or a folder on
    the way is now a file). Any other failure (permission denied, an I/O error, a share that does
    not answer) counts as present, so that pruning never deletes a document whose file may be there."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def vanished_documents(
    origins: Mapping[str, str | None],
    folders: Sequence[Path],
    is_gone: Callable[[str], bool] = file_is_gone,
    keep: Sequence[str] | set[str] = (),
) -> list[str]:
    """Sorted ids of the indexed documents whose file (``origins``: ``HybridIndex.document_origins()``,
    absolute and resolved) lies under one of ``folders`` (absolute, resolved) and ``is_gone``.

    A document of unknown origin, from a file outside ``folders``, or in ``keep`` (e.g. the ids
    just indexed) is never listed; neither is one whose file still exists but could not be read.
    """
    from pathlib import PurePath

    kept = set(keep)
    return sorted(
        doc_id
        for doc_id, origin in origins.items()
        if origin is not None
        and doc_id not in kept
        and any(PurePath(origin).is_relative_to(folder) for folder in folders)
        and is_gone(origin)
    )


class _VanishedDocuments:
    """The indexed documents whose files were deleted from the folders ``rkit index`` was given:
    listed (with the command that removes them), or deleted with ``--prune``."""

    def __init__(self, origins: dict[str, str], chunks_deleted: int | None) -> None:
        self.origins = origins  # doc id -> the file it came from, which no longer exists
        self.chunks_deleted = chunks_deleted  # None: not pruned (listed only)

    @property
    def doc_ids(self) -> list[str]:
        return list(self.origins)

    @classmethod
    def find(cls, index: Any, folders: Sequence[Path], keep: Sequence[str] | set[str], prune: bool) -> "_VanishedDocuments":
        """Find them in the open ``index``, after its upsert committed; delete them when ``prune``."""
        origins = index.document_origins() if folders else {}
        gone = vanished_documents(origins, folders, keep=keep)
        empty = [folder for folder in folders if _holds_nothing(folder)]
        if prune and gone and empty:  # an unmounted share's mount point looks like this: list, never prune
            _out(
                f"--prune: not pruning, {', '.join(map(str, empty))} holds no files at all (an unmounted drive or share "
                "looks the same); if its files really were all deleted, remove their documents with rkit delete"
            )
            prune = False
        chunks = sum(index.delete(doc_id) for doc_id in gone) if prune and gone else None
        return cls({doc_id: origins[doc_id] for doc_id in gone}, chunks)

    def report(self, delete_command: str, folders: Sequence[Path]) -> None:
        if not self.origins:
            return
        where = ", ".join(map(str, folders))
        if self.chunks_deleted is not None:
            _out(
                f"pruned {len(self.origins)} document(s) ({self.chunks_deleted} chunks) whose files no longer exist "
                f"under {where}: {_name_list(self.doc_ids)}"
            )
            return
        _out(
            f"warning: {len(self.origins)} indexed document(s) came from files that no longer exist under {where}; "
            "they are still in the index and queries still return them:"
        )
        for doc_id, origin in list(self.origins.items())[:20]:
            _out(f"  - {doc_id} (was {origin})")
        if len(self.origins) > 20:
            _out(f"  (and {len(self.origins) - 20} more)")
        _out(f"remove them with: {delete_command}")
        _out("or run this rkit index command again with --prune")


def _delete_command(args: argparse.Namespace, storage: Path, doc_ids: Sequence[str]) -> str:
    """The ``rkit delete`` command line that removes ``doc_ids`` from the index ``rkit index`` wrote."""
    import shlex

    words = ["rkit", "delete"]
    if getattr(args, "config", None):
        words += ["--config", str(args.config)]
    if not getattr(args, "config", None) or args.storage is not None:
        words += ["--storage", str(storage)]
    return shlex.join([*words, *doc_ids])


def _index_reader(args: argparse.Namespace, config):
    """The reader of ``rkit index``: the config's (with ``--keep-headers-footers`` applied when its
    reader has the option), else a DocumentFolderReader."""
    from .readers.text import DocumentFolderReader

    keep = bool(getattr(args, "keep_headers_footers", False))
    if config is None:
        return DocumentFolderReader(remove_headers_footers=False) if keep else DocumentFolderReader()
    from .components import component_options
    from .pipeline import make_reader

    if keep:
        if "remove_headers_footers" not in component_options(config.reader.component_class()):
            raise CLIError(
                f"--keep-headers-footers: the reader of {args.config} ({config.reader.component}) has no "
                "remove_headers_footers option; use the document_folder or pdf reader, or drop the flag"
            )
        config = config.with_overrides({"reader.remove_headers_footers": False}, source=f"{args.config} with --keep-headers-footers")
    return make_reader(config)


def _name_list(names: Sequence[str], limit: int = 20) -> str:
    """``names`` joined with commas, the first ``limit`` of them and how many more."""
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def _print_unsupported(paths: Sequence[str], reader) -> None:
    """Print the files of the folders in ``paths`` that were skipped as unsupported types."""
    from .readers.text import DocumentFolderReader

    lister = reader if isinstance(reader, DocumentFolderReader) else DocumentFolderReader()
    skipped = [str(f) for p in paths if Path(p).is_dir() for f in lister.list_folder(p).unsupported]
    if skipped:
        _out(f"skipped {len(skipped)} file(s) of unsupported types: {_name_list(skipped)}")


def cmd_migrate(args: argparse.Namespace) -> int:
    from .indices import HybridIndex

    _require_index(args.storage)
    before = json.loads((Path(args.storage) / "index.json").read_text(encoding="utf-8")).get("format_version")
    with HybridIndex.load(args.storage, show_progress=not args.quiet) as index:  # a format-1 folder is migrated by opening it
        chunks = len(index)
    _out(
        f"{args.storage}: migrated to Qdrant Edge ({chunks} chunks)" if before == 1 else f"{args.storage}: already current ({chunks} chunks)"
    )
    return EXIT_OK


def _open_index_to_delete(args: argparse.Namespace) -> tuple[Any, Path]:
    """The index ``rkit delete`` (and ``rkit purge``) writes to and its folder: ``--storage``, or the
    ``--config``'s index (``--storage`` overriding ``index.storage_dir``). Deleting and purging embed
    nothing: the query embedder (without PyTorch when an export is recorded) stands in for the model."""
    if args.config:
        from .models import query_embed_model
        from .pipeline import open_index

        config = _pipeline_config(args, {"index.storage_dir": args.storage})
        if config.index.storage_dir is None:
            raise CLIError(f"--storage is required (or index.storage_dir in {args.config})")
        e = config.embedding
        embed_model = query_embed_model(e.model, query_backend=e.query_backend, embed_batch_size=e.embed_batch_size)
        return open_index(config, embed_model=embed_model, check=False), config.storage_dir  # any chunking: nothing is chunked
    if args.storage is None:
        raise CLIError("--storage is required (or give --config with index.storage_dir)")
    _require_index(args.storage)
    from .indices import HybridIndex

    storage = Path(args.storage)
    return HybridIndex.load(storage, embed_model=_query_embed_model_of(storage), show_progress=not args.quiet), storage


def _unknown_ids_message(unknown: Sequence[str], index: Any, storage: Path) -> str:
    """Why ``unknown`` ids cannot be deleted, with the near ids, the documents of files named
    instead of ids, and how to see every indexed id."""
    import difflib

    from .indices.hybrid_index import document_origin

    known = index.doc_ids()
    by_file = {origin: doc_id for doc_id, origin in index.document_origins().items() if origin}
    hints = []
    for name in unknown:
        file_id = by_file.get(document_origin({"file_path": name}) or "")  # a file named instead of its id
        if file_id is not None:
            hints.append(f"{name!r} is the file of document {file_id!r}.")
            continue
        close = difflib.get_close_matches(name, known, n=3)
        if close:
            hints.append(f"{name!r}: did you mean {' or '.join(map(repr, close))}?")
    listing = f"{storage} holds {len(known)}: {_name_list(known)}" if known else f"{storage} holds no documents"
    more = (
        f" (every id: python -c \"from llama_index_retrieval_kit.indices import HybridIndex; "
        f"print(*HybridIndex.load({str(storage)!r}, read_only=True).doc_ids(), sep=chr(10))\")"
        if len(known) > 20
        else ""
    )
    return (
        f"{len(unknown)} id(s) not in {storage}, nothing deleted: {', '.join(map(repr, unknown))}. "
        + "".join(h + " " for h in hints)
        + "Document ids are the files' paths relative to the folder given to `rkit index` (doc_id in "
        f"`rkit query --json`); {listing}{more}. Add --missing-ok to delete the known ids and skip the others"
    )


def cmd_delete(args: argparse.Namespace) -> int:
    doc_ids = list(dict.fromkeys(args.doc_ids))  # each once, in the order given
    index, storage = _open_index_to_delete(args)
    deleted: list[tuple[str, int]] = []
    with index:
        known = set(index.doc_ids())
        unknown = [doc_id for doc_id in doc_ids if doc_id not in known]
        if unknown and not args.missing_ok:
            raise CLIError(_unknown_ids_message(unknown, index, storage))  # before anything is deleted
        try:
            for doc_id in doc_ids:
                if doc_id in known:
                    deleted.append((doc_id, index.delete(doc_id)))  # one commit per document
        except BaseException:
            if deleted:
                sys.stderr.write(f"rkit: deleted before the error: {_name_list([d for d, _ in deleted])}\n")
            raise
        remaining = len(index)
    if unknown:
        _out(f"not in {storage}, skipped (--missing-ok): {_name_list(unknown)}")
    if deleted:
        _out(
            f"deleted {len(deleted)} document(s) ({sum(n for _, n in deleted)} chunks) from {storage}: "
            f"{_name_list([d for d, _ in deleted])}; {remaining} chunks remain"
        )
    else:
        _out(f"nothing deleted; {remaining} chunks in {storage}")
    if deleted:
        _out(f"to erase their text from the folder's files too (an erasure request): {_purge_command(args, storage)}")
    return EXIT_OK


def _purge_command(args: argparse.Namespace, storage: Path) -> str:
    """The ``rkit purge`` command line for the index ``rkit delete`` wrote to (as it was named)."""
    import shlex

    words = ["rkit", "purge"]
    if getattr(args, "config", None):
        words += ["--config", str(args.config)]
    if not getattr(args, "config", None) or args.storage is not None:
        words += ["--storage", str(storage)]
    return shlex.join(words)


def _bytes(n: int) -> str:
    """A byte count for people (``1.5 MiB``); negative when the folder grew."""
    size = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            text = f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
            return f"-{text}" if n < 0 else text
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def cmd_purge(args: argparse.Namespace) -> int:
    index, storage = _open_index_to_delete(args)
    with index:
        stats = index.purge(show_progress=not args.quiet)
    _out(
        f"purged {storage}: the Qdrant Edge shard was written afresh with the {stats['points']} committed chunk(s) "
        f"(deleted and replaced chunks' text is gone from its WAL and segments); {stats['cache_rows_removed']} cached "
        f"embedding(s) of chunks no longer indexed deleted ({stats['cache_rows']} kept); {_bytes(stats['bytes_freed'])} freed. "
        "Copies pushed to a Qdrant server keep the old text until you push again"
    )
    return EXIT_OK


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


QUERY_MODES = tuple(m.value for m in RetrieverMode)
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

    if Path(path).is_dir():
        raise CLIError(f"--gate {path} is a folder: give a gate file written by `rkit calibrate ... --out FILE`, e.g. {Path(path) / 'gate.json'}")
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


def _query_config(args: argparse.Namespace):
    """The ``--config`` pipeline with ``--storage``, ``--mode``, ``-k`` and ``--gate`` applied."""
    overrides = {
        "index.storage_dir": args.storage,
        "retriever.mode": args.mode,
        "retriever.similarity_top_k": _positive_k(args.top_k) if args.top_k is not None else None,
    }
    if args.gate is not None:
        if not Path(args.gate).is_file():
            _load_gate(args.gate)  # the CLI's error for a missing gate file
        overrides.update({"no_answer.gate_path": str(args.gate), "no_answer.enabled": True})
    config = _pipeline_config(args, overrides)
    if config.index.storage_dir is None:
        raise CLIError(f"--storage is required (or index.storage_dir in {args.config})")
    return config


def _run_stages(question: str, results: list, stages: Sequence) -> tuple[list, dict | None, list]:
    """Results through the precision stages: (kept, the gate's decision or None, the gate's input)."""
    from llama_index.core.schema import QueryBundle

    from .postprocessor.no_answer import NoAnswerPostprocessor

    nodes, decision, gate_input = list(results), None, list(results)
    for stage in stages:
        if isinstance(stage, NoAnswerPostprocessor):
            gate_input = nodes
            nodes, decision = _apply_gate(stage, question, nodes)
            if not nodes:
                break
        else:
            nodes = stage.postprocess_nodes(nodes, query_bundle=QueryBundle(question))
    return nodes, decision, gate_input


def _query(retriever, question: str, stages: Sequence) -> tuple[list, dict | None, list]:
    """Retrieve and run the precision stages as one LlamaIndex query (QueryStart/QueryEnd events,
    so a trace collector groups every stage, the gate and the context assembly included, into one trace)."""
    from llama_index.core.base.response.schema import Response
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.events.query import QueryEndEvent, QueryStartEvent

    dispatcher = get_dispatcher(__name__)

    @dispatcher.span
    def run(query_str: str) -> tuple[list, dict | None, list]:
        dispatcher.event(QueryStartEvent(query=query_str))
        results = retriever.retrieve(query_str)
        out = _run_stages(query_str, results, stages)
        dispatcher.event(QueryEndEvent(query=query_str, response=Response(response=None, source_nodes=list(out[0]))))
        return out

    return run(question)


def _open_or_read_only(open_index: Callable[[bool], Any], storage: Path, engine_side: bool) -> Any:
    """``open_index(False)``; when another process holds the folder (it is open or being written
    there), ``open_index(True)``: the committed index read-only (``HybridIndex.load(read_only=True)``),
    with a note on stderr, unless the caller searches in the engine (``engine_side``), which needs
    the shard."""
    from .indices import IndexBusyError

    try:
        return open_index(False)
    except IndexBusyError:
        if engine_side:
            raise
    index = open_index(True)
    sys.stderr.write(f"rkit: {storage} is open in another process: answering from its last committed state (read-only)\n")
    return index


def _prepare_fast_queries(index: Any) -> None:
    """While ``rkit index`` has the embedding model loaded: record its torch-free query path
    (``FastHuggingFaceEmbedding.ensure_query_export``; seconds, once per machine and model), so
    the first ``rkit query`` already starts without PyTorch."""
    ensure = getattr(index.embed_model, "ensure_query_export", None)
    if callable(ensure):
        ensure()


def _query_embed_model_of(storage: Path) -> Any:
    """The query embedder for the folder's model (:func:`models.query_embed_model`: without
    PyTorch when an earlier query recorded a checked export), or None to let ``HybridIndex.load``
    choose (a model other than the default as it comes, which it names, or a folder it will explain
    is damaged)."""
    from .indices.manifest import IndexManifest
    from .indices.storage import MANIFEST
    from .models import DEFAULT_EMBED_MODEL, query_embed_model

    try:
        manifest = IndexManifest.read(Path(storage) / MANIFEST, storage_dir=storage)
    except Exception:  # HybridIndex.load reads it again and says what is wrong
        return None
    as_it_comes = manifest.embed_model == DEFAULT_EMBED_MODEL and manifest.embed_settings_match({})
    return query_embed_model() if as_it_comes else None


def _open_for_query(storage: Path, mode: str, show_progress: bool = False) -> Any:
    """The index folder ``storage`` for a command that only reads it (:func:`_open_or_read_only`),
    with the query embedder of :func:`_query_embed_model_of` (``show_progress``: the bars of a
    roll-back or migration on a writable open)."""
    from .indices import HybridIndex

    embed_model = _query_embed_model_of(storage)
    return _open_or_read_only(
        lambda read_only: HybridIndex.load(storage, read_only=read_only, embed_model=embed_model, show_progress=show_progress),
        storage,
        mode == "qdrant_hybrid",
    )


def _open_config_index_for_reading(config: PipelineConfig, show_progress: bool = False) -> Any:
    """``pipeline.open_index(config)`` for a command that only reads it (:func:`_open_or_read_only`),
    with the config's model as a query embedder (:func:`models.query_embed_model`;
    ``show_progress``: the bars of a roll-back or migration on a writable open)."""
    from .models import query_embed_model
    from .pipeline import open_index

    e = config.embedding
    embed_model = query_embed_model(e.model, query_backend=e.query_backend, embed_batch_size=e.embed_batch_size)
    engine_side = config.retriever.mode == "qdrant_hybrid" or config.retriever.dense_search == "qdrant"
    return _open_or_read_only(
        lambda read_only: open_index(config, embed_model=embed_model, read_only=read_only, show_progress=show_progress),
        config.storage_dir,
        engine_side,
    )


def cmd_query(args: argparse.Namespace) -> int:
    from contextlib import ExitStack, nullcontext

    if not args.question.strip():  # retrievers would rank every chunk by nothing
        raise CLIError(
            f"the question is empty ({args.question!r}): give the question to retrieve chunks for, "
            "e.g. rkit query \"What is the late fee?\" --storage DIR"
        )
    config = _query_config(args) if args.config else None
    if config is None:
        if args.storage is None:
            raise CLIError("--storage is required (or give --config with index.storage_dir)")
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
        stages: list = [gate] if gate is not None else []
        gate_path = args.gate
        trace = bool(args.trace)
    else:
        _require_index(config.storage_dir)
        from .pipeline import build_postprocessors

        mode, top_k = config.retriever.mode, config.retriever.similarity_top_k
        stages = build_postprocessors(config)
        gate_path = config.no_answer.gate_path if config.stage_enabled("no_answer") else None
        trace = config.tracing.enabled if args.trace is None else bool(args.trace)

    from .indices import HybridIndex

    traces: list = []
    with ExitStack() as stack:
        if config is None:
            index = stack.enter_context(_open_for_query(args.storage, mode, show_progress=not args.quiet))
            retriever = index.as_retriever(mode=mode, similarity_top_k=top_k)
        else:
            from .pipeline import build_retriever

            index = stack.enter_context(_open_config_index_for_reading(config, show_progress=not args.quiet))
            retriever = stack.enter_context(build_retriever(config, index=index))
        if trace:
            from .tracing import TraceCollector

            collector = None
            if config is not None and config.tracing.enabled:
                from .pipeline import make_tracer

                collector = make_tracer(config)  # a JsonlTraceWriter with tracing.jsonl_path
            context = collector if collector is not None else TraceCollector()
        else:
            context = nullcontext(None)
        with context as collector:
            kept, decision, gate_input = _query(retriever, args.question, stages)
        if collector is not None:
            traces = list(collector.traces)

    if args.json:
        payload = {
            "question": args.question,
            "mode": mode,
            "top_k": top_k,
            "results": [_result_dict(rank, r) for rank, r in enumerate(kept, 1)],
        }
        if args.config:
            payload["config"] = str(args.config)
        if decision is not None:
            payload["gate"] = {"path": str(gate_path) if gate_path else None, **decision}
        if trace:
            payload["traces"] = [t.to_dict() for t in traces]
        _out(json.dumps(_json_safe(payload), ensure_ascii=False))
        return EXIT_OK

    if decision is not None and decision["abstained"]:
        conf = decision["confidence"]
        conf_text = f"confidence {conf:.4f} < threshold {decision['threshold']:.4f}" if conf is not None else "every chunk was below the similarity cutoff"
        _out(f"NO ANSWER: the gate abstained ({conf_text}): the answer is probably not in the index.")
        if gate_input:
            _out("best rejected candidate:")
            _print_results(gate_input[:1])
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

        for trace_record in traces:
            _out("\n" + format_trace(trace_record))
    return EXIT_OK


DEFAULT_CALIBRATE_MODE = "hybrid"
DEFAULT_CALIBRATE_TOP_K = 10


def cmd_calibrate(args: argparse.Namespace) -> int:
    if not 0.0 < args.target_recall <= 1.0:
        raise CLIError(f"--target-recall must be in (0, 1], got {args.target_recall}")
    config = None
    if args.config:
        config = _pipeline_config(args, {
            "index.storage_dir": args.storage,
            "retriever.mode": args.mode,
            "retriever.similarity_top_k": _positive_k(args.top_k) if args.top_k is not None else None,
        })
        if config.index.storage_dir is None:
            raise CLIError(f"--storage is required (or index.storage_dir in {args.config})")
        storage = config.storage_dir
        mode, top_k = config.retriever.mode, config.retriever.similarity_top_k
        out_text = args.out or (config.no_answer.gate_path if config.no_answer is not None else None)
        if out_text is None:
            raise CLIError(f"--out is required (or no_answer.gate_path in {args.config})")
    else:
        if args.storage is None:
            raise CLIError("--storage is required (or give --config with index.storage_dir)")
        if args.out is None:
            raise CLIError("--out is required: the gate file to write, e.g. gate.json")
        storage = Path(args.storage)
        mode = args.mode or DEFAULT_CALIBRATE_MODE
        top_k = _positive_k(args.top_k if args.top_k is not None else DEFAULT_CALIBRATE_TOP_K)
        out_text = args.out
    _require_index(storage)
    out = Path(out_text)
    if out.is_dir():
        raise CLIError(f"--out {out} is a folder: give a file name such as {out / 'gate.json'}")

    from contextlib import ExitStack

    from .evaluation import load_dataset
    from .postprocessor.no_answer import NoAnswerPostprocessor, check_gate_target

    check_gate_target(out, args.overwrite)  # before calibrating: a dataset or config there would be replaced

    dataset = load_dataset(args.dataset, split=getattr(args, "split", None))
    reranker = None
    with ExitStack() as stack:
        if config is None:
            index = stack.enter_context(_open_for_query(storage, mode, show_progress=not args.quiet))

            def make_retriever(filters=None):
                return index.as_retriever(mode, similarity_top_k=top_k, filters=filters)
        else:
            from .pipeline import PostprocessedRetriever

            index = stack.enter_context(_open_config_index_for_reading(config, show_progress=not args.quiet))
            options = config.retriever.as_retriever_kwargs()
            base_filters = options.pop("filters", None)
            if config.stage_enabled("reranker"):
                reranker = config.reranker.build()  # the gate will run after it: calibrate on reranked results
                if hasattr(reranker, "load"):
                    reranker.load()  # a model that cannot load is its own error, before any calibration

            def make_retriever(filters=None):
                if base_filters is not None and filters is not None:
                    from llama_index.core.vector_stores.types import MetadataFilters

                    filters = MetadataFilters(filters=[base_filters, filters], condition="and")
                retriever = index.as_retriever(filters=filters or base_filters, **options)
                return PostprocessedRetriever(retriever, [reranker]) if reranker is not None else retriever

        exclusion = make_retriever if args.exclude_relevant else None
        try:
            gate = NoAnswerPostprocessor.calibrate(
                make_retriever(),
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
    report["retriever"] = {"mode": mode, "similarity_top_k": top_k, "exclude_relevant": bool(args.exclude_relevant)}
    if config is not None:
        report["retriever"].update({k: v for k, v in config.retriever.model_dump(mode="json").items() if v is not None})
        report["config"] = str(args.config)
    if reranker is not None:
        from .components import component_to_dict

        report["reranker"] = component_to_dict(reranker)
    report["dataset"] = str(args.dataset)
    report["split"] = dataset.split or None
    report["in_sample"] = True  # the figures are measured on the calibration questions themselves
    gate.fit_report = report
    path = gate.save(out, overwrite=args.overwrite)
    _out(f"no-answer gate calibrated on {args.dataset} (--mode {mode} -k {top_k}"
         f"{', after the reranker' if reranker is not None else ''}"
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
    split = f" ({dataset.split} split)" if dataset.split else ""
    held_out = (
        "for BEIR calibrate on a train/dev split (--split train) and measure the gate on the test split "
        "(rkit eval --split test)" if dataset.split else "measure the gate on other questions than it was calibrated on"
    )
    _out(f"\nin-sample: these figures are measured on the calibration questions themselves{split}, the ones the "
         f"threshold was fitted on; expect lower on new questions: {held_out}")
    if config is not None and config.no_answer is not None and config.no_answer.gate_path and Path(config.no_answer.gate_path).resolve() == path.resolve():
        _out(f"\nwrote {path}; {args.config} uses it: `rkit query QUESTION --config {args.config}`")
    elif config is not None:
        _out(f"\nwrote {path}; use it with `rkit query QUESTION --config {args.config} --gate {path}` "
             "(or set no_answer.gate_path in the config)")
    else:
        _out(f"\nwrote {path}; use it with `rkit query QUESTION --storage {storage} --gate {path}`")
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


#: Marks a folder as ``rkit demo``'s output: a later demo run may replace what it wrote there.
DEMO_MARKER = ".rkit-demo.json"
#: What ``rkit demo`` writes into its ``--out`` folder (besides the sample PDF, never overwritten).
DEMO_OUTPUTS = ("index", "chunks.jsonl", "eval")


def _check_demo_folder(out: Path) -> None:
    """Refuse an ``--out`` folder holding an index, chunks or a report that no earlier demo wrote
    (the demo rebuilds ``index`` and replaces the others): before anything is written."""
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} is a file: give a folder for the demo's output")
    if (out / DEMO_MARKER).is_file():
        return
    clashes = [name for name in DEMO_OUTPUTS if os.path.lexists(out / name)]
    if clashes:
        raise CLIError(
            f"--out {out} holds {', '.join(clashes)} that no earlier `rkit demo` wrote (the demo would replace "
            "them): choose another --out, e.g. the default rkit_output/demo"
        )


def cmd_demo(args: argparse.Namespace) -> int:
    from ._extras import REPORT_MODULES, require_extras

    # Before any work: the demo writes the sample PDF (fpdf2) and ends with the evaluation report.
    require_extras("rkit demo", {"samples": "fpdf", "eval": REPORT_MODULES})
    from .ingest import ingest, write_chunks_jsonl
    from .node_parser import SectionWindowNodeParser
    from .samples import sample_files, sample_pdf

    out = Path(args.out)
    _check_demo_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARKER).write_text('{"written_by": "rkit demo"}\n', encoding="utf-8")
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

    _out("\n== Hybrid index (BM25 + all-MiniLM-L6-v2 in an embedded Qdrant Edge shard, hybrid fusion with a feedback leg) ==")
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


CONFIG_HELP = "a pipeline config (YAML, see examples/pipeline.yaml); options given on the command line override it"


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``minimum`` (anything else is a usage error naming it)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
        return value

    return parse


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
    ing.add_argument("--chunk-size", type=whole_number(1), default=None, help="tokens per chunk (children for hierarchy)")
    ing.add_argument("--chunk-overlap", type=whole_number(0), default=None, help="tokens of overlap")
    ing.add_argument("--out", default=None, help="write chunks as JSONL here (replaces a chunks file written before)")
    ing.add_argument("--overwrite", action="store_true", help="let --out replace a file that is not a chunks file")
    ing.add_argument("--show", type=whole_number(0), default=3, help="print the first N chunks (default: %(default)s)")
    ing.set_defaults(func=cmd_ingest)

    idx = sub.add_parser("index", help="build or update a hybrid index folder from files or folders")
    idx.add_argument("paths", nargs="*", help="files or folders (default with --config: its reader.paths)")
    idx.add_argument("--config", default=None, metavar="FILE", help=CONFIG_HELP)
    idx.add_argument("--storage", default=None, help="index folder (created, or updated in place); required without --config")
    idx.add_argument(
        "--parser", choices=["window", "hierarchy"], default=None,
        help="node parser (default: window, or the config's); an update keeps the index's chunking: "
        "--parser / --chunk-* that differ from it are refused without --rebuild",
    )
    idx.add_argument("--chunk-size", type=whole_number(1), default=None, help="tokens per chunk (children for hierarchy)")
    idx.add_argument("--chunk-overlap", type=whole_number(0), default=None, help="tokens of overlap")
    idx.add_argument("--rebuild", action="store_true", help="replace an existing index instead of updating it")
    idx.add_argument(
        "--keep-headers-footers",
        action="store_true",
        help="keep the lines PDF clean-up would remove as running headers, footers and page numbers "
        "(the readers' remove_headers_footers=False; with --config, sets reader.remove_headers_footers: false)",
    )
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
    idx.add_argument(
        "--push",
        default=None,
        metavar="URL",
        help="after indexing, copy the embedded index's points to this Qdrant server, served as the index's "
        "collection (default 'chunks'), replacing the copy this index pushed before; a collection of that name "
        "written by another index or application is refused unless --push-overwrite (API key from "
        "$QDRANT_API_KEY); the folder keeps its own copy unless --switch",
    )
    idx.add_argument(
        "--push-overwrite",
        action="store_true",
        help="with --push: replace the server's collection of that name even when another index or application wrote it",
    )
    idx.add_argument("--switch", action="store_true", help="with --push: move the folder to the server for good")
    idx.add_argument(
        "--hnsw",
        action="store_true",
        help="also build the embedded engine's HNSW index (used by qdrant_hybrid and dense_search='qdrant' only; "
        "the default modes search exactly in memory); about 0.6 ms per chunk",
    )
    idx.add_argument(
        "--prune",
        action="store_true",
        help="when updating: delete the indexed documents whose files were under the folders given and no "
        "longer exist (default: list them with the rkit delete command that removes them); documents "
        "indexed from elsewhere, and files that exist but could not be read, are never touched",
    )
    idx.set_defaults(func=cmd_index)

    dlt = sub.add_parser("delete", help="remove documents (by id) from an index folder")
    dlt.add_argument(
        "doc_ids", nargs="+", metavar="DOC_ID",
        help="document ids, as rkit index gave them: the file's path relative to the folder indexed (doc_id in `rkit query --json`)",
    )
    dlt.add_argument("--config", default=None, metavar="FILE", help=CONFIG_HELP + "; deletes from its index.storage_dir")
    dlt.add_argument("--storage", default=None, help="index folder written by `rkit index`; required without --config")
    dlt.add_argument(
        "--missing-ok",
        action="store_true",
        help="skip ids that are not in the index (listed) instead of refusing (by default an unknown id is an "
        "error and nothing is deleted)",
    )
    dlt.set_defaults(func=cmd_delete)

    prg = sub.add_parser(
        "purge",
        help="erase from an index folder's files what deletes and updates removed (Qdrant Edge's WAL and segments, "
        "the embedding cache keep it until then); run after rkit delete for an erasure request",
    )
    prg.add_argument("--config", default=None, metavar="FILE", help=CONFIG_HELP + "; purges its index.storage_dir")
    prg.add_argument("--storage", default=None, help="index folder written by `rkit index`; required without --config")
    prg.set_defaults(func=cmd_purge)

    mig = sub.add_parser("migrate", help="convert an index folder of the old format (Qdrant local mode) to Qdrant Edge")
    mig.add_argument("storage", help="the index folder (vectors come from its embedding cache; nothing is lost)")
    mig.set_defaults(func=cmd_migrate)

    qry = sub.add_parser("query", help="retrieve chunks for a question from an index folder")
    qry.add_argument("question", help="the question to retrieve chunks for")
    qry.add_argument(
        "--config", default=None, metavar="FILE",
        help=CONFIG_HELP + "; runs its retriever, gate, reranker and context assembly",
    )
    qry.add_argument("--storage", default=None, help="index folder written by `rkit index`; required without --config")
    qry.add_argument(
        "--mode", choices=QUERY_MODES, default=None,
        help=f"retriever (default: the gate's calibration mode with --gate, else {DEFAULT_QUERY_MODE})",
    )
    qry.add_argument(
        "-k", "--top-k", type=int, default=None,
        help=f"number of chunks to retrieve (default: the gate's calibration k with --gate, else {DEFAULT_QUERY_TOP_K})",
    )
    qry.add_argument(
        "--trace", action=argparse.BooleanOptionalAction, default=None,
        help="print what each stage returned and dropped, and why (a table per stage); default: off, or the config's tracing",
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

    cal = sub.add_parser(
        "calibrate", help="fit a no-answer gate on labelled questions (for `rkit query --gate`)",
        description="Fit a no-answer gate on labelled questions (for `rkit query --gate`). The figures it prints are "
        "measured on the calibration questions themselves (in-sample); for a BEIR folder calibrate on a train/dev "
        "split (--split train) and measure the gate on the test split (`rkit eval --split test`).",
    )
    cal.add_argument(
        "--config", default=None, metavar="FILE",
        help=CONFIG_HELP + "; calibrates on its retriever (after its reranker, when it has one)",
    )
    cal.add_argument("--storage", default=None, help="index folder written by `rkit index`; required without --config")
    cal.add_argument(
        "--dataset", required=True,
        help="labelled questions: a JSONL question file (no reference_doc_ids = no answer) or a BEIR folder",
    )
    cal.add_argument(
        "--split", default=None, metavar="NAME",
        help="BEIR split to calibrate on, one of the folder's (default: test). The figures printed are measured "
        "on these same questions (in-sample): for BEIR calibrate on train or dev and evaluate with "
        "`rkit eval --split test`; not for a JSONL question file",
    )
    cal.add_argument(
        "--out", default=None,
        help="gate file to write (JSON), e.g. gate.json; required without --config (default there: its no_answer.gate_path). "
        "A gate saved there before is replaced; any other file only with --overwrite",
    )
    cal.add_argument("--overwrite", action="store_true", help="let --out replace a file that is not a saved gate")
    cal.add_argument(
        "--mode", choices=QUERY_MODES, default=None,
        help=f"retriever to calibrate (default: {DEFAULT_CALIBRATE_MODE}, or the config's)",
    )
    cal.add_argument(
        "-k", "--top-k", type=int, default=None,
        help=f"chunks retrieved per question (default: {DEFAULT_CALIBRATE_TOP_K}, or the config's similarity_top_k)",
    )
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
    ins.add_argument("--chunk-size", type=whole_number(1), default=None, help="tokens per chunk (children for hierarchy)")
    ins.add_argument("--chunk-overlap", type=whole_number(0), default=None, help="tokens of overlap")
    ins.add_argument("--show", type=whole_number(0), default=20, help="list the first N chunks, 0 for all (default: %(default)s)")
    ins.set_defaults(func=cmd_inspect)

    from .evaluation.cli_eval import add_eval_subparser

    add_eval_subparser(sub)
    # Global options also after the subcommand (``rkit query ... -q``); SUPPRESS keeps the value
    # given before the subcommand when they are not repeated after it.
    for command in sub.choices.values():
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log debug messages")
        command.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bars")
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
    if not args.verbose:  # qdrant-client's two-line warning before a server error that rkit reports in one line
        warnings.filterwarnings("ignore", message="Failed to obtain server version")
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
            sys.stderr.write(f"rkit: error: {error_text(exc)}\n")
        return code


def _server_error(exc: BaseException) -> str | None:
    """How a Qdrant server failed when ``exc`` comes from talking to one (unreachable, or refusing
    the API key), else None. Looked up among the modules already imported: a command that talked to
    no server imported none of them."""
    qdrant = sys.modules.get("qdrant_client.http.exceptions")
    httpx = sys.modules.get("httpx")
    transport = tuple(
        kind
        for kind in (getattr(qdrant, "ResponseHandlingException", None), getattr(httpx, "TransportError", None))
        if isinstance(kind, type)
    )
    if transport and isinstance(exc, transport):
        return "did not answer"
    refused = getattr(qdrant, "UnexpectedResponse", None)
    if isinstance(refused, type) and isinstance(exc, refused) and getattr(exc, "status_code", None) in (401, 403):
        return "refused the API key"
    return None


def error_text(exc: BaseException) -> str:
    """What ``rkit: error:`` says for an expected condition: one line for a pydantic
    ``ValidationError`` (not pydantic's lines and help links), what to check for a Qdrant server's error."""
    failed = _server_error(exc)
    if failed is not None:
        return (
            f"the Qdrant server {failed} ({type(exc).__name__}: {' '.join(str(exc).split())}): check its URL (--push URL, "
            "index.qdrant_url, or the one in index.json of an index on a server), the API key ($QDRANT_API_KEY, or the "
            "variable index.qdrant_api_key_env names) and that the server is running, then run the command again"
        )
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(exc, pydantic.ValidationError):
        from ._errors import validation_error_text

        return validation_error_text(exc)
    return str(exc)


def _exit_code(exc: BaseException) -> int:
    """The exit code for an exception (see :data:`EXIT_CODES`)."""
    from ._extras import MissingExtraError

    if isinstance(exc, MissingExtraError):  # an optional extra is not installed: the message names it
        return EXIT_USAGE
    if _server_error(exc) is not None:  # a wrong URL or key, a server that is down: the message says what to check
        return EXIT_USAGE
    from ._files import FolderLockTimeout
    from .indices import (
        DamagedIndexError,
        IndexBeingPublishedError,
        IndexBusyError,
        IndexReadOnlyError,
        IndexWriteLockedError,
        InterruptedCacheWriteError,
    )

    busy = (IndexBusyError, IndexWriteLockedError, IndexReadOnlyError, IndexBeingPublishedError, InterruptedCacheWriteError, FolderLockTimeout)
    if isinstance(exc, busy):
        return EXIT_BUSY
    if isinstance(exc, DamagedIndexError):
        return EXIT_DAMAGED
    if isinstance(exc, (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return EXIT_USAGE
    return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
