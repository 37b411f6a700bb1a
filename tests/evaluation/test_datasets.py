"""Dataset loaders: BEIR folders (both layouts, real scifact) and JSONL question files."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from llama_index_retrieval_kit.evaluation.datasets import (
    DatasetFormatError,
    RetrievalDataset,
    load_beir,
    load_jsonl,
)

SCIFACT = Path(__file__).resolve().parents[3] / "shared/datasets/beir/scifact"

CORPUS = [
    {"_id": "d1", "title": "Fees", "text": "The annual fee is $95.", "metadata": {}},
    {"_id": "d2", "title": "", "text": "Late payments cost up to $40."},
    {"_id": "d3", "text": "No title here."},
]
QUERIES = [
    {"_id": "1", "text": "What is the annual fee?"},
    {"_id": "2", "text": "What does a late payment cost?"},
    {"_id": "3", "text": "Unjudged in test"},
    {"_id": "4", "text": "Judged not relevant only"},
]
QRELS_TEST = "query-id\tcorpus-id\tscore\n1\td1\t1\n2\td2\t2\n2\td1\t0\n4\td3\t0\n"


def write_jsonl(path: Path, rows: list[dict], gz: bool = False) -> Path:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture()
def beir_folder(tmp_path: Path) -> Path:
    """Compact layout (as /work/shared): gzipped files, qrels_{split}.tsv, queries_{split} for train."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    write_jsonl(folder / "corpus.jsonl.gz", CORPUS, gz=True)
    write_jsonl(folder / "queries.jsonl.gz", QUERIES, gz=True)
    write_jsonl(folder / "queries_train.jsonl.gz", [{"_id": "9", "text": "A training question"}], gz=True)
    (folder / "qrels_test.tsv").write_text(QRELS_TEST, encoding="utf-8")
    (folder / "qrels_train.tsv").write_text("query-id\tcorpus-id\tscore\n9\td3\t1\n", encoding="utf-8")
    return folder


# --------------------------------------------------------------------------------------------
# BEIR
# --------------------------------------------------------------------------------------------


def test_load_beir_keeps_only_judged_queries(beir_folder: Path) -> None:
    data = load_beir(beir_folder)
    assert data.name == "tiny"
    assert data.queries == {
        "1": "What is the annual fee?",
        "2": "What does a late payment cost?",
        "4": "Judged not relevant only",
    }
    assert data.qrels == {"1": {"d1": 1}, "2": {"d2": 2, "d1": 0}, "4": {"d3": 0}}
    assert data.corpus["d1"] == {"title": "Fees", "text": "The annual fee is $95."}
    assert data.corpus["d3"] == {"title": "", "text": "No title here."}
    assert len(data) == 3
    assert data.answerable_ids() == ["1", "2"]
    assert data.no_answer_ids() == ["4"]
    assert data.reference_contexts == {"1": [], "2": [], "4": []}
    assert data.reference_answers == {"1": None, "2": None, "4": None}


def test_load_beir_reads_split_specific_queries(beir_folder: Path) -> None:
    data = load_beir(str(beir_folder), split="train")
    assert data.queries == {"9": "A training question"}
    assert data.qrels == {"9": {"d3": 1}}


def test_load_beir_upstream_layout(tmp_path: Path) -> None:
    """Upstream BEIR: plain .jsonl, one queries file for all splits, qrels/{split}.tsv."""
    folder = tmp_path / "upstream"
    (folder / "qrels").mkdir(parents=True)
    write_jsonl(folder / "corpus.jsonl", CORPUS)
    write_jsonl(folder / "queries.jsonl", QUERIES)
    (folder / "qrels" / "test.tsv").write_text(QRELS_TEST, encoding="utf-8")
    (folder / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\n3\td2\t1\n", encoding="utf-8")
    assert set(load_beir(folder).queries) == {"1", "2", "4"}
    dev = load_beir(folder, split="dev")
    assert dev.queries == {"3": "Unjudged in test"} and dev.qrels == {"3": {"d2": 1}}


def test_load_beir_unknown_split_lists_the_splits_found(beir_folder: Path) -> None:
    with pytest.raises(ValueError, match=r"no judgments for split 'dev'.*splits found: \['test', 'train'\]"):
        load_beir(beir_folder, split="dev")


@pytest.mark.parametrize("split", ["", "../test", "te st", 3])
def test_load_beir_rejects_bad_split_names(beir_folder: Path, split: object) -> None:
    with pytest.raises(ValueError, match="split must be a split name"):
        load_beir(beir_folder, split=split)  # type: ignore[arg-type]


def test_load_beir_rejects_missing_folder_and_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist or is not a folder"):
        load_beir(tmp_path / "nope")
    (tmp_path / "qrels_test.tsv").write_text(QRELS_TEST, encoding="utf-8")
    with pytest.raises(ValueError, match=r"not a BEIR folder: queries.jsonl \(or .gz\) not found"):
        load_beir(tmp_path)


@pytest.mark.parametrize(
    "qrels_text, message",
    [
        ("query-id\tcorpus-id\tscore\n1\td1\n", r"qrels_test.tsv, line 2: expected 3 tab-separated columns"),
        ("query-id\tcorpus-id\tscore\n1\td1\thigh\n", r"qrels_test.tsv, line 2: field 'score': must be an integer"),
        ("1 d1 1\n", r"line 1: expected 3 tab-separated columns"),
        ("query-id\tcorpus-id\tscore\n1\td1\t1\n1\td1\t2\n", r"line 3: \('1', 'd1'\) judged twice with different scores"),
        ("query-id\tcorpus-id\tscore\n1\td1\t1\n7\td1\t1\n", r"qrels_test.tsv: 1 judged query ids are not in queries.jsonl.gz: \['7'\]"),
        ("query-id\tcorpus-id\tscore\n\td1\t1\n", r"line 2: empty query-id or corpus-id"),
    ],
)
def test_load_beir_malformed_qrels(beir_folder: Path, qrels_text: str, message: str) -> None:
    (beir_folder / "qrels_test.tsv").write_text(qrels_text, encoding="utf-8")
    with pytest.raises(DatasetFormatError, match=message):
        load_beir(beir_folder)


def test_load_beir_qrels_without_header_and_negative_scores(
    beir_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (beir_folder / "qrels_test.tsv").write_text("1\td1\t1\n1\td1\t1\n2\td2\t-1\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        data = load_beir(beir_folder)
    assert data.qrels == {"1": {"d1": 1}, "2": {"d2": 0}}
    assert "1 negative scores read as 0" in caplog.text


def test_load_beir_warns_about_judged_docs_missing_from_corpus(
    beir_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (beir_folder / "qrels_test.tsv").write_text("query-id\tcorpus-id\tscore\n1\tghost\t1\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        data = load_beir(beir_folder)
    assert data.qrels == {"1": {"ghost": 1}}
    assert "1 judged doc ids are not in the corpus" in caplog.text


@pytest.mark.parametrize(
    "corpus_lines, message",
    [
        (['{"_id": "d1", "text": "ok"}', '{"_id": "d2", "text": '], r"corpus.jsonl, line 2: invalid JSON"),
        (['{"_id": "d1", "text": "ok"}', '["d2", "text"]'], r"line 2: expected a JSON object, got list"),
        (['{"_id": "d1", "text": "ok"}', '{"_id": "d1", "text": "again"}'], r"line 2: field '_id': duplicate doc id 'd1'"),
        (['{"text": "no id"}'], r"line 1: field '_id': must be a non-empty string"),
        (['{"_id": "d1", "title": "t"}'], r"line 1: field 'text': must be a string, got None"),
        (['{"_id": "d1", "text": "ok", "title": 5}'], r"line 1: field 'title': must be a string, got 5"),
    ],
)
def test_load_beir_malformed_corpus(beir_folder: Path, corpus_lines: list[str], message: str) -> None:
    (beir_folder / "corpus.jsonl.gz").unlink()
    write_lines(beir_folder / "corpus.jsonl", corpus_lines)
    with pytest.raises(DatasetFormatError, match=message):
        load_beir(beir_folder)


def test_load_beir_malformed_queries(beir_folder: Path) -> None:
    (beir_folder / "queries.jsonl.gz").unlink()
    write_lines(beir_folder / "queries.jsonl", ['{"_id": "1", "text": "a"}', '{"_id": "1", "text": "b"}'])
    with pytest.raises(DatasetFormatError, match=r"queries.jsonl, line 2: field '_id': duplicate query id '1'"):
        load_beir(beir_folder)


def test_load_beir_corrupt_gzip(beir_folder: Path) -> None:
    (beir_folder / "corpus.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DatasetFormatError, match=r"corpus.jsonl.gz: cannot read"):
        load_beir(beir_folder)


@pytest.mark.skipif(not SCIFACT.is_dir(), reason=f"{SCIFACT} is not present")
def test_load_real_scifact_matches_published_counts() -> None:
    test = load_beir(SCIFACT)
    assert test.name == "scifact"
    assert len(test.corpus) == 5183
    assert len(test) == 300
    assert sum(len(judged) for judged in test.qrels.values()) == 339
    assert len(test.answerable_ids()) == 300
    assert all(set(doc) == {"title", "text"} for doc in test.corpus.values())
    train = load_beir(SCIFACT, split="train")
    assert len(train) == 809
    assert not set(train.queries) & set(test.queries)


# --------------------------------------------------------------------------------------------
# JSONL question files
# --------------------------------------------------------------------------------------------


def test_load_jsonl_reads_every_field(tmp_path: Path) -> None:
    rows = [
        {
            "id": "fee",
            "question": "What is the annual fee?",
            "reference_answer": "$95",
            "reference_contexts": ["The annual fee is $95."],
            "reference_doc_ids": ["terms.md", "terms.md"],
        },
        {"question": "Only a passage", "reference_contexts": ["Late payments cost up to $40."]},
        {"question": "Only a doc id", "reference_doc_ids": ["manual.md"], "reference_answer": None},
        {"id": "mortgage", "question": "What is the mortgage rate?", "reference_contexts": [], "reference_doc_ids": []},
        {"question": "Nothing but the question"},
    ]
    data = load_jsonl(write_jsonl(tmp_path / "my_questions.jsonl", rows))
    assert data.name == "my_questions"
    assert list(data.queries) == ["fee", "q2", "q3", "mortgage", "q5"]
    assert data.qrels == {"fee": {"terms.md": 1}, "q2": {}, "q3": {"manual.md": 1}, "mortgage": {}, "q5": {}}
    assert data.reference_contexts["fee"] == ["The annual fee is $95."]
    assert data.reference_contexts["mortgage"] == []
    assert data.reference_answers == {"fee": "$95", "q2": None, "q3": None, "mortgage": None, "q5": None}
    assert data.corpus == {}
    assert data.answerable_ids() == ["fee", "q2", "q3"]
    assert data.no_answer_ids() == ["mortgage", "q5"]
    assert len(data) == 5


def test_load_jsonl_default_ids_count_blank_lines_and_gzip_works(tmp_path: Path) -> None:
    path = tmp_path / "qs.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write('{"question": "first"}\n\n{"question": "third line"}\n')
    data = load_jsonl(path)
    assert data.name == "qs"
    assert data.queries == {"q1": "first", "q3": "third line"}


def test_load_jsonl_warns_about_unknown_fields_and_answer_without_references(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [{"question": "q?", "refrence_contexts": ["typo"], "reference_answer": "yes"}]
    with caplog.at_level(logging.WARNING):
        data = load_jsonl(write_jsonl(tmp_path / "qs.jsonl", rows))
    assert data.no_answer_ids() == ["q1"]
    assert "ignored unknown fields ['refrence_contexts']" in caplog.text
    assert "has a reference_answer but no reference_contexts or reference_doc_ids" in caplog.text


@pytest.mark.parametrize(
    "lines, line, field, message",
    [
        (['{"question": "ok"}', '{"question": "broken"'], 2, None, "invalid JSON"),
        (['["question"]'], 1, None, "expected a JSON object, got list"),
        (['{"id": "a"}'], 1, "question", "missing"),
        (['{"question": null}'], 1, "question", "missing"),
        (['{"question": "   "}'], 1, "question", "must be a non-empty string"),
        (['{"question": 42}'], 1, "question", "must be a non-empty string"),
        (['{"question": "q", "id": 7}'], 1, "id", "must be a non-empty string"),
        (['{"question": "q", "id": ""}'], 1, "id", "must be a non-empty string"),
        (['{"question": "a", "id": "x"}', '{"question": "b", "id": "x"}'], 2, "id", r"duplicate id 'x' \(first used on line 1\)"),
        (['{"question": "a"}', '{"question": "b", "id": "q1"}'], 2, "id", "duplicate id 'q1'"),
        (['{"question": "q", "reference_answer": 3}'], 1, "reference_answer", "must be a string or null"),
        (['{"question": "q", "reference_contexts": "a passage"}'], 1, "reference_contexts", "must be a list of strings, got str"),
        (['{"question": "q", "reference_contexts": ["ok", 5]}'], 1, "reference_contexts", "item 1 must be a non-empty string"),
        (['{"question": "q", "reference_contexts": [""]}'], 1, "reference_contexts", "item 0 must be a non-empty string"),
        (['{"question": "q", "reference_doc_ids": {"d": 1}}'], 1, "reference_doc_ids", "must be a list of strings, got dict"),
        (['{"question": "q", "reference_doc_ids": [null]}'], 1, "reference_doc_ids", "item 0 must be a non-empty string"),
    ],
)
def test_load_jsonl_malformed_lines(
    tmp_path: Path, lines: list[str], line: int, field: str | None, message: str
) -> None:
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetFormatError, match=message) as caught:
        load_jsonl(path)
    error = caught.value
    assert isinstance(error, ValueError)
    assert error.path == str(path) and error.line == line and error.field == field
    assert str(error).startswith(f"{path}, line {line}: ")
    if field is not None:
        assert f"field {field!r}" in str(error)


def test_load_jsonl_empty_missing_and_non_utf8_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DatasetFormatError, match=r"empty.jsonl: no questions"):
        load_jsonl(empty)
    with pytest.raises(ValueError, match="does not exist or is not a file"):
        load_jsonl(tmp_path / "missing.jsonl")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"question": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DatasetFormatError, match=r"latin.jsonl: not UTF-8 text"):
        load_jsonl(latin)


def test_load_jsonl_bundled_sample_questions() -> None:
    from llama_index_retrieval_kit import samples

    path = Path(samples.__file__).resolve().parent / "questions.jsonl"
    if not path.is_file():
        pytest.skip("bundled questions.jsonl is not present")
    data = load_jsonl(path)
    assert len(data) > 0
    assert set(data.answerable_ids()) | set(data.no_answer_ids()) == set(data.queries)
    assert data.no_answer_ids()  # the sample set includes questions with no answer


# --------------------------------------------------------------------------------------------
# RetrievalDataset
# --------------------------------------------------------------------------------------------


def test_dataset_rejects_labels_for_unknown_queries() -> None:
    with pytest.raises(ValueError, match=r"qrels has ids that are not in queries: \['q9'\]"):
        RetrievalDataset(queries={"q1": "?"}, qrels={"q9": {"d": 1}})
    with pytest.raises(ValueError, match=r"reference_contexts has ids that are not in queries"):
        RetrievalDataset(queries={"q1": "?"}, qrels={}, reference_contexts={"q2": ["x"]})


def test_dataset_answerability_from_qrels_or_contexts() -> None:
    data = RetrievalDataset(
        queries={"a": "?", "b": "?", "c": "?", "d": "?"},
        qrels={"a": {"d1": 1}, "b": {"d1": 0}},
        reference_contexts={"c": ["passage"], "d": []},
    )
    assert data.answerable_ids() == ["a", "c"]
    assert data.no_answer_ids() == ["b", "d"]
    with pytest.raises(ValueError, match="unknown query id 'z'"):
        data.is_answerable("z")


# ------------------------------------------------------------------------------ damaged input files

DEPTH = 100_000


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"question": "q", "reference_contexts": ' + "[" * DEPTH + "]" * DEPTH + "}", "reference_contexts"),
        ('{"id": "a\\"b:", "question": ' + '{"k": ' * DEPTH + "1" + "}" * DEPTH + "}", "question"),
        ("[" * DEPTH + "]" * DEPTH, None),  # not even an object: no field to name
    ],
)
def test_a_deeply_nested_line_is_a_format_error_naming_file_line_and_field(tmp_path: Path, line: str, field: str | None) -> None:
    path = write_lines(tmp_path / "deep.jsonl", ['{"question": "fine"}', line])
    with pytest.raises(DatasetFormatError, match="JSON nested too deeply to read") as caught:
        load_jsonl(path)
    assert (caught.value.path, caught.value.line, caught.value.field) == (str(path), 2, field)
    assert str(caught.value).startswith(f"{path}, line 2: ")
    assert len(str(caught.value)) < 400


def test_a_nested_but_readable_value_is_reported_short(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "nested.jsonl", ['{"question": ' + "[" * 500 + "]" * 500 + "}"])
    with pytest.raises(DatasetFormatError, match=r"line 1: field 'question': must be a non-empty string, got \[\[\[") as caught:
        load_jsonl(path)
    assert len(str(caught.value)) < 300


def _damaged_gzip(text: str) -> bytes:
    """A gzip stream whose compressed body is overwritten: zlib fails inside it (not a header or CRC error)."""
    data = bytearray(gzip.compress(text.encode("utf-8")))
    for i in range(20, 60):
        data[i] ^= 0xFF
    return bytes(data)


def test_a_gzip_file_damaged_inside_names_the_file(tmp_path: Path, beir_folder: Path) -> None:
    path = tmp_path / "questions.jsonl.gz"
    path.write_bytes(_damaged_gzip('{"question": "What is the annual fee?"}\n' * 1000))
    with pytest.raises(DatasetFormatError, match=r"questions.jsonl.gz: cannot read \(zlib.error: .*\); the file is damaged"):
        load_jsonl(path)
    (beir_folder / "corpus.jsonl.gz").write_bytes(_damaged_gzip(json.dumps(CORPUS[0]) + "\n" * 1000))
    with pytest.raises(DatasetFormatError, match=r"corpus.jsonl.gz: cannot read"):
        load_beir(beir_folder)


@pytest.mark.parametrize(
    ("line", "field", "position"),
    [
        ('{"question": "annual \\ud800 fee"}', "question", 7),
        ('{"question": "q", "reference_contexts": ["fine", "x\\udfff"]}', "reference_contexts", 1),
        ('{"question": "q", "id": "\\udc80"}', "id", 0),
    ],
)
def test_a_lone_surrogate_escape_is_a_format_error_naming_the_field(tmp_path: Path, line: str, field: str, position: int) -> None:
    path = write_lines(tmp_path / "surrogate.jsonl", ['{"question": "fine \\ud83d\\ude00"}', line])  # a real pair is fine
    with pytest.raises(DatasetFormatError, match=rf"lone surrogate .* at position {position} .*not valid Unicode text") as caught:
        load_jsonl(path)
    assert (caught.value.line, caught.value.field) == (2, field)


def test_a_lone_surrogate_in_a_beir_query_is_a_format_error(beir_folder: Path) -> None:
    (beir_folder / "queries.jsonl.gz").unlink()
    write_lines(beir_folder / "queries.jsonl", ['{"_id": "1", "text": "annual fee \\ud800"}', '{"_id": "2", "text": "late"}'])
    with pytest.raises(DatasetFormatError, match=r"queries.jsonl, line 1: field 'text': lone surrogate '\\ud800' at position 11"):
        load_beir(beir_folder)
