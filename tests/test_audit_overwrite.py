"""Nothing a user indexed or wrote is lost to a write entry point: ``rkit index --prune`` never
deletes documents that came from no file, an upsert never silently replaces a document of another
source, and the writers of user-visible files (gate, chunks JSONL, eval report) replace only the
files they wrote themselves unless told to (``overwrite=True`` / ``--overwrite``)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from llama_index.core.schema import Document, TextNode

from llama_index_retrieval_kit.cli import EXIT_OK, EXIT_USAGE, main
from llama_index_retrieval_kit.evaluation.report import check_report_folder
from llama_index_retrieval_kit.indices import DocumentIdConflictError, HybridIndex
from llama_index_retrieval_kit.indices.hybrid_index import document_origin, document_provenance
from llama_index_retrieval_kit.ingest import write_chunks_jsonl
from llama_index_retrieval_kit.postprocessor.no_answer import NoAnswerPostprocessor
from llama_index_retrieval_kit.samples import QUESTIONS_FILE

FEES = "# Fees\n\nThe annual fee is $95. A late payment fee of $40 applies after the due date.\n"
INTEREST = "# Interest\n\nThe purchase APR is 21.49 percent, charged daily on the average balance.\n"
DATASET = '{"query_id": "q1", "query": "What is the annual fee?", "reference_doc_ids": ["fees.md"]}\n'


def _run(*argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``rkit -q ARGV``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["-q", *argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def embed_model():
    from llama_index_retrieval_kit.models import default_embed_model

    return default_embed_model()


@pytest.fixture()
def docs(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "fees.md").write_text(FEES, encoding="utf-8")
    (folder / "interest.md").write_text(INTEREST, encoding="utf-8")
    return folder


# ----------------------------------------------------------------------------- documents of no file
def test_prune_never_deletes_documents_added_through_the_python_api(docs: Path, tmp_path: Path, embed_model, monkeypatch) -> None:
    """Their chunks' ``source`` (the document id the parsers record, or a label) is not a file:
    resolved against the current folder it named a file that 'no longer exists', and --prune
    deleted them."""
    storage = tmp_path / "S"
    monkeypatch.chdir(docs)
    assert _run("index", ".", "--storage", str(storage))[0] == EXIT_OK
    with HybridIndex.load(storage, embed_model=embed_model) as index:
        index.upsert([
            Document(text="Refunds are paid within 14 days of a returned purchase.", id_="faq-refunds"),
            Document(text="Support answers on weekdays from 9 to 5.", id_="kb-hours", metadata={"source": "confluence"}),
        ])

    code, out, err = _run("index", ".", "--storage", str(storage), "--prune")
    assert code == EXIT_OK, err
    assert "pruned" not in out and "no longer exist" not in out
    with HybridIndex.load(storage, embed_model=embed_model) as index:
        assert index.doc_ids() == ["faq-refunds", "fees.md", "interest.md", "kb-hours"]
        origins = index.document_origins()
    assert origins["faq-refunds"] is None and origins["kb-hours"] is None
    assert origins["fees.md"] == str((docs / "fees.md").resolve())
    # a file really deleted is still pruned
    (docs / "interest.md").unlink()
    code, out, _ = _run("index", ".", "--storage", str(storage), "--prune")
    assert code == EXIT_OK and "pruned 1 document(s)" in out
    with HybridIndex.load(storage, embed_model=embed_model) as index:
        assert index.doc_ids() == ["faq-refunds", "fees.md", "kb-hours"]


def test_document_origin_is_a_file_or_unknown() -> None:
    assert document_origin({"file_path": "/data/a.md", "source": "a.md"}) == str(Path("/data/a.md").resolve())
    assert document_origin({"source": "/data/old/a.md", "file_name": "a.md"}) == str(Path("/data/old/a.md").resolve())
    assert document_origin({"source": "docs/a.md", "file_name": "a.md"}) == str(Path("docs/a.md").resolve())  # readers before file_path
    for label in ({"source": "confluence"}, {"source": "https://wiki.example.com/page"}, {"source": "faq", "doc_id": "faq"}, {}):
        assert document_origin(label) is None


def test_a_source_label_is_the_same_provenance_from_any_working_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A label is compared as given: re-upserting "confluence" from another folder is no conflict."""
    seen = set()
    for where in ("a", "b"):
        (tmp_path / where).mkdir()
        monkeypatch.chdir(tmp_path / where)
        seen.add(document_provenance({"source": "confluence", "doc_id": "kb-hours"}))
    assert seen == {"confluence"}
    assert document_provenance({"source": "faq", "doc_id": "faq"}) is None


def test_same_id_from_another_source_is_refused_and_an_unknown_source_replaces(tmp_path: Path, embed_model) -> None:
    with HybridIndex.from_documents(
        [
            Document(text="Support answers on weekdays from 9 to 5.", id_="kb-hours", metadata={"source": "https://wiki.a.example/hours"}),
            Document(text="Refunds are paid within 14 days.", id_="faq-refunds"),
        ],
        tmp_path / "S",
        embed_model=embed_model,
    ) as index:
        other = Document(text="Our shop opens at 10 on Saturdays.", id_="kb-hours", metadata={"source": "https://wiki.b.example/hours"})
        with pytest.raises(DocumentIdConflictError, match="allow_source_change"):
            index.upsert([other])
        assert "weekdays" in index.as_retriever("sparse").retrieve("support hours")[0].node.get_content()
        # indexed without any source: the id is all it has, so a document of that id replaces it
        # (the chunks' default source, the document id, is not taken for a file of the current folder)
        assert index.upsert([Document(text="Refunds take 30 days.", id_="faq-refunds", metadata={"file_path": "/data/faq.md"})])["removed"] == 1
        assert index.document_origins()["faq-refunds"] == str(Path("/data/faq.md").resolve())


# ----------------------------------------------------------------------------- no-answer gate file
def test_gate_save_replaces_a_gate_but_refuses_any_other_file(tmp_path: Path) -> None:
    dataset = tmp_path / "questions.jsonl"
    dataset.write_text(DATASET, encoding="utf-8")
    gate = NoAnswerPostprocessor(similarity_cutoff=0.2)
    with pytest.raises(ValueError, match=r"not a saved no-answer gate.*overwrite=True"):
        gate.save(dataset)
    assert dataset.read_text(encoding="utf-8") == DATASET
    with pytest.raises(ValueError, match="is a folder"):
        gate.save(tmp_path)
    with pytest.raises(TypeError, match="overwrite"):
        gate.save(tmp_path / "gate.json", overwrite="yes")  # type: ignore[arg-type]

    path = gate.save(tmp_path / "gate.json")
    NoAnswerPostprocessor(similarity_cutoff=0.5).save(path)  # calibrating again replaces the gate
    assert NoAnswerPostprocessor.load(path).similarity_cutoff == 0.5
    (tmp_path / "empty.json").write_text("", encoding="utf-8")
    gate.save(tmp_path / "empty.json")  # nothing to lose
    gate.save(dataset, overwrite=True)
    assert NoAnswerPostprocessor.load(dataset).similarity_cutoff == 0.2


def test_rkit_calibrate_refuses_to_write_its_gate_over_the_dataset(docs: Path, tmp_path: Path) -> None:
    storage = tmp_path / "S"
    assert _run("index", str(docs), "--storage", str(storage))[0] == EXIT_OK
    dataset = tmp_path / "questions.jsonl"
    dataset.write_text(DATASET + '{"query_id": "q2", "query": "Who won the 1998 world cup?", "reference_doc_ids": []}\n', encoding="utf-8")
    before = dataset.read_text(encoding="utf-8")
    code, out, err = _run("calibrate", "--storage", str(storage), "--dataset", str(dataset), "--out", str(dataset))
    assert code == EXIT_USAGE and "--overwrite" in err and "Traceback" not in err and "calibrated" not in out
    assert dataset.read_text(encoding="utf-8") == before


# ----------------------------------------------------------------------------- chunks JSONL
def test_write_chunks_jsonl_replaces_chunks_but_refuses_any_other_file(docs: Path, tmp_path: Path) -> None:
    document = docs / "fees.md"
    nodes = [TextNode(id_="a", text="fee")]
    with pytest.raises(ValueError, match=r"not a chunks file.*overwrite=True"):
        write_chunks_jsonl(nodes, document)
    assert document.read_text(encoding="utf-8") == FEES
    out = write_chunks_jsonl(nodes, tmp_path / "chunks.jsonl")
    write_chunks_jsonl([TextNode(id_="b", text="interest")], out)  # its own file: replaced
    assert [json.loads(line)["id"] for line in out.read_text(encoding="utf-8").splitlines()] == ["b"]
    write_chunks_jsonl(nodes, document, overwrite=True)
    assert json.loads(document.read_text(encoding="utf-8"))["id"] == "a"


def test_rkit_ingest_refuses_to_write_its_chunks_over_a_document(docs: Path) -> None:
    target = docs / "interest.md"
    code, _, err = _run("ingest", str(docs), "--out", str(target), "--show", "0")
    assert code == EXIT_USAGE and "--overwrite" in err and "Traceback" not in err
    assert target.read_text(encoding="utf-8") == INTEREST
    code, out, err = _run("ingest", str(docs), "--out", str(target), "--show", "0", "--overwrite")
    assert code == EXIT_OK, err
    assert set(json.loads(target.read_text(encoding="utf-8").splitlines()[0])) == {"id", "text", "metadata"}


# ----------------------------------------------------------------------------- eval report folder
def test_rkit_eval_refuses_a_folder_with_someone_elses_metrics_json(tmp_path: Path) -> None:
    """A ``metrics.json`` counted as an earlier report whatever it held: the user's metrics and
    summary were replaced by the report."""
    project = tmp_path / "project"
    project.mkdir()
    theirs = {"metrics.json": '{"accuracy": 0.93, "epoch": 12}\n', "summary.md": "# Training run 12\n"}
    for name, text in theirs.items():
        (project / name).write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="no earlier report"):
        check_report_folder(project)
    code, _, err = _run("eval", "--dataset", str(QUESTIONS_FILE), "--config", "bm25", "--out", str(project))
    assert code == EXIT_USAGE and "metrics.json" in err
    assert {name: (project / name).read_text(encoding="utf-8") for name in theirs} == theirs

    report = tmp_path / "report"  # a folder holding a report of rkit eval is written again
    for _ in range(2):
        code, _, err = _run("eval", "--dataset", str(QUESTIONS_FILE), "--config", "bm25", "--out", str(report))
        assert code == EXIT_OK, err
    check_report_folder(report)


def test_a_folder_is_refused_as_an_output_even_with_overwrite(tmp_path: Path) -> None:
    source = tmp_path / "a.txt"
    source.write_text("Fees. The late fee is $25.", encoding="utf-8")
    folder = tmp_path / "out"
    folder.mkdir()
    for overwrite in ([], ["--overwrite"]):
        code, _, err = _run("ingest", str(source), "--out", str(folder), *overwrite)
        assert code == EXIT_USAGE and f"{folder} is a folder: give the path of a file" in err  # was: "[Errno 21] ... .tmp"
    with pytest.raises(ValueError, match="is a folder"):
        NoAnswerPostprocessor(similarity_cutoff=0.2).save(folder, overwrite=True)
    assert list(folder.iterdir()) == []
