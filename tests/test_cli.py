"""``rkit query --json/--gate``, ``rkit calibrate`` and ``rkit inspect`` on the bundled samples (real output)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from llama_index_retrieval_kit.cli import EXIT_OK, EXIT_USAGE, main
from llama_index_retrieval_kit.samples import QUESTIONS_FILE, sample_files, sample_pdf

NO_ANSWER_QUESTION = "What is the checked baggage allowance on international flights?"
ANSWERABLE_QUESTION = "How much is the late payment fee?"


def _run(*argv: str) -> tuple[int, str]:
    """Exit code and stdout of ``rkit -q ARGV`` (for module fixtures, where capsys is not available)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["-q", *argv])
    return code, buf.getvalue()


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "index"
    code, out = _run("index", *map(str, sample_files()), "--storage", str(path))
    assert code == EXIT_OK, out
    return path


@pytest.fixture(scope="module")
def calibrated(storage: Path) -> tuple[Path, str]:
    gate = storage.parent / "gate.json"
    code, out = _run("calibrate", "--storage", str(storage), "--dataset", str(QUESTIONS_FILE), "--out", str(gate))
    assert code == EXIT_OK, out
    return gate, out


def _query_json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    assert main(["-q", "query", *argv, "--json"]) == EXIT_OK
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1  # one JSON object, nothing else on stdout
    return json.loads(out)


# ----------------------------------------------------------------------------- query --json
def test_query_json_has_every_field(storage: Path, capsys: pytest.CaptureFixture) -> None:
    data = _query_json(capsys, ANSWERABLE_QUESTION, "--storage", str(storage), "-k", "4")
    assert data["question"] == ANSWERABLE_QUESTION and data["mode"] == "hybrid" and data["top_k"] == 4
    assert "gate" not in data and "traces" not in data
    results = data["results"]
    assert [r["rank"] for r in results] == [1, 2, 3, 4]
    for r in results:
        for key in ("score", "node_id", "doc_id", "section_header", "page_start", "page_end", "char_start", "char_end", "text"):
            assert key in r, key
        assert isinstance(r["score"], float) and r["char_start"] < r["char_end"] and r["page_start"] <= r["page_end"]
        assert set(r["leg_ranks"]) == set(r["leg_scores"]) and r["leg_ranks"]  # hybrid: ranks per leg
    top = results[0]
    assert top["doc_id"] == "credit_card_terms.md" and "Late Payment Fee" in top["section_header"] and "$40" in top["text"]
    assert [r["score"] for r in results] == sorted((r["score"] for r in results), reverse=True)


def test_query_json_sparse_mode_has_no_leg_fields(storage: Path, capsys: pytest.CaptureFixture) -> None:
    data = _query_json(capsys, ANSWERABLE_QUESTION, "--storage", str(storage), "--mode", "sparse", "-k", "2")
    assert data["mode"] == "sparse" and len(data["results"]) == 2
    assert "leg_ranks" not in data["results"][0]


def test_query_json_trace_is_json(storage: Path, capsys: pytest.CaptureFixture) -> None:
    data = _query_json(capsys, ANSWERABLE_QUESTION, "--storage", str(storage), "--trace", "-k", "3")
    assert data["traces"], data.keys()
    trace = data["traces"][-1]
    assert trace["query_str"] == ANSWERABLE_QUESTION and trace["stages"]
    assert all("name" in s and "outputs" in s for s in trace["stages"])


# ----------------------------------------------------------------------------- calibrate
def test_calibrate_writes_a_loadable_gate_and_prints_the_report(calibrated: tuple[Path, str]) -> None:
    from llama_index_retrieval_kit.postprocessor import NoAnswerPostprocessor

    path, out = calibrated
    for label in ("AUROC", "threshold", "answerable kept", "abstention precision", "abstention recall"):
        assert label in out, label
    assert f"--gate {path}" in out
    gate = NoAnswerPostprocessor.load(path)
    assert gate.is_fitted and 0.0 < gate.threshold < 1.0
    report = gate.fit_report
    assert report["auroc"] > 0.8 and report["answerable"] > 0 and report["unanswerable"] > 0
    assert report["retriever"] == {"mode": "hybrid", "similarity_top_k": 10, "exclude_relevant": True}
    auroc_line = next(line for line in out.splitlines() if line.startswith("AUROC"))
    assert f"{report['auroc']:.4f}" in auroc_line


def test_calibrate_rejects_a_bad_target_recall(storage: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["-q", "calibrate", "--storage", str(storage), "--dataset", str(QUESTIONS_FILE),
                 "--out", str(tmp_path / "g.json"), "--target-recall", "1.5"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "--target-recall" in err and "Traceback" not in err
    assert not (tmp_path / "g.json").exists()


# ----------------------------------------------------------------------------- query --gate
def test_gate_abstains_on_a_question_the_samples_do_not_answer(
    storage: Path, calibrated: tuple[Path, str], capsys: pytest.CaptureFixture
) -> None:
    gate, _ = calibrated
    assert main(["-q", "query", NO_ANSWER_QUESTION, "--storage", str(storage), "--gate", str(gate)]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("NO ANSWER") and "abstained" in out and "threshold" in out
    assert "best rejected candidate:" in out and " 1. " in out

    data = _query_json(capsys, NO_ANSWER_QUESTION, "--storage", str(storage), "--gate", str(gate))
    decision = data["gate"]
    assert data["results"] == [] and decision["abstained"] is True
    assert decision["confidence"] < decision["threshold"] and decision["path"] == str(gate)
    assert decision["best_rejected"]["doc_id"] and decision["best_rejected"]["text"]
    assert data["top_k"] == 10  # the gate's calibration k when -k is not given


def test_gate_answers_the_late_payment_fee(storage: Path, calibrated: tuple[Path, str], capsys: pytest.CaptureFixture) -> None:
    gate, _ = calibrated
    assert main(["-q", "query", ANSWERABLE_QUESTION, "--storage", str(storage), "--gate", str(gate)]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("answer gate: passed") and "NO ANSWER" not in out and "$40" in out

    data = _query_json(capsys, ANSWERABLE_QUESTION, "--storage", str(storage), "--gate", str(gate))
    decision = data["gate"]
    assert decision["abstained"] is False and decision["confidence"] >= decision["threshold"]
    assert decision["best_rejected"] is None and "$40" in data["results"][0]["text"]


# ----------------------------------------------------------------------------- inspect
def test_inspect_lists_pages_sections_and_chunks_of_a_pdf(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pdf = sample_pdf(tmp_path)
    assert main(["-q", "inspect", str(pdf), "--show", "3"]) == EXIT_OK
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert header.startswith("== credit_card_terms.pdf:") and "page(s)" in header
    pages = int(header.split(", ")[1].split()[0])
    assert pages > 1
    assert "\npages:" in out and "\nsections (" in out and "\nchunks (" in out
    assert "2. Fees > 2.2 Late Payment Fee" in out and "6. Disputes > 6.1 Billing Errors" in out
    chunk_rows = out.split("\nchunks (")[1].splitlines()[3:6]
    assert len(chunk_rows) == 3 and all(row.split()[0].isdigit() for row in chunk_rows)
    assert "more chunk(s): --show 0 lists all" in out


def test_inspect_hierarchy_parser_shows_parents_and_children(capsys: pytest.CaptureFixture) -> None:
    manual = sample_files()[1]
    assert main(["-q", "inspect", str(manual), "--parser", "hierarchy", "--chunk-size", "64", "--show", "0"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "parser hierarchy" in out and "more chunk(s)" not in out
    assert "1 page(s)" in out.splitlines()[0]


# ----------------------------------------------------------------------------- errors
def _one_line_error(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert err.startswith("rkit: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_query_without_an_index_says_how_to_build_one(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["-q", "query", "fees", "--storage", str(tmp_path / "none"), "--json"]) == EXIT_USAGE
    err = _one_line_error(capsys)
    assert "rkit index" in err and capsys.readouterr().out == ""


def test_calibrate_without_an_index_says_how_to_build_one(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["-q", "calibrate", "--storage", str(tmp_path / "none"), "--dataset", str(QUESTIONS_FILE),
                 "--out", str(tmp_path / "gate.json")])
    assert code == EXIT_USAGE and "rkit index" in _one_line_error(capsys)


def test_query_with_a_missing_gate_file(storage: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["-q", "query", "fees", "--storage", str(storage), "--gate", str(tmp_path / "missing.json")])
    err = _one_line_error(capsys)
    assert code == EXIT_USAGE and "missing.json" in err and "rkit calibrate" in err


def test_query_with_a_file_that_is_not_a_gate(storage: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "gate.json"
    bad.write_text('{"something": "else"}', encoding="utf-8")
    assert main(["-q", "query", "fees", "--storage", str(storage), "--gate", str(bad)]) == EXIT_USAGE
    assert "not a saved NoAnswerPostprocessor" in _one_line_error(capsys)


def test_inspect_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["-q", "inspect", str(tmp_path / "nope.pdf")]) == EXIT_USAGE
    assert "nope.pdf" in _one_line_error(capsys)


def test_global_options_work_before_and_after_the_subcommand() -> None:
    from llama_index_retrieval_kit.cli import build_parser

    parser = build_parser()
    for argv in (["-q", "ingest", "x"], ["ingest", "x", "-q"], ["ingest", "-q", "x"]):
        args = parser.parse_args(argv)
        assert args.quiet is True and args.verbose is False, argv
    args = parser.parse_args(["-v", "query", "what?", "--storage", "s", "--quiet"])
    assert args.verbose is True and args.quiet is True
    assert parser.parse_args(["query", "what?", "--storage", "s"]).quiet is False


def test_index_hnsw_runs_the_engine_optimisers(storage: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "index"
    shutil.copytree(storage, copy)
    code, out = _run("index", *map(str, sample_files()), "--storage", str(copy), "--hnsw")
    assert code == EXIT_OK, out
    assert "'hnsw': 'optimised'" in out or "'hnsw': 'up to date'" in out  # the samples are below Edge's HNSW threshold
    code, again = _run("index", *map(str, sample_files()), "--storage", str(copy), "--hnsw")
    assert code == EXIT_OK and "'hnsw': 'up to date'" in again, again


_QUERY_PROCESS = """
import json, sys
from llama_index_retrieval_kit.cli import main
code = main(["-q", "query", sys.argv[1], "--storage", sys.argv[2], "-k", "5", "--json"])
sys.stderr.write("loaded:" + ",".join(m for m in ("torch", "sentence_transformers", "transformers") if m in sys.modules) + "\\n")
sys.exit(code)
"""


def test_a_query_process_with_a_recorded_export_answers_without_torch(storage: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Once a query has checked the ONNX path (here: one FastHuggingFaceEmbedding query), later
    ``rkit query`` processes embed queries without importing PyTorch, with the same results."""
    import os
    import subprocess
    import sys

    from llama_index_retrieval_kit.embeddings import FastHuggingFaceEmbedding
    from llama_index_retrieval_kit.models import DEFAULT_EMBED_MODEL, resolve_model_path

    cache = tmp_path / "cache"
    writer = FastHuggingFaceEmbedding(model_name=resolve_model_path(DEFAULT_EMBED_MODEL), onnx_cache_dir=str(cache), onnx_speed_check=False)
    assert writer.onnx_active and list(cache.rglob("record.json"))
    want = _query_json(capsys, ANSWERABLE_QUESTION, "--storage", str(storage), "-k", "5")
    out = subprocess.run(
        [sys.executable, "-c", _QUERY_PROCESS, ANSWERABLE_QUESTION, str(storage)],
        env={**os.environ, "RKIT_CACHE_DIR": str(cache)}, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == EXIT_OK, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "loaded:"
    got = json.loads(out.stdout)
    assert [r["node_id"] for r in got["results"]] == [r["node_id"] for r in want["results"]]
    assert [r["score"] for r in got["results"]] == pytest.approx([r["score"] for r in want["results"]], abs=1e-5)


def test_rkit_index_prepares_the_torch_free_query_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rkit index`` records the checked ONNX query path while its model is loaded, so that the
    first ``rkit query`` already starts without PyTorch."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("RKIT_CACHE_DIR", str(cache))
    code, out = _run("index", str(sample_files()[0]), "--storage", str(tmp_path / "index"))
    assert code == EXIT_OK, out
    records = list(cache.rglob("record.json"))
    assert len(records) == 1
    from llama_index_retrieval_kit.embeddings import OnnxQueryEmbedding
    from llama_index_retrieval_kit.models import query_embed_model

    assert isinstance(query_embed_model(), OnnxQueryEmbedding)


def test_demo_refuses_an_out_folder_holding_what_it_did_not_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`rkit demo --out .` in a project folder must not rebuild the user's index or replace their
    chunks: refused before anything is written."""
    project = tmp_path / "project"
    (project / "index").mkdir(parents=True)
    (project / "index" / "mine.txt").write_text("my index", encoding="utf-8")
    (project / "chunks.jsonl").write_text("{}\n", encoding="utf-8")
    code = main(["-q", "demo", "--out", str(project)])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "no earlier `rkit demo` wrote" in err and "index, chunks.jsonl" in err
    assert sorted(p.name for p in project.iterdir()) == ["chunks.jsonl", "index"]
    assert (project / "index" / "mine.txt").read_text(encoding="utf-8") == "my index"


def test_expected_index_states_exit_busy_with_one_line_not_internal() -> None:
    """An index being published, or a cache write a killed writer left, are conditions to act on,
    not bugs: exit 3 (busy), never 70 (internal)."""
    from pathlib import Path as _Path

    from llama_index_retrieval_kit.cli import EXIT_BUSY, _exit_code
    from llama_index_retrieval_kit.indices import IndexBeingPublishedError, InterruptedCacheWriteError

    assert _exit_code(InterruptedCacheWriteError(_Path("idx/embeddings.sqlite"))) == EXIT_BUSY
    assert _exit_code(IndexBeingPublishedError(_Path("idx"))) == EXIT_BUSY
