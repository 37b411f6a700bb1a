"""The user surface of ``rkit`` and pipeline configs: bad input is refused up front, in one line
naming the value and what is allowed, with exit code 2 and nothing written."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from llama_index_retrieval_kit.cli import EXIT_PARTIAL, EXIT_USAGE, main
from llama_index_retrieval_kit.evaluation.configs import ConfigError
from llama_index_retrieval_kit.pipeline import PipelineConfig, PipelineConfigError


def _run(*argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``rkit -q ARGV`` (argparse's own usage errors included)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["-q", *argv])
        except SystemExit as exc:  # argparse: usage + one error line, exit 2
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def _one_error_line(err: str) -> str:
    """The single ``rkit: error:`` line of ``err`` (no traceback, no pydantic help lines). A library's
    progress bar is not counted: ``rkit -q`` turns them off through the environment, which
    transformers reads when first imported (an earlier test's import here, a fresh process for users)."""
    progress = re.compile(r"^[^:]*:\s+\d+%\|.*\|")
    lines = [line for line in err.splitlines() if line.strip() and not progress.match(line)]
    assert len(lines) == 1 and lines[0].startswith("rkit: error: "), err
    assert "Traceback" not in err and "errors.pydantic.dev" not in err
    return lines[0]


@pytest.fixture()
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "terms.txt"
    path.write_text("Late payments cost $40. The annual fee is $95.\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- sizes and counts
@pytest.mark.parametrize(
    ("command", "option", "value", "allowed"),
    [
        ("ingest", "--chunk-size", "0", ">= 1"),
        ("ingest", "--chunk-overlap", "-1", ">= 0"),
        ("ingest", "--show", "-1", ">= 0"),  # was accepted: nodes[:-1] printed all chunks but the last
        ("inspect", "--chunk-size", "-5", ">= 1"),
        ("inspect", "--show", "-2", ">= 0"),
        ("index", "--chunk-size", "0", ">= 1"),
        ("index", "--chunk-overlap", "-3", ">= 0"),
    ],
)
def test_bad_sizes_are_usage_errors_naming_the_option(
    command: str, option: str, value: str, allowed: str, text_file: Path, tmp_path: Path
) -> None:
    extra = ["--storage", str(tmp_path / "index")] if command == "index" else []
    code, out, err = _run(command, str(text_file), *extra, option, value)
    assert code == EXIT_USAGE and out == ""
    assert f"argument {option}: expected a whole number {allowed}, got '{value}'" in err
    assert "Traceback" not in err and "errors.pydantic.dev" not in err
    assert not (tmp_path / "index").exists()


def test_an_overlap_the_parser_refuses_is_one_line_before_anything_is_read(tmp_path: Path) -> None:
    storage = tmp_path / "index"
    code, out, err = _run("index", str(tmp_path / "not-read.txt"), "--storage", str(storage), "--chunk-size", "5", "--chunk-overlap", "9")
    assert code == EXIT_USAGE and "could not read" not in out  # refused before reading (was: read, then exit 1)
    line = _one_error_line(err)
    assert "chunk_overlap (9) must be smaller than chunk_size (5)" in line and "SectionWindowNodeParser" in line
    assert not storage.exists()


def test_ingest_hierarchy_overlap_error_is_one_line(text_file: Path) -> None:
    code, _, err = _run("ingest", str(text_file), "--parser", "hierarchy", "--chunk-overlap", "500")
    assert code == EXIT_USAGE
    assert "child_chunk_overlap (500) must be smaller than child_chunk_size" in _one_error_line(err)


# ----------------------------------------------------------------------------- empty input
def test_ingest_of_an_empty_folder_says_so_and_writes_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "slides.docx").write_bytes(b"PK\x03\x04")  # an unsupported type: named, not read
    target = tmp_path / "chunks.jsonl"
    code, out, _ = _run("ingest", str(folder), "--out", str(target))
    assert code == EXIT_PARTIAL  # was 0, with an empty chunks file written
    assert "nothing to ingest" in out and "slides.docx" in out
    assert not target.exists()


def test_ingest_of_a_missing_file_writes_no_chunks_file(tmp_path: Path) -> None:
    target = tmp_path / "chunks.jsonl"
    code, out, _ = _run("ingest", str(tmp_path / "missing.txt"), "--out", str(target))
    assert code == EXIT_PARTIAL and "could not be read" in out
    assert not target.exists()


def test_query_refuses_an_empty_question(tmp_path: Path) -> None:
    code, out, err = _run("query", "   ", "--storage", str(tmp_path / "index"))
    assert code == EXIT_USAGE and out == ""
    assert "the question is empty" in _one_error_line(err)


def test_query_gate_that_is_a_folder_is_named_as_one(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text("index: {storage_dir: index}\n", encoding="utf-8")
    code, _, err = _run("query", "late fee?", "--config", str(config), "--gate", str(tmp_path))
    assert code == EXIT_USAGE
    assert f"--gate {tmp_path} is a folder" in _one_error_line(err)


# ----------------------------------------------------------------------------- Qdrant servers
def test_push_takes_the_url_forms_qdrant_client_takes() -> None:
    from llama_index_retrieval_kit.cli import check_server_url

    for url in ("localhost:6333", "qdrant", "http://localhost:6333", "https://xyz.cloud.qdrant.io:6333/"):
        assert check_server_url(url, "--push") == url  # no scheme: qdrant-client uses http


@pytest.mark.parametrize("url", ["ftp://host:6333", "http://host:port", "localhost:port", "http://:6333"])
def test_a_push_url_that_names_no_server_is_refused_before_indexing(url: str, text_file: Path, tmp_path: Path) -> None:
    storage = tmp_path / "index"
    code, out, err = _run("index", str(text_file), "--storage", str(storage), "--push", url)
    assert code == EXIT_USAGE and out == ""  # was: the index built, then exit 70 "internal error"
    line = _one_error_line(err)
    assert f"--push {url!r} is not a server URL" in line and "http://localhost:6333" in line
    assert not storage.exists()


def test_a_server_that_does_not_answer_is_a_one_line_usage_error(text_file: Path, tmp_path: Path) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text("index: {storage_dir: index, qdrant_url: 'http://127.0.0.1:1'}\n", encoding="utf-8")
    code, _, err = _run("index", str(text_file), "--config", str(config))
    assert code == EXIT_USAGE  # was 70: "internal error (a bug)"
    line = _one_error_line(err)
    assert "the Qdrant server did not answer" in line and "index.qdrant_url" in line and "server is running" in line
    assert not (tmp_path / "index").exists()


# ----------------------------------------------------------------------------- pipeline configs
def _config_error(data: dict) -> PipelineConfigError:
    with pytest.raises(PipelineConfigError) as info:
        PipelineConfig.from_dict(data, source="p.yaml")
    return info.value


@pytest.mark.parametrize(
    ("data", "key", "value"),
    [
        ({"index": {"bm25_k1": float("inf")}}, "index.bm25_k1", "inf"),
        ({"index": {"bm25_b": float("nan")}}, "index.bm25_b", "nan"),
        ({"retriever": {"mode": "hybrid_rrf", "rrf_k": float("inf")}}, "retriever.rrf_k", "inf"),
        ({"no_answer": {"similarity_cutoff": float("nan")}}, "no_answer.similarity_cutoff", "nan"),
        ({"no_answer": {"similarity_cutoff": "high"}}, "no_answer.similarity_cutoff", "'high'"),
    ],
)
def test_numbers_must_be_finite_and_errors_name_the_key_once(data: dict, key: str, value: str) -> None:
    message = str(_config_error(data))
    assert f"key '{key}': must be a finite number, got {value}" in message
    assert f"{key}.int" not in message and f"{key}.float" not in message  # was: one error per union member


@pytest.mark.parametrize("value", ["yes", 1, "true"])
def test_build_hnsw_is_a_strict_boolean_like_the_other_switches(value: object) -> None:
    assert "key 'index.build_hnsw'" in str(_config_error({"index": {"build_hnsw": value}}))


def test_a_disabled_no_answer_section_without_a_source_gives_advice_that_works() -> None:
    message = str(_config_error({"no_answer": {"enabled": False}}))
    assert "also with enabled: false" in message and "or remove the section" in message
    assert "(or set enabled: false)" not in message  # the old advice: the very setting that failed


def test_config_errors_reach_the_command_line_as_one_line(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text("index: {storage_dir: index, bm25_k1: .inf}\n", encoding="utf-8")
    code, _, err = _run("query", "late fee?", "--config", str(config))
    assert code == EXIT_USAGE
    assert "key 'index.bm25_k1': must be a finite number, got inf" in _one_error_line(err)


def test_build_query_engine_refuses_a_misspelt_engine_option_before_opening_anything(tmp_path: Path) -> None:
    from llama_index.core.llms.mock import MockLLM

    from llama_index_retrieval_kit.pipeline import build_query_engine

    config = PipelineConfig.from_dict({"index": {"storage_dir": str(tmp_path / "no-index")}})
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'respons_mode'; allowed: .*response_mode"):
        build_query_engine(config, llm=MockLLM(), respons_mode="tree_summarize")  # was: dropped by from_args(**kwargs)


# ----------------------------------------------------------------------------- YAML files
def test_a_key_given_twice_in_a_config_is_refused_naming_both_lines(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text("index: {storage_dir: a}\nretriever: {mode: hybrid}\nindex: {storage_dir: b}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"line 3.*key 'index' is given twice \(first on line 1\)"):
        PipelineConfig.from_yaml(config)  # was: storage_dir b, silently
    code, _, err = _run("query", "late fee?", "--config", str(config))
    assert code == EXIT_USAGE and "key 'index' is given twice" in _one_error_line(err)
    nested = tmp_path / "nested.yaml"
    nested.write_text("index:\n  storage_dir: a\n  storage_dir: b\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="key 'storage_dir' is given twice"):
        PipelineConfig.from_yaml(nested)
    merged = tmp_path / "merged.yaml"  # a '<<' merge's keys may be overridden: that is what merges are for
    merged.write_text("base: &b {storage_dir: a}\nindex:\n  <<: *b\n  storage_dir: b\n", encoding="utf-8")
    from llama_index_retrieval_kit.evaluation.configs import read_yaml_file

    assert read_yaml_file(merged)["index"] == {"storage_dir": "b"}


def test_a_config_path_that_is_a_folder_is_named_as_one(tmp_path: Path) -> None:
    code, _, err = _run("query", "late fee?", "--config", str(tmp_path))
    assert code == EXIT_USAGE and "is a folder; give the path of a .yaml configuration file" in _one_error_line(err)


def test_eval_docs_with_no_supported_file_say_so(tmp_path: Path) -> None:
    from llama_index_retrieval_kit.evaluation import load_dataset
    from llama_index_retrieval_kit.evaluation.job import dataset_documents
    from llama_index_retrieval_kit.samples import QUESTIONS_FILE

    (tmp_path / "notes.docx").write_bytes(b"PK\x03\x04")  # skipped (logged) as an unsupported type
    with pytest.raises(ValueError, match=r"no document could be read from .*: no supported file there \(supported: \.pdf"):
        dataset_documents(load_dataset(QUESTIONS_FILE), Path(QUESTIONS_FILE), [tmp_path])  # was: nothing after the colon


def test_bad_parser_arguments_in_an_eval_config_are_one_line(tmp_path: Path) -> None:
    from llama_index_retrieval_kit.samples import QUESTIONS_FILE

    config = tmp_path / "c.yaml"
    config.write_text("retriever: bm25\nnode_parser: {chunk_size: 0}\n", encoding="utf-8")
    code, _, err = _run("eval", "--dataset", str(QUESTIONS_FILE), "--config", str(config), "--out", str(tmp_path / "out"))
    line = _one_error_line(err)  # was: pydantic's four lines and its help link
    assert code == EXIT_USAGE and "key 'node_parser'" in line and "chunk_size: Input should be greater than 0, got 0" in line
    assert not (tmp_path / "out").exists()


def test_an_eval_config_takes_the_three_weights_hybrid_takes() -> None:
    """docs/evaluation.md and as_retriever("hybrid", weights=[.3, .3, .4]) take [bm25, dense, feedback];
    the eval config refused them ("must be a list of 2 numbers")."""
    from llama_index_retrieval_kit.evaluation.configs import config_from_dict

    assert config_from_dict({"retriever": "hybrid", "weights": [0.3, 0.3, 0.4]}).weights == (0.3, 0.3, 0.4)
    assert config_from_dict({"retriever": "hybrid", "weights": [1, 2]}).weights == (1, 2)
    with pytest.raises(ConfigError, match=r"weights.*2 numbers \[bm25, dense\] or 3 \[bm25, dense, feedback\]"):
        config_from_dict({"retriever": "hybrid", "weights": [1, 2, 3, 4]})
    with pytest.raises(ConfigError, match=r"weights.*must be a list of 2 numbers \[bm25, dense\], got \[1, 2, 3\]"):
        config_from_dict({"retriever": "hybrid_rrf", "weights": [1, 2, 3]})


def test_ingest_show_tells_hierarchy_parents_from_children(text_file: Path) -> None:
    code, out, _ = _run("ingest", str(text_file), "--parser", "hierarchy", "--show", "50")
    labels = [line for line in out.splitlines() if line.startswith("[")]
    assert code == 0 and any(" parent]" in line for line in labels) and any(" parent]" not in line for line in labels)


def test_a_server_build_checks_the_server_before_loading_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_index.core.schema import Document

    from llama_index_retrieval_kit.indices import HybridIndex
    from llama_index_retrieval_kit.indices import hybrid_index as module

    loaded = []
    monkeypatch.setattr(module, "default_embed_model", lambda: loaded.append(1))
    with pytest.raises(Exception) as failure:
        HybridIndex.from_documents([Document(text="Fees apply.", id_="a")], tmp_path / "index", qdrant_url="http://127.0.0.1:1")
    assert "refused" in str(failure.value).lower() or "connect" in str(failure.value).lower(), failure.value
    assert loaded == []  # was: the model loaded first (seconds), then the connection failed
    assert not (tmp_path / "index").exists()
