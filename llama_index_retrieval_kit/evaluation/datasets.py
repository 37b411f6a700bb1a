"""Labelled retrieval datasets: BEIR folders and users' own JSONL question files.

Both loaders return a :class:`RetrievalDataset`. Its judgments are doc-level: ``qrels`` maps a
query id to ``{doc_id: relevance}`` (int >= 0, > 0 = relevant), the format
:func:`~llama_index_retrieval_kit.evaluation.metrics.evaluate_run` takes. Passage-level labels
(``reference_contexts``) are kept as text so they can be matched against any chunking (see
:mod:`~llama_index_retrieval_kit.evaluation.relevance`).

Malformed files raise :class:`DatasetFormatError` (a ValueError) naming the file, the line and
the field at fault.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import reprlib
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

logger = logging.getLogger(__name__)

#: Fields of a JSONL question line; others are ignored (with a warning, to catch typos).
JSONL_FIELDS = ("id", "question", "reference_answer", "reference_contexts", "reference_doc_ids")
_SPLIT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
#: A JSON escape of a UTF-16 surrogate: the only way a lone surrogate gets into a parsed line.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
#: Nesting (arrays/objects inside each other) past which a line is reported as too deep.
_MAX_NESTING = 100
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 3, 80, 80


class DatasetFormatError(ValueError):
    """A dataset file is malformed; the message names the file, line (from 1) and field."""

    def __init__(self, path: str | Path, reason: str, line: int | None = None, field_name: str | None = None) -> None:
        self.path = str(path)
        self.line = line
        self.field = field_name
        where = self.path + (f", line {line}" if line is not None else "")
        what = f"field {field_name!r}: " if field_name is not None else ""
        super().__init__(f"{where}: {what}{reason}")


@dataclass(frozen=True)
class RetrievalDataset:
    """Questions with their relevance labels.

    * ``queries``: query id -> question text; the dataset's query set (its order is kept).
    * ``qrels``: query id -> {doc id: relevance int >= 0}; doc-level judgments, > 0 = relevant.
    * ``corpus``: doc id -> ``{"title": str, "text": str}``; empty when the dataset ships no
      corpus (JSONL question files: the documents are the user's own).
    * ``reference_contexts``: query id -> passages that answer the question (may be empty).
    * ``reference_answers``: query id -> reference answer, or None.
    * ``name``: a label for reports.
    * ``split``: the BEIR split the queries and judgments come from (``"test"``...); ``""`` for
      a JSONL question file (no splits).

    A query is *answerable* when it has a relevant doc or a reference context; the others are
    no-answer questions (a good system should say it cannot answer them). Keys of ``qrels``,
    ``reference_contexts`` and ``reference_answers`` must be query ids; a query without an entry
    has no judgments / no contexts / no answer.
    """

    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    corpus: dict[str, dict[str, str]] = field(default_factory=dict)
    reference_contexts: dict[str, list[str]] = field(default_factory=dict)
    reference_answers: dict[str, str | None] = field(default_factory=dict)
    name: str = ""
    split: str = ""

    def __post_init__(self) -> None:
        for label, mapping in (
            ("qrels", self.qrels),
            ("reference_contexts", self.reference_contexts),
            ("reference_answers", self.reference_answers),
        ):
            unknown = [query_id for query_id in mapping if query_id not in self.queries]
            if unknown:
                raise ValueError(f"{label} has ids that are not in queries: {unknown[:5]!r} ({len(unknown)} in all)")

    def is_answerable(self, query_id: str) -> bool:
        """True when ``query_id`` has a relevant doc or a reference context."""
        if query_id not in self.queries:
            raise ValueError(f"unknown query id {query_id!r}")
        has_relevant = any(value > 0 for value in self.qrels.get(query_id, {}).values())
        return has_relevant or bool(self.reference_contexts.get(query_id))

    def answerable_ids(self) -> list[str]:
        """Ids of the questions the documents answer, in dataset order."""
        return [query_id for query_id in self.queries if self.is_answerable(query_id)]

    def no_answer_ids(self) -> list[str]:
        """Ids of the questions with no answer in the documents, in dataset order."""
        return [query_id for query_id in self.queries if not self.is_answerable(query_id)]

    def __len__(self) -> int:
        return len(self.queries)


# --------------------------------------------------------------------------------------------
# File helpers
# --------------------------------------------------------------------------------------------


def _error_name(exc: BaseException) -> str:
    """``zlib.error``, ``gzip.BadGzipFile``, ``EOFError``: an exception's type as users can look it up."""
    module = type(exc).__module__
    return type(exc).__name__ if module == "builtins" else f"{module}.{type(exc).__name__}"


def _show(value: Any) -> str:
    """A short repr of a value from a file, for error messages (long or deep values cut)."""
    return _SHORT_REPR.repr(value)


def _deep_field(line: str, limit: int = _MAX_NESTING) -> str | None:
    """The top-level key of the JSON object ``line`` whose value nests deeper than ``limit``.

    A linear scan (strings skipped, brackets counted); None when the line is not an object or
    no key was seen before that depth.
    """
    depth, key, last_string, start, in_string, escaped = 0, None, None, 0, False, False
    for position, char in enumerate(line):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string, last_string = False, line[start : position + 1]
        elif char == '"':
            in_string, start = True, position
        elif char in "[{":
            depth += 1
            if depth > limit:
                return key
        elif char in "]}":
            depth -= 1
        elif char == ":" and depth == 1 and last_string is not None:
            try:
                key = json.loads(last_string)
            except ValueError:
                key = last_string
    return None


def _open_text(path: Path) -> IO[str]:
    """``path`` opened for reading UTF-8 text, gunzipped when it ends in ``.gz``."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, line) for the non-blank lines of ``path``."""
    try:
        with _open_text(path) as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, line
    except UnicodeDecodeError as exc:
        raise DatasetFormatError(path, f"not UTF-8 text ({exc.reason})") from exc
    except (OSError, EOFError, zlib.error) as exc:  # e.g. a truncated, damaged or non-gzip .gz file
        reason = f"cannot read ({_error_name(exc)}: {exc}); the file is damaged or not what its name says"
        raise DatasetFormatError(path, reason) from exc


def _json_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSONL file."""
    for number, line in _numbered_lines(path):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetFormatError(path, f"invalid JSON ({exc.msg} at column {exc.colno})", number) from exc
        except RecursionError:
            raise DatasetFormatError(
                path,
                "JSON nested too deeply to read (arrays/objects inside each other, deeper than the JSON reader "
                "allows); a dataset line holds strings and lists of strings: fix or remove this line",
                number,
                _deep_field(line),
            ) from None
        if not isinstance(obj, dict):
            raise DatasetFormatError(path, f"expected a JSON object, got {type(obj).__name__}", number)
        if _SURROGATE_ESCAPE.search(line):
            bad = _lone_surrogate(obj)
            if bad is not None:
                field_name, char, position = bad
                raise DatasetFormatError(
                    path,
                    f"lone surrogate {char!r} at position {position} (an unpaired \\u escape): not valid Unicode text; "
                    "fix the text, e.g. with text.encode('utf-8', 'replace').decode()",
                    number,
                    field_name,
                )
        yield number, obj


def _strings_of(value: Any) -> list[str]:
    """``value`` if it is a string, its string items if it is a list, else nothing."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, str)]
    return []


def _lone_surrogate(obj: dict[str, Any]) -> tuple[str, str, int] | None:
    """(field, character, position) of the first lone surrogate in a top-level key, string or
    list-of-strings item of ``obj``; None when there is none."""
    for name, value in obj.items():
        for text in (name, *_strings_of(value)):
            found = _SURROGATE.search(text)
            if found is not None:
                return name, found.group(), found.start()
    return None


def _first_existing(folder: Path, names: list[str]) -> Path | None:
    for name in names:
        candidate = folder / name
        if candidate.is_file():
            return candidate
    return None


def _with_gz(names: list[str]) -> list[str]:
    return [variant for name in names for variant in (name, name + ".gz")]


# --------------------------------------------------------------------------------------------
# BEIR
# --------------------------------------------------------------------------------------------


def _beir_id(path: Path, number: int, obj: dict[str, Any]) -> str:
    value = obj.get("_id")
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
        raise DatasetFormatError(path, f"must be a non-empty string, got {_show(value)}", number, "_id")
    return str(value)


def _beir_text(path: Path, number: int, obj: dict[str, Any], name: str, required: bool) -> str:
    value = obj.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise DatasetFormatError(path, f"must be a string, got {_show(value)}", number, name)
    return value


def _read_beir_corpus(path: Path) -> dict[str, dict[str, str]]:
    corpus: dict[str, dict[str, str]] = {}
    for number, obj in _json_objects(path):
        doc_id = _beir_id(path, number, obj)
        if doc_id in corpus:
            raise DatasetFormatError(path, f"duplicate doc id {doc_id!r}", number, "_id")
        corpus[doc_id] = {
            "title": _beir_text(path, number, obj, "title", required=False),
            "text": _beir_text(path, number, obj, "text", required=True),
        }
    return corpus


def _read_beir_queries(path: Path, wanted: set[str]) -> dict[str, str]:
    queries: dict[str, str] = {}
    for number, obj in _json_objects(path):
        query_id = _beir_id(path, number, obj)
        if query_id not in wanted:
            continue
        if query_id in queries:
            raise DatasetFormatError(path, f"duplicate query id {query_id!r}", number, "_id")
        queries[query_id] = _beir_text(path, number, obj, "text", required=True)
    return queries


def _read_beir_qrels(path: Path) -> dict[str, dict[str, int]]:
    """Judgments from a BEIR ``query-id<TAB>corpus-id<TAB>score`` file (header line optional).

    Negative scores are read as 0 (judged not relevant), as trec_eval treats them for these metrics.
    """
    qrels: dict[str, dict[str, int]] = {}
    negatives = 0
    for index, (number, line) in enumerate(_numbered_lines(path)):
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) != 3:
            raise DatasetFormatError(
                path, f"expected 3 tab-separated columns (query-id, corpus-id, score), got {len(fields)}", number
            )
        query_id, doc_id, score_text = (value.strip() for value in fields)
        try:
            score = int(score_text)
        except ValueError:
            if index == 0:  # the header line
                continue
            raise DatasetFormatError(path, f"must be an integer, got {score_text!r}", number, "score") from None
        if not query_id or not doc_id:
            raise DatasetFormatError(path, "empty query-id or corpus-id", number)
        if score < 0:
            negatives += 1
            score = 0
        judged = qrels.setdefault(query_id, {})
        if doc_id in judged and judged[doc_id] != score:
            pair, scores = f"({query_id!r}, {doc_id!r})", f"({judged[doc_id]}, {score})"
            raise DatasetFormatError(path, f"{pair} judged twice with different scores {scores}", number)
        judged[doc_id] = score
    if negatives:
        logger.warning("%s: %d negative scores read as 0 (not relevant)", path, negatives)
    return qrels


def beir_splits(folder: str | Path) -> list[str]:
    """The split names of a BEIR folder: those with a judgments file (``qrels_{split}.tsv`` or
    ``qrels/{split}.tsv``, plain or .gz), sorted; [] when there is none."""
    folder = Path(folder)
    names = {p.name.split(".")[0][len("qrels_") :] for p in folder.glob("qrels_*.tsv*")}
    names |= {p.name.split(".")[0] for p in (folder / "qrels").glob("*.tsv*")}
    return sorted(names)


def load_beir(folder: str | Path, split: str = "test") -> RetrievalDataset:
    """A BEIR dataset folder (e.g. ``scifact``) as a :class:`RetrievalDataset`.

    Files, plain or gzipped (``.gz``):

    * ``corpus.jsonl``: ``{"_id", "title", "text"}`` per line;
    * queries: ``queries_{split}.jsonl`` when present, else ``queries.jsonl`` (upstream BEIR keeps
      all splits in one file); ``{"_id", "text"}`` per line;
    * judgments: ``qrels_{split}.tsv`` or ``qrels/{split}.tsv`` (upstream layout), tab-separated
      ``query-id  corpus-id  score`` with a header line.

    Only queries with judgments in ``split`` are kept. A judged query missing from the queries
    file is an error; judged docs missing from the corpus are logged. ``name`` is the folder name.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"BEIR folder {str(root)!r} does not exist or is not a folder")
    if not isinstance(split, str) or not _SPLIT_PATTERN.fullmatch(split):
        raise ValueError(f"split must be a split name such as 'test', 'dev' or 'train', got {split!r}")

    qrels_path = _first_existing(root, _with_gz([f"qrels_{split}.tsv", f"qrels/{split}.tsv"]))
    if qrels_path is None:
        raise ValueError(
            f"no judgments for split {split!r} in {str(root)!r} (looked for qrels_{split}.tsv and "
            f"qrels/{split}.tsv); splits found: {beir_splits(root)}"
        )
    queries_path = _first_existing(root, _with_gz([f"queries_{split}.jsonl", "queries.jsonl"]))
    corpus_path = _first_existing(root, _with_gz(["corpus.jsonl"]))
    if queries_path is None or corpus_path is None:
        missing = "queries.jsonl" if queries_path is None else "corpus.jsonl"
        raise ValueError(f"{str(root)!r} is not a BEIR folder: {missing} (or .gz) not found")

    qrels = _read_beir_qrels(qrels_path)
    queries_found = _read_beir_queries(queries_path, set(qrels))
    unknown = [query_id for query_id in qrels if query_id not in queries_found]
    if unknown:
        raise DatasetFormatError(
            qrels_path, f"{len(unknown)} judged query ids are not in {queries_path.name}: {unknown[:5]!r}"
        )
    corpus = _read_beir_corpus(corpus_path)
    absent_docs = {doc_id for judged in qrels.values() for doc_id in judged if doc_id not in corpus}
    if absent_docs:
        logger.warning("%s: %d judged doc ids are not in the corpus", qrels_path, len(absent_docs))

    # Query order follows the qrels file, so results list queries as the judgments do.
    queries = {query_id: queries_found[query_id] for query_id in qrels}
    logger.info("loaded BEIR %s/%s: %d docs, %d queries", root.name, split, len(corpus), len(queries))
    return RetrievalDataset(
        queries=queries,
        qrels=qrels,
        corpus=corpus,
        reference_contexts={query_id: [] for query_id in queries},
        reference_answers={query_id: None for query_id in queries},
        name=root.name,
        split=split,
    )


# --------------------------------------------------------------------------------------------
# JSONL question files
# --------------------------------------------------------------------------------------------


def _string_list(path: Path, number: int, obj: dict[str, Any], name: str) -> list[str]:
    """The optional list-of-non-empty-strings field ``name`` (missing or null = empty list)."""
    value = obj.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise DatasetFormatError(path, f"must be a list of strings, got {type(value).__name__}", number, name)
    for position, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise DatasetFormatError(path, f"item {position} must be a non-empty string, got {_show(item)}", number, name)
    return list(value)


def load_jsonl(path: str | Path) -> RetrievalDataset:
    """A labelled question file (one JSON object per line) as a :class:`RetrievalDataset`.

    Fields: ``question`` (required, non-empty string); ``id`` (string, default ``"q{line}"``,
    line numbers from 1); ``reference_answer`` (string or null); ``reference_contexts`` (list
    of passages that answer the question) and ``reference_doc_ids`` (list of doc ids, each
    judged relevance 1) - both optional. A question with neither contexts nor doc ids is a
    no-answer question: kept, and listed by ``no_answer_ids()`` (a reference answer alone does
    not make it answerable). Blank lines are skipped. ``corpus`` is empty; ``name`` is the file
    name without ``.jsonl``/``.gz``.
    """
    file_path = Path(path)
    if not file_path.is_file():
        raise ValueError(f"question file {str(file_path)!r} does not exist or is not a file")

    queries: dict[str, str] = {}
    qrels: dict[str, dict[str, int]] = {}
    contexts: dict[str, list[str]] = {}
    answers: dict[str, str | None] = {}
    first_line: dict[str, int] = {}
    unknown_fields: set[str] = set()
    for number, obj in _json_objects(file_path):
        question = obj.get("question")
        if question is None:
            raise DatasetFormatError(file_path, "missing (required)", number, "question")
        if not isinstance(question, str) or not question.strip():
            raise DatasetFormatError(file_path, f"must be a non-empty string, got {_show(question)}", number, "question")

        query_id = obj.get("id", f"q{number}")
        if not isinstance(query_id, str) or not query_id.strip():
            raise DatasetFormatError(file_path, f"must be a non-empty string, got {_show(query_id)}", number, "id")
        if query_id in first_line:
            raise DatasetFormatError(
                file_path, f"duplicate id {query_id!r} (first used on line {first_line[query_id]})", number, "id"
            )

        answer = obj.get("reference_answer")
        if answer is not None and not isinstance(answer, str):
            raise DatasetFormatError(file_path, f"must be a string or null, got {_show(answer)}", number, "reference_answer")
        passages = _string_list(file_path, number, obj, "reference_contexts")
        doc_ids = _string_list(file_path, number, obj, "reference_doc_ids")
        if answer and not passages and not doc_ids:
            logger.warning(
                "%s, line %d: %r has a reference_answer but no reference_contexts or reference_doc_ids; "
                "it is treated as a no-answer question",
                file_path,
                number,
                query_id,
            )
        unknown_fields.update(key for key in obj if key not in JSONL_FIELDS)

        first_line[query_id] = number
        queries[query_id] = question
        qrels[query_id] = {doc_id: 1 for doc_id in doc_ids}
        contexts[query_id] = passages
        answers[query_id] = answer

    if not queries:
        raise DatasetFormatError(file_path, "no questions (the file is empty)")
    if unknown_fields:
        logger.warning("%s: ignored unknown fields %s (known: %s)", file_path, sorted(unknown_fields), JSONL_FIELDS)
    name = file_path.name.removesuffix(".gz").removesuffix(".jsonl")
    dataset = RetrievalDataset(
        queries=queries,
        qrels=qrels,
        corpus={},
        reference_contexts=contexts,
        reference_answers=answers,
        name=name,
    )
    logger.info("loaded %s: %d questions (%d without answer)", file_path, len(dataset), len(dataset.no_answer_ids()))
    return dataset
