"""The evaluation job: dataset + retriever configurations -> scores, report folder.

:func:`run_eval` reads a dataset (a BEIR folder, or a JSONL question file plus the documents
it is about), chunks the documents once per distinct chunking, builds what each configuration
needs once (a :class:`~llama_index_retrieval_kit.indices.HybridIndex` per chunking + embedding
model + BM25 parameters; LlamaIndex's own retrievers over the same nodes), retrieves for
every query, scores (:mod:`.evaluate`) and writes the report (:mod:`.report`).

Layout of ``out_dir``::

    metrics.json  per_query.csv  summary.md  runs/<config>.jsonl  *.png     the report
    indexes/hybrid-<key>/        a HybridIndex (with its embeddings.sqlite cache)
    indexes/llamaindex-<key>/    the embedding cache of LlamaIndex's VectorStoreIndex

Re-running with unchanged inputs reopens the indexes (nothing is embedded again); when the
documents or settings changed, the index is rebuilt but its embedding cache is kept, so only
new texts are embedded. A BEIR document is indexed as ``title + "\\n\\n" + text`` under its
doc id. Depth: for doc-level relevance each retriever returns enough chunks to be sure to hold
``max(ks)`` distinct documents (see :func:`fill_depth`), otherwise ``max(ks)`` chunks; a
config's ``similarity_top_k`` overrides both (it counts chunks; when it returns fewer than ``k``
items for most queries, the report flags its metrics at that ``k``). Each result is scored in
relevance order (by score, see :func:`~.evaluate.ranked_by_score`), whatever order a context
assembler presents it in. ``split`` picks the BEIR split (default ``"test"``).

A ``bm25`` config whose index would hold no dense leg (no dense config with the same chunking
and BM25 settings) uses the same BM25 retriever directly over the nodes, without embedding.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sqlite3
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from llama_index.core.schema import BaseNode, Document, MetadataMode

from .configs import HYBRID_INDEX_MODES, ConfigError, EvalConfig, resolve_config
from .datasets import RetrievalDataset, beir_splits, load_beir, load_jsonl
from .evaluate import (
    RetrieverEvaluation,
    check_reference_doc_ids,
    node_doc_id,
    reference_doc_ids,
    resolve_relevance,
    retrieve_all,
    score_retrievals,
)
from .metrics import DEFAULT_KS, _check_ks

logger = logging.getLogger(__name__)

INPUTS_FILE = "eval_inputs.json"


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


#: The BEIR split read when none is given.
DEFAULT_SPLIT = "test"


def load_dataset(path: str | Path, split: str | None = None) -> RetrievalDataset:
    """A BEIR folder (corpus + queries + qrels) or a JSONL question file, by what ``path`` is.

    ``split``: the BEIR split to read (default :data:`DEFAULT_SPLIT`); it must be one of the
    folder's splits (:func:`~.datasets.beir_splits`), else a ValueError lists them. A JSONL
    question file has no splits: giving one is a ValueError.
    """
    dataset_path = Path(path)
    if split is not None and (not isinstance(split, str) or not split):
        raise ValueError(f"split must be a split name such as 'test', 'dev' or 'train', got {split!r}")
    if dataset_path.is_dir():
        chosen = DEFAULT_SPLIT if split is None else split
        available = beir_splits(dataset_path)
        if available and chosen not in available:
            raise ValueError(
                f"split {chosen!r} is not in {str(dataset_path)!r}: its splits are {available} (--split, split=)"
            )
        return load_beir(dataset_path, split=chosen)
    if dataset_path.is_file():
        if not dataset_path.name.endswith((".jsonl", ".jsonl.gz")):
            raise ValueError(f"dataset file {str(dataset_path)!r} must be a .jsonl (or .jsonl.gz) question file")
        if split is not None:
            raise ValueError(
                f"{str(dataset_path)!r} is a JSONL question file, which has no splits: drop --split {split} (split=)"
            )
        return load_jsonl(dataset_path)
    raise ValueError(
        f"dataset {str(dataset_path)!r} does not exist: give a BEIR folder (corpus.jsonl, queries.jsonl, "
        "qrels_test.tsv, plain or .gz) or a JSONL question file"
    )


def beir_documents(corpus: Mapping[str, Mapping[str, str]]) -> list[Document]:
    """One Document per corpus entry: text ``title + "\\n\\n" + text`` (text alone without title), id = doc id."""
    return [
        Document(text=f"{doc['title']}\n\n{doc['text']}" if doc.get("title") else doc["text"], id_=doc_id)
        for doc_id, doc in corpus.items()
    ]


def _is_bundled_questions(path: Path) -> bool:
    from ..samples import QUESTIONS_FILE

    return path.resolve() == Path(QUESTIONS_FILE).resolve()


def dataset_documents(
    dataset: RetrievalDataset, dataset_path: Path, docs: Sequence[str | Path] | None, show_progress: bool = False
) -> tuple[list[Document], str]:
    """The documents to index and a description of where they came from."""
    if dataset.corpus:
        if docs:
            raise ValueError(f"{dataset_path} is a BEIR folder with its own corpus; drop --docs (docs=)")
        return beir_documents(dataset.corpus), f"BEIR corpus of {dataset_path}"
    if not docs:
        if not _is_bundled_questions(dataset_path):
            raise ValueError(
                f"{dataset_path} is a question file without documents: pass the files or folders the questions "
                "are about with --docs PATH [PATH ...] (docs=[...])"
            )
        from ..samples import sample_files

        docs = sample_files()
    from ..ingest import read_documents
    from ..readers.text import SUPPORTED_SUFFIXES

    missing = [str(p) for p in docs if not Path(p).exists()]
    if missing:
        raise ValueError(f"--docs path(s) not found: {missing}")
    documents, failures = read_documents(docs, show_progress=show_progress)
    if not documents:
        why = "; ".join(map(str, failures)) if failures else (
            f"no supported file there (supported: {', '.join(SUPPORTED_SUFFIXES)}, and UTF-8 text without a suffix)"
        )
        raise ValueError(f"no document could be read from {[str(p) for p in docs]}: {why}")
    if failures:
        logger.warning("%d file(s) could not be read and are not indexed: %s", len(failures), [str(f) for f in failures])
    return documents, ", ".join(str(p) for p in docs)


def first_queries(dataset: RetrievalDataset, limit: int | None) -> RetrievalDataset:
    """The first ``limit`` queries of ``dataset`` (a new dataset; None keeps all)."""
    if limit is None:
        return dataset
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit_queries must be an int >= 1 or None, got {limit!r}")
    kept = list(dataset.queries)[:limit]
    return RetrievalDataset(
        queries={q: dataset.queries[q] for q in kept},
        qrels={q: dict(dataset.qrels[q]) for q in kept if q in dataset.qrels},
        corpus=dataset.corpus,
        reference_contexts={q: list(dataset.reference_contexts[q]) for q in kept if q in dataset.reference_contexts},
        reference_answers={q: dataset.reference_answers[q] for q in kept if q in dataset.reference_answers},
        name=dataset.name,
        split=dataset.split,
    )


def documents_fingerprint(documents: Sequence[Document]) -> str:
    """sha256 over the documents' ids, texts and metadata (order-independent)."""
    digest = hashlib.sha256()
    for doc in sorted(documents, key=lambda d: d.id_):
        digest.update(doc.id_.encode("utf-8") + b"\0")
        digest.update(hashlib.sha256(doc.text.encode("utf-8")).digest())
        digest.update(json.dumps(doc.metadata, sort_keys=True, default=str).encode("utf-8") + b"\0")
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Depth
# --------------------------------------------------------------------------------------------


def fill_depth(chunks_per_doc: Iterable[int], num_docs: int) -> int:
    """How many chunks a ranking needs to be sure to hold ``num_docs`` distinct documents.

    Worst case the top of the ranking comes from the documents with the most chunks: the
    ``num_docs - 1`` largest chunk counts plus one. All chunks when there are no more documents.
    """
    counts = sorted((c for c in chunks_per_doc if c > 0), reverse=True)
    if num_docs < 1:
        raise ValueError(f"num_docs must be >= 1, got {num_docs}")
    if num_docs > len(counts):
        return sum(counts)
    return sum(counts[: num_docs - 1]) + 1


def retrieval_depth(config: EvalConfig, relevance: str, nodes: Sequence[BaseNode], max_k: int) -> int:
    """similarity_top_k for ``config``: its own value, else enough for ``max_k`` results
    (:func:`needed_depth`). A config's own value counts chunks, whatever ``k`` counts."""
    if config.similarity_top_k is not None:
        return config.similarity_top_k
    return needed_depth(relevance, nodes, max_k)


def needed_depth(relevance: str, nodes: Sequence[BaseNode], max_k: int) -> int:
    """Chunks to retrieve to be sure to hold ``max_k`` results: ``max_k`` documents under doc
    relevance (:func:`fill_depth`), else ``max_k`` chunks (at most all of them)."""
    if relevance == "doc":
        per_doc = Counter(node_doc_id(n) or n.node_id for n in nodes)
        return max(1, fill_depth(per_doc.values(), max_k))
    return max(1, min(max_k, len(nodes)))


def leaf_nodes(nodes: Sequence[BaseNode]) -> list[BaseNode]:
    """The retrievable chunks: leaves of a hierarchy, or all nodes of a flat parser."""
    from llama_index.core.node_parser import get_leaf_nodes

    return list(get_leaf_nodes(nodes)) if any(n.child_nodes for n in nodes) else list(nodes)


# --------------------------------------------------------------------------------------------
# Embedding caches
# --------------------------------------------------------------------------------------------


def cache_size(path: Path) -> int:
    """Rows in an EmbeddingCache file (0 when it does not exist)."""
    if not path.exists():
        return 0
    with sqlite3.connect(str(path)) as conn:
        try:
            return int(conn.execute("SELECT COUNT(*) FROM vectors").fetchone()[0])
        except sqlite3.DatabaseError:
            return 0


def merge_embedding_cache(source: str | Path, target: str | Path) -> int:
    """Copy the vectors of EmbeddingCache file ``source`` that ``target`` lacks; returns how many.

    ``source`` is opened read-only and never changed. Raises ValueError when it is not an
    EmbeddingCache file (a SQLite database with a ``vectors`` table).
    """
    from ..indices.embedding_cache import EmbeddingCache

    src = Path(source)
    if not src.is_file():
        raise ValueError(f"embedding cache {str(src)!r} not found")
    try:
        with sqlite3.connect(f"file:{src}?mode=ro", uri=True) as probe:
            columns = [row[1] for row in probe.execute("PRAGMA table_info(vectors)").fetchall()]
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{src} is not an embedding cache (SQLite file): {exc}") from exc
    if columns != ["model", "key", "dim", "vector"]:
        raise ValueError(f"{src} is not an EmbeddingCache file (no vectors(model, key, dim, vector) table)")
    EmbeddingCache(target).close()  # create the table when needed
    conn = sqlite3.connect(str(target))
    try:
        before = conn.execute("SELECT COUNT(*) FROM vectors").fetchone()[0]
        conn.execute("ATTACH DATABASE ? AS src", (f"file:{src}?mode=ro",))
        with conn:
            conn.execute("INSERT OR IGNORE INTO vectors SELECT model, key, dim, vector FROM src.vectors")
        after = conn.execute("SELECT COUNT(*) FROM vectors").fetchone()[0]
        conn.execute("DETACH DATABASE src")
    finally:
        conn.close()
    logger.info("copied %d cached vectors from %s into %s", after - before, src, target)
    return int(after - before)


def check_cache_file(path: Path) -> None:
    """Raise ValueError naming ``path`` when it exists but is not a readable SQLite file."""
    if not path.exists():
        return
    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            conn.execute("SELECT name FROM sqlite_master").fetchall()
    except sqlite3.DatabaseError as exc:
        raise ValueError(
            f"embedding cache {path} is damaged ({exc}): delete it and run again (it only holds vectors, "
            "which are then computed again)"
        ) from exc


def read_inputs_record(path: Path) -> dict[str, Any]:
    """The inputs recorded with an index (``eval_inputs.json``); {} when damaged (the index is rebuilt)."""
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        logger.warning("%s cannot be read (%s: %s); rebuilding its index", path, type(exc).__name__, exc)
        return {}
    if not isinstance(recorded, dict):
        logger.warning("%s holds %s, not a JSON object; rebuilding its index", path, type(recorded).__name__)
        return {}
    return recorded


def _reset_keeping_cache(storage: Path) -> Path:
    """Empty ``storage``, keeping its embeddings.sqlite beside it: returns that file, the cache the
    rebuild starts from (``from_documents(embedding_cache=)``), so it re-embeds nothing it had."""
    cache = storage / "embeddings.sqlite"
    kept = storage.parent / f".{storage.name}.embeddings.sqlite"
    if cache.exists():
        shutil.move(str(cache), str(kept))
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True, exist_ok=True)
    return kept


# --------------------------------------------------------------------------------------------
# Builds
# --------------------------------------------------------------------------------------------


@dataclass
class BuildInfo:
    """One shared build: what it is, where, how long it took, how many texts it embedded."""

    kind: str
    key: str
    path: str | None
    configs: list[str]
    chunks: int
    seconds: float = 0.0
    embedded: int = 0
    reused: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "key": self.key,
            "path": self.path,
            "configs": list(self.configs),
            "chunks": self.chunks,
            "seconds": round(self.seconds, 3),
            "embedded": self.embedded,
            "reused": self.reused,
        }


def _inputs_record(config: EvalConfig, docs_fp: str) -> dict[str, Any]:
    return {
        "documents": docs_fp,
        "index_key": config.index_key(),
        "node_parser": {"class": config.node_parser, **dict(config.parser_args)},
        "embed_model": config.embed_model,
        "bm25": {"k1": config.bm25_k1, "b": config.bm25_b},
    }


def open_hybrid_index(
    documents: Sequence[Document],
    config: EvalConfig,
    storage: Path,
    embed_model: Any,
    docs_fp: str,
    seed_caches: Sequence[Path] = (),
    show_progress: bool = False,
) -> tuple[Any, int, bool]:
    """(HybridIndex, texts embedded, reused) for ``config``'s chunking in ``storage``.

    An index built from the same inputs (``eval_inputs.json``) is reopened; otherwise it is
    rebuilt, keeping its embedding cache and first copying in ``seed_caches``.
    """
    from ..indices import HybridIndex, IndexBusyError

    record = _inputs_record(config, docs_fp)
    inputs_path = storage / INPUTS_FILE
    check_cache_file(storage / "embeddings.sqlite")
    if (storage / "index.json").exists() and inputs_path.exists():
        recorded = read_inputs_record(inputs_path)
        if all(recorded.get(key) == record[key] for key in ("documents", "index_key")):
            try:
                return HybridIndex.load(storage, embed_model=embed_model, node_parser=config.make_parser()), 0, True
            except IndexBusyError:
                raise  # open elsewhere: rebuilding would delete files another process is using
            except Exception as exc:  # damaged or unreadable: it is rebuilt from the inputs
                logger.warning("cannot reopen %s (%s: %s); rebuilding it", storage, type(exc).__name__, exc)
        else:
            logger.info("%s was built from other inputs; rebuilding it (cached embeddings are kept)", storage)
    kept = _reset_keeping_cache(storage)
    for seed in seed_caches:
        merge_embedding_cache(seed, kept)
    before = cache_size(kept)
    index = HybridIndex.from_documents(
        documents,
        storage,
        node_parser=config.make_parser(),
        embed_model=embed_model,
        bm25_k1=config.bm25_k1,
        bm25_b=config.bm25_b,
        show_progress=show_progress,
        embedding_cache=kept if kept.exists() else None,
    )
    kept.unlink(missing_ok=True)  # its vectors are in the index's cache now
    embedded = cache_size(storage / "embeddings.sqlite") - before
    inputs_path.write_text(json.dumps(record, indent=2), encoding="utf-8")
    return index, embedded, False


def embed_nodes_cached(
    nodes: Sequence[BaseNode], embed_model: Any, cache_path: Path, seed_caches: Sequence[Path] = (), show_progress: bool = False
) -> tuple[list[BaseNode], int]:
    """Copies of ``nodes`` with ``embedding`` set (the text LlamaIndex embeds), via a cache file.

    Returns the copies and how many texts were embedded (not found in the cache).
    """
    from ..indices.embedding_cache import EmbeddingCache, embed_texts

    check_cache_file(cache_path)
    for seed in seed_caches:
        merge_embedding_cache(seed, cache_path)
    before = cache_size(cache_path)
    cache = EmbeddingCache(cache_path)
    try:
        texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]
        vectors = embed_texts(embed_model, texts, cache, show_progress=show_progress)
    finally:
        cache.close()
    copies = []
    for node, vector in zip(nodes, vectors):
        copy = node.model_copy()
        copy.embedding = vector.tolist()
        copies.append(copy)
    return copies, cache_size(cache_path) - before


#: The optional module of the built-in config that needs one (extra "bench").
_LLAMAINDEX_BM25_MODULE = "llama_index.retrievers.bm25"


def _llamaindex_bm25(nodes: Sequence[BaseNode], top_k: int) -> Any:
    from .._extras import import_extra

    module = import_extra("bench", _LLAMAINDEX_BM25_MODULE, "config 'llamaindex-bm25'")
    return module.BM25Retriever.from_defaults(nodes=list(nodes), similarity_top_k=min(top_k, len(nodes)))


def check_extras(configs: Sequence[EvalConfig], feature: str = "run_eval") -> None:
    """Fail before any work when the report or a config needs an extra that is not installed."""
    from .._extras import REPORT_MODULES, require_extra

    require_extra("eval", REPORT_MODULES, feature)
    for config in configs:
        if config.retriever == "llamaindex-bm25":
            require_extra("bench", _LLAMAINDEX_BM25_MODULE, f"config {config.name!r} (LlamaIndex's BM25Retriever)")


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------


@dataclass
class EvalJobResult:
    """What :func:`run_eval` produced: scores per config, timings, builds, report files."""

    out_dir: Path
    dataset_path: str
    dataset: RetrievalDataset
    documents_source: str
    num_documents: int
    configs: list[EvalConfig]
    evaluations: dict[str, RetrieverEvaluation]
    depths: dict[str, int]
    timings: dict[str, Any]
    builds: list[BuildInfo]
    significance: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)
    #: The BEIR split evaluated ("" for a JSONL question file).
    split: str = ""
    #: Queries the dataset (split) holds, before ``limit_queries``.
    num_queries_available: int = 0
    #: ``limit_queries`` as given (None: all queries).
    limit_queries: int | None = None

    @property
    def relevance(self) -> str:
        return next(iter(self.evaluations.values())).relevance

    @property
    def ks(self) -> tuple[int, ...]:
        return next(iter(self.evaluations.values())).ks


class _EmbedModels:
    """Embedding models by name, each loaded once (``given`` serves the configs naming it)."""

    def __init__(self, given: Any = None) -> None:
        from ..indices.hybrid_index import embed_model_name

        self._models: dict[str, Any] = {embed_model_name(given): given} if given is not None else {}

    def get(self, name: str) -> Any:
        if name not in self._models:
            from ..models import default_embed_model

            logger.info("loading embedding model %s", name)
            self._models[name] = default_embed_model(name)
        return self._models[name]


def _check_configs(specs: Sequence[str | Path | EvalConfig]) -> list[EvalConfig]:
    if isinstance(specs, (str, Path, EvalConfig)):
        specs = [specs]
    configs = [resolve_config(spec) for spec in specs]
    if not configs:
        raise ValueError("no configuration given: pass at least one --config (e.g. --config bm25 --config hybrid)")
    names = [c.name for c in configs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError("--config", f"configuration names must be unique, {repeated} given twice (set 'name:' in the YAML)")
    from .report import safe_name

    by_file: dict[str, list[str]] = {}
    for name in names:  # report files are named after configs (runs/<name>.jsonl): one file per config
        by_file.setdefault(safe_name(name).lower(), []).append(name)
    shared = [group for group in by_file.values() if len(group) > 1]
    if shared:
        raise ConfigError(
            "--config",
            f"configurations {shared[0]} would share one report file name ({safe_name(shared[0][0])!r}: names are "
            "made file-safe and compared ignoring case); give them names that differ in letters or digits ('name:' in the YAML)",
        )
    return configs


def run_eval(
    dataset_path: str | Path,
    configs: Sequence[str | Path | EvalConfig],
    out_dir: str | Path,
    docs: Sequence[str | Path] | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    limit_queries: int | None = None,
    relevance: str = "auto",
    embed_model: Any = None,
    embedding_cache: str | Path | None = None,
    show_progress: bool = True,
    allow_unmatched_references: bool = False,
    split: str | None = None,
) -> EvalJobResult:
    """Evaluate each configuration on a dataset and write the report folder ``out_dir``.

    Args:
        dataset_path: BEIR folder or JSONL question file.
        configs: Built-in names, YAML paths or :class:`EvalConfig` objects (names unique).
        out_dir: Report folder (created); indexes go to ``out_dir/indexes``.
        docs: Files/folders to index for a JSONL dataset (default for the bundled
            questions.jsonl: the bundled samples). Not allowed with a BEIR folder.
        ks: Cutoffs; metrics are reported at each.
        limit_queries: Evaluate the first ``limit_queries`` queries only.
        relevance: ``"auto"``, ``"doc"``, ``"node"`` or ``"text"`` (see :mod:`.evaluate`).
        embed_model: An already loaded embedding model, used for the configs that name it
            (by default the packaged MiniLM); saves loading it again. Other models are
            loaded by name.
        embedding_cache: An EmbeddingCache SQLite file whose vectors are copied into each new
            build's cache (read only), e.g. a benchmark cache of the same corpus.
        show_progress: Progress bars (tqdm).
        allow_unmatched_references: Score even when none of the dataset's reference doc ids
            names an indexed document (by default that is an
            :class:`~.evaluate.UnmatchedReferencesError`: the documents are probably not the
            ones the dataset is about, and every score would be 0). Some unmatched ids only
            log a warning either way.
        split: The BEIR split to evaluate on (default ``"test"``); must be one of the folder's
            splits. Not allowed with a JSONL question file. The report records it, and how
            many of the split's queries ``limit_queries`` kept.
    """
    started = time.perf_counter()
    cutoffs = tuple(_check_ks(ks))
    if not isinstance(allow_unmatched_references, bool):
        raise ValueError(f"allow_unmatched_references must be True or False, got {allow_unmatched_references!r}")
    checked = _check_configs(configs)
    check_extras(checked)
    seeds = [Path(embedding_cache)] if embedding_cache is not None else []
    for seed in seeds:
        if not seed.is_file():
            raise ValueError(f"embedding cache {str(seed)!r} not found")
    from .report import check_report_folder

    out = Path(out_dir)
    check_report_folder(out)
    path = Path(dataset_path)

    t0 = time.perf_counter()
    full_dataset = load_dataset(path, split=split)
    dataset = first_queries(full_dataset, limit_queries)
    mode = resolve_relevance(relevance, dataset)
    _check_postprocessors_for_relevance(checked, mode)
    documents, docs_source = dataset_documents(dataset, path, docs, show_progress=show_progress)
    read_s = time.perf_counter() - t0
    check_references(dataset, documents, mode, allow_unmatched_references)
    docs_fp = documents_fingerprint(documents)
    out.mkdir(parents=True, exist_ok=True)
    logger.info("dataset %s: %d queries, %d documents, relevance=%s", dataset.name, len(dataset), len(documents), mode)

    stages: list[dict[str, Any]] = [{"stage": "read", "what": docs_source, "seconds": read_s}]
    nodes_by_chunking, chunk_seconds = _chunk_documents(checked, documents, stages, show_progress)
    run = _JobRun(out, documents, docs_fp, checked, _EmbedModels(embed_model), seeds, show_progress)
    evaluations: dict[str, RetrieverEvaluation] = {}
    depths: dict[str, int] = {}
    per_config_timings: dict[str, dict[str, Any]] = {}
    try:
        for config in checked:
            nodes = nodes_by_chunking[config.chunking_key()]
            depths[config.name] = retrieval_depth(config, mode, nodes, max(cutoffs))
            needed = needed_depth(mode, nodes, max(cutoffs))
            if depths[config.name] < needed:
                logger.warning(
                    "config %s: similarity_top_k=%d chunks per query, fewer than the %d it takes to be sure of "
                    "max(ks)=%d %s: metrics at a k above what it returns measure its depth, not its ranking "
                    "(the report flags them)",
                    config.name, depths[config.name], needed, max(cutoffs), "documents" if mode == "doc" else "chunks",
                )
            t0 = time.perf_counter()
            retriever, build = run.retriever(config, nodes, depths[config.name])
            if config.postprocessors:  # a pipeline config's precision stage (gate, reranker, context)
                from ..pipeline import PostprocessedRetriever

                retriever = PostprocessedRetriever(retriever, config.make_postprocessors())
            setup_s = time.perf_counter() - t0
            logger.info("config %s: %s, %d chunks per query", config.name, config.retriever, depths[config.name])
            t0 = time.perf_counter()
            text_depth = max(cutoffs) if mode == "text" else 0
            retrievals = retrieve_all(retriever, dataset.queries, text_depth=text_depth, show_progress=show_progress)
            retrieve_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            evaluations[config.name] = score_retrievals(retrievals, dataset, ks=cutoffs, relevance=mode)
            score_s = time.perf_counter() - t0
            per_config_timings[config.name] = {
                "chunk_s": round(chunk_seconds[config.chunking_key()], 3),
                "index_s": round(build.seconds if build else setup_s, 3),
                "index_shared_with": build.configs if build else [config.name],  # a live list: complete at the end
                "retrieve_s": round(retrieve_s, 3),
                "score_s": round(score_s, 3),
                "embedded": build.embedded if build else 0,
                "index_reused": build.reused if build else False,
            }
            stages.append({"stage": "retrieve", "what": config.name, "seconds": retrieve_s})
            stages.append({"stage": "score", "what": config.name, "seconds": score_s})
    finally:
        run.close()
    for timing in per_config_timings.values():
        timing["index_shared_with"] = list(timing["index_shared_with"])
    for build in run.builds.values():
        stages.append(
            {"stage": "index", "what": f"{build.kind} {build.key}", "seconds": build.seconds, "embedded": build.embedded, "reused": build.reused}
        )

    result = EvalJobResult(
        out_dir=out,
        dataset_path=str(path),
        dataset=dataset,
        documents_source=docs_source,
        num_documents=len(documents),
        configs=checked,
        evaluations=evaluations,
        depths=depths,
        timings={"stages": stages, "configs": per_config_timings, "read_s": round(read_s, 3)},
        builds=list(run.builds.values()),
        split=dataset.split,
        num_queries_available=len(full_dataset),
        limit_queries=limit_queries,
    )
    from .report import write_report

    t0 = time.perf_counter()
    write_report(result)  # fills result.significance and result.files
    result.timings["report_s"] = round(time.perf_counter() - t0, 3)
    result.timings["total_s"] = round(time.perf_counter() - started, 3)
    from .report import write_metrics_json

    write_metrics_json(result)  # again, now with the report and total times
    return result


def _check_postprocessors_for_relevance(configs: Sequence[EvalConfig], relevance: str) -> None:
    """Context assembly makes new nodes (merged spans): node-id relevance cannot score them."""
    if relevance != "node":
        return
    from ..components import resolve_component
    from ..postprocessor.context import ContextAssembler

    for config in configs:
        for spec in config.postprocessors:
            if issubclass(resolve_component(spec["component"]), ContextAssembler):
                raise ConfigError(
                    config.source,
                    "context assembly returns new nodes (merged spans), which node-id relevance cannot score: "
                    "use --relevance doc or text, or disable the context section for this evaluation",
                    "context",
                )


def indexed_doc_ids(documents: Sequence[Document]) -> set[str]:
    """The ids a retrieved chunk of ``documents`` maps to: ``metadata["doc_id"]`` and ``id_``."""
    ids = {doc.id_ for doc in documents}
    ids.update(d for d in (doc.metadata.get("doc_id") for doc in documents) if isinstance(d, str) and d)
    return ids


def any_reference_passage_in(dataset: RetrievalDataset, documents: Sequence[Document]) -> bool:
    """Whether some reference passage of ``dataset`` appears verbatim (case and spacing aside) in a document."""
    from .relevance import normalize_text

    passages = {normalize_text(p) for refs in dataset.reference_contexts.values() for p in refs}
    passages.discard("")
    if not passages:
        return False
    for doc in documents:
        text = normalize_text(doc.text)
        if any(passage in text for passage in passages):
            return True
    return False


def check_references(
    dataset: RetrievalDataset, documents: Sequence[Document], mode: str, allow_unmatched_references: bool = False
) -> None:
    """Refuse to score when the labels cannot be about ``documents`` (see :func:`run_eval`).

    Doc relevance: none of the reference doc ids names a document is an
    :class:`~.evaluate.UnmatchedReferencesError`. Text relevance: the same, unless some reference
    passage appears in the documents (then the ids alone are wrong: a warning). Node relevance
    (qrels hold chunk ids) is not checked. Partial mismatches log a warning.
    """
    if mode == "node":
        return
    found_passage = mode == "text" and any_reference_passage_in(dataset, documents)
    if mode == "text" and not found_passage and not reference_doc_ids(dataset):
        logger.warning(
            "none of the reference passages of %r appears verbatim in the %d indexed documents: if --docs (docs=) "
            "does not hold the documents the dataset is about, every score will be 0",
            dataset.name,
            len(documents),
        )
    check_reference_doc_ids(
        dataset,
        indexed_doc_ids(documents),
        allow_unmatched_references or found_passage,
        hint="check that --docs (docs=) points at the documents the dataset is about (for a BEIR folder: its corpus)",
        opt_out="--allow-unmatched-references (allow_unmatched_references=True)",
    )


def _chunk_documents(
    configs: Sequence[EvalConfig], documents: Sequence[Document], stages: list[dict[str, Any]], show_progress: bool
) -> tuple[dict[str, list[BaseNode]], dict[str, float]]:
    """The retrievable chunks of each distinct chunking (by chunking key), and the time each took."""
    nodes_by_chunking: dict[str, list[BaseNode]] = {}
    seconds: dict[str, float] = {}
    for config in configs:
        key = config.chunking_key()
        if key in nodes_by_chunking:
            continue
        t0 = time.perf_counter()
        nodes = leaf_nodes(config.make_parser().get_nodes_from_documents(documents, show_progress=show_progress))
        seconds[key] = time.perf_counter() - t0
        if not nodes:
            raise ValueError(f"config {config.name!r}: {config.node_parser} produced no chunks from {len(documents)} documents")
        nodes_by_chunking[key] = nodes
        what = f"{config.node_parser} {dict(config.parser_args)}"
        stages.append({"stage": "chunk", "what": what, "seconds": seconds[key], "chunks": len(nodes)})
    return nodes_by_chunking, seconds


class _JobRun:
    """Builds (once) and holds what the configurations need; :meth:`close` releases it."""

    def __init__(
        self,
        out: Path,
        documents: Sequence[Document],
        docs_fp: str,
        configs: Sequence[EvalConfig],
        models: _EmbedModels,
        seeds: Sequence[Path],
        show_progress: bool,
    ) -> None:
        self.out = out
        self.documents = documents
        self.docs_fp = docs_fp
        # Index keys that need a HybridIndex: some config with that key has a dense leg.
        self.dense_index_keys = {c.index_key() for c in configs if c.uses_hybrid_index and c.needs_embeddings}
        self.models = models
        self.seeds = seeds
        self.show_progress = show_progress
        self.indexes: dict[str, Any] = {}
        self.builds: dict[str, BuildInfo] = {}

    def retriever(self, config: EvalConfig, nodes: Sequence[BaseNode], depth: int) -> tuple[Any, BuildInfo | None]:
        """The retriever of ``config`` returning ``depth`` chunks, and the shared build it uses."""
        if config.uses_hybrid_index and config.index_key() in self.dense_index_keys:
            build = self._hybrid_index(config)
            from ..indices import RETRIEVER_OPTIONS

            mode = HYBRID_INDEX_MODES[config.retriever]
            options = {"candidate_top_k": config.candidate_top_k, "rrf_k": config.rrf_k, "weights": config.weights}
            retriever = self.indexes[build.key].as_retriever(  # an option left unset is the mode's own default
                mode=mode,
                similarity_top_k=depth,
                **{k: v for k, v in options.items() if k in RETRIEVER_OPTIONS[mode] and v is not None},
            )
            return retriever, build
        if config.retriever == "bm25":  # the same retriever as a HybridIndex's sparse leg
            from ..retrievers.bm25 import BM25Retriever

            return BM25Retriever(nodes, k1=config.bm25_k1, b=config.bm25_b, similarity_top_k=depth), None
        if config.retriever == "llamaindex-bm25":
            return _llamaindex_bm25(nodes, depth), None
        if config.retriever == "llamaindex-dense":
            build = self._vector_store_index(config, nodes)
            return self.indexes[build.key].as_retriever(similarity_top_k=depth), build
        raise ValueError(f"config {config.name!r}: no builder for retriever {config.retriever!r}")  # pragma: no cover

    def _hybrid_index(self, config: EvalConfig) -> BuildInfo:
        key = config.index_key()
        if key not in self.builds:
            storage = self.out / "indexes" / f"hybrid-{key}"
            t0 = time.perf_counter()
            index, embedded, reused = open_hybrid_index(
                self.documents, config, storage, self.models.get(config.embed_model), self.docs_fp, self.seeds, self.show_progress
            )
            self.indexes[key] = index
            self.builds[key] = BuildInfo("HybridIndex", key, str(storage), [], len(index), time.perf_counter() - t0, embedded, reused)
        self.builds[key].configs.append(config.name)
        return self.builds[key]

    def _vector_store_index(self, config: EvalConfig, nodes: Sequence[BaseNode]) -> BuildInfo:
        from llama_index.core import VectorStoreIndex

        model_digest = hashlib.sha256(config.embed_model.encode("utf-8")).hexdigest()[:8]
        key = f"llamaindex-{config.chunking_key()}-{model_digest}"
        if key not in self.builds:
            model = self.models.get(config.embed_model)
            folder = self.out / "indexes" / key
            t0 = time.perf_counter()
            embedded_nodes, embedded = embed_nodes_cached(nodes, model, folder / "embeddings.sqlite", self.seeds, self.show_progress)
            self.indexes[key] = VectorStoreIndex(embedded_nodes, embed_model=model)
            self.builds[key] = BuildInfo(
                "VectorStoreIndex", key, str(folder), [], len(nodes), time.perf_counter() - t0, embedded, embedded == 0
            )
        self.builds[key].configs.append(config.name)
        return self.builds[key]

    def close(self) -> None:
        """Close the HybridIndexes (Qdrant local mode locks its folder while open)."""
        for index in self.indexes.values():
            if hasattr(index, "close"):
                index.close()
