"""The evaluation job end to end on the bundled questions: report folder, reuse, configs, errors, CLI."""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import logging
import re
import shutil
import sqlite3
from pathlib import Path

import pytest

from llama_index_retrieval_kit.evaluation import (
    ConfigError,
    EvalConfig,
    UnmatchedReferencesError,
    load_config_file,
    resolve_config,
    run_eval,
)
from llama_index_retrieval_kit.evaluation.cli_eval import add_eval_subparser, cmd_eval, parse_ks
from llama_index_retrieval_kit.evaluation.configs import RETRIEVERS
from llama_index_retrieval_kit.evaluation.job import fill_depth, merge_embedding_cache
from llama_index_retrieval_kit.evaluation.report import DELTA_PLOT_SIZE, METRICS_PLOT_SIZE
from llama_index_retrieval_kit.samples import QUESTIONS_FILE, sample_files

from ..indices._support import embed_model as shared_embed_model

YAML_CONFIG = """\
name: bm25-small-chunks
retriever: bm25
node_parser:
  class: SectionWindowNodeParser
  chunk_size: 96
  chunk_overlap: 16
bm25: {k1: 0.9, b: 0.4}
"""
HYBRID_YAML = """\
name: hybrid-score-dense-heavy
retriever: hybrid_score
weights: [0.3, 0.7]
node_parser:
  class: SectionWindowNodeParser
  chunk_size: 200
  chunk_overlap: 40
"""
CONFIG_NAMES = ["bm25", "hybrid", "bm25-small-chunks"]


@pytest.fixture(scope="module")
def yaml_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("configs") / "heavy.yaml"
    path.write_text(YAML_CONFIG, encoding="utf-8")
    return path


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread while this module embeds: one-query batches gain nothing from more,
    and on a busy shared CPU torch's thread pool makes them ~10x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, yaml_config: Path):
    out = tmp_path_factory.mktemp("eval") / "report"
    return run_eval(QUESTIONS_FILE, ["bm25", "hybrid", yaml_config], out, embed_model=shared_embed_model(), show_progress=False)


def test_configs_with_the_same_chunking_share_one_index_build(job) -> None:
    assert list(job.evaluations) == CONFIG_NAMES
    assert len(job.builds) == 1
    build = job.builds[0]
    assert build.kind == "HybridIndex" and build.configs == ["bm25", "hybrid"]
    assert build.embedded == build.chunks > 0 and not build.reused
    assert Path(build.path, "embeddings.sqlite").exists()
    for name in ("bm25", "hybrid"):
        assert job.timings["configs"][name]["index_shared_with"] == ["bm25", "hybrid"]
    # The YAML config chunks differently and has no dense leg: its own BM25, nothing embedded.
    assert job.timings["configs"]["bm25-small-chunks"]["embedded"] == 0
    # ... and its own chunking stage (two chunkings in all: timings are not compared, they can be equal).
    assert len([stage for stage in job.timings["stages"] if stage["stage"] == "chunk"]) == 2
    # Text relevance: max(ks) = 100 chunks, or all of them when there are fewer.
    chunk_counts = [stage["chunks"] for stage in job.timings["stages"] if stage["stage"] == "chunk"]
    assert chunk_counts[0] == job.builds[0].chunks < chunk_counts[1] < 100
    assert job.depths == {"bm25": chunk_counts[0], "hybrid": chunk_counts[0], "bm25-small-chunks": chunk_counts[1]}
    small, default = job.evaluations["bm25-small-chunks"], job.evaluations["bm25"]
    assert small.mean["chars@10"] < default.mean["chars@10"]  # smaller chunks: less text per k
    stages = {stage["stage"] for stage in job.timings["stages"]}
    assert stages == {"read", "chunk", "index", "retrieve", "score"}


def test_metrics_json_holds_every_config_setting_and_timing(job) -> None:
    data = json.loads((job.out_dir / "metrics.json").read_text(encoding="utf-8"))
    assert data["dataset"]["relevance"] == "text" and data["dataset"]["num_scored"] == 30
    assert len(data["dataset"]["no_answer_ids"]) == 8
    assert [c["name"] for c in data["configs"]] == CONFIG_NAMES
    small = data["configs"][2]
    assert small["settings"]["retriever"] == "bm25" and small["settings"]["bm25"] == {"k1": 0.9, "b": 0.4}
    assert small["settings"]["node_parser"] == {"class": "SectionWindowNodeParser", "chunk_size": 96, "chunk_overlap": 16}
    for config in data["configs"]:
        assert config["mean"] == pytest.approx(job.evaluations[config["name"]].mean)
        assert set(config["latency"]) == {"p50_ms", "p95_ms", "mean_ms", "total_s"}
        assert {"chunk_s", "index_s", "retrieve_s", "score_s"} <= set(config["timings"])
    assert data["best"]["ndcg@10"] and set(data["best"]["ndcg@10"]) <= set(CONFIG_NAMES)
    assert {(row["a"], row["b"]) for row in data["significance"]} == {
        ("bm25", "hybrid"), ("bm25", "bm25-small-chunks"), ("hybrid", "bm25-small-chunks")
    }
    for row in data["significance"]:
        assert 0.0 <= row["wilcoxon_p"] <= 1.0 and 0.0 <= row["permutation_p"] <= 1.0
    assert data["timings"]["total_s"] > 0 and data["timings"]["read_s"] >= 0


def test_per_query_csv_has_every_query_of_every_config(job) -> None:
    with (job.out_dir / "per_query.csv").open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 3 * 38
    assert {"config", "query_id", "answerable", "ndcg@10", "recall@100", "coverage@10", "chars@10", "latency_ms"} <= set(rows[0])
    no_answer = [r for r in rows if r["answerable"] == "False"]
    assert len(no_answer) == 3 * 8
    assert all(r["ndcg@10"] == "" and r["chars@10"] != "" for r in no_answer)
    hybrid = [float(r["ndcg@10"]) for r in rows if r["config"] == "hybrid" and r["answerable"] == "True"]
    assert sum(hybrid) / len(hybrid) == pytest.approx(job.evaluations["hybrid"].mean["ndcg@10"])
    run_lines = (job.out_dir / "runs" / "hybrid.jsonl").read_text(encoding="utf-8").splitlines()
    record = json.loads(run_lines[0])
    assert len(run_lines) == 38 and record["node_ids"] and len(record["scores"]) == len(record["node_ids"])


def test_summary_md_compares_configs_with_the_best_in_bold(job) -> None:
    text = (job.out_dir / "summary.md").read_text(encoding="utf-8")
    assert "| config | ndcg@10 |" in text and "chars@10" in text and "coverage@10" in text
    for name in CONFIG_NAMES:
        assert f"| {name} |" in text
    assert "**" in text.split("## Main metrics")[1].split("###")[0]
    assert "## Significance" in text and "Wilcoxon" in text and "## Timings" in text
    assert "![metrics_vs_k](metrics_vs_k.png)" in text


def test_plots_are_valid_pngs_of_the_expected_size(job) -> None:
    import matplotlib.image as mpimg

    plots = sorted(job.out_dir.glob("*.png"))
    assert [p.name for p in plots] == [
        "delta_ndcg_10_bm25-small-chunks_vs_bm25.png",
        "delta_ndcg_10_hybrid_vs_bm25.png",
        "metrics_vs_k.png",
    ]
    for path in plots:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width = mpimg.imread(path).shape[:2]
        expected = METRICS_PLOT_SIZE if path.name == "metrics_vs_k.png" else DELTA_PLOT_SIZE
        assert (width, height) == expected


def test_a_second_run_with_unchanged_inputs_embeds_nothing(job, yaml_config: Path) -> None:
    cache = Path(job.builds[0].path) / "embeddings.sqlite"
    rows_before = sqlite3.connect(str(cache)).execute("SELECT COUNT(*) FROM vectors").fetchone()[0]
    again = run_eval(
        QUESTIONS_FILE, ["bm25", "hybrid", yaml_config], job.out_dir, embed_model=shared_embed_model(), limit_queries=5, show_progress=False
    )
    assert again.builds[0].reused and again.builds[0].embedded == 0
    assert sqlite3.connect(str(cache)).execute("SELECT COUNT(*) FROM vectors").fetchone()[0] == rows_before
    assert len(again.dataset) == 5
    for name in CONFIG_NAMES:  # same index, same retrievers: the same results for those queries
        for qid in again.dataset.queries:
            assert again.evaluations[name].per_query[qid].retrieval.node_ids == job.evaluations[name].per_query[qid].retrieval.node_ids


def write_beir(folder: Path) -> Path:
    """A tiny BEIR folder: 6 documents, 3 judged queries (one judgment 0 only: skipped)."""
    folder.mkdir(parents=True)
    corpus = [
        {"_id": "d1", "title": "Annual fee", "text": "The annual fee for the card is ninety five dollars."},
        {"_id": "d2", "title": "Late fee", "text": "A late payment fee of forty dollars applies after the due date."},
        {"_id": "d3", "title": "Filters", "text": "Replace the water filter cartridge every six months."},
        {"_id": "d4", "title": "Privacy", "text": "We never sell your personal data to advertisers."},
        {"_id": "d5", "title": "", "text": "Cash advances cost five percent of the amount, at least ten dollars."},
        {"_id": "d6", "title": "Warranty", "text": "The kettle has a two year limited warranty."},
    ]
    queries = [{"_id": "q1", "text": "late payment fee"}, {"_id": "q2", "text": "how often replace filter cartridge"},
               {"_id": "q3", "text": "kettle warranty"}]
    with gzip.open(folder / "corpus.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write("\n".join(json.dumps(d) for d in corpus) + "\n")
    with gzip.open(folder / "queries.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write("\n".join(json.dumps(q) for q in queries) + "\n")
    (folder / "qrels_test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td2\t1\nq2\td3\t1\nq3\td6\t0\n", encoding="utf-8")
    return folder


def test_a_beir_folder_is_scored_at_document_level(tmp_path: Path) -> None:
    folder = write_beir(tmp_path / "tiny")
    result = run_eval(folder, ["bm25", "llamaindex-bm25"], tmp_path / "out", ks=(1, 3), show_progress=False)
    assert result.relevance == "doc" and result.num_documents == 6
    for name, ev in result.evaluations.items():
        assert ev.num_scored == 2, name  # q3 has no relevant doc
        assert ev.mean["hit_rate@1"] == 1.0 and ev.mean["ndcg@3"] == 1.0
        assert result.depths[name] == 3  # one chunk per document: 3 chunks fill 3 documents
    assert not result.builds  # keyword retrievers only: nothing embedded
    assert (tmp_path / "out" / "metrics_vs_k.png").exists()


def test_a_report_never_replaces_or_deletes_files_it_did_not_write(tmp_path: Path) -> None:
    """--out: a folder holding files of the report's names but no earlier report is refused;
    a later run removes only the per-config files the earlier report listed."""
    folder = write_beir(tmp_path / "tiny")
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    (out / "summary.md").write_text("my own summary", encoding="utf-8")
    (out / "runs" / "my_labels.jsonl").write_text("{}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"summary\.md.*no earlier report"):
        run_eval(folder, ["bm25"], out, ks=(1, 3), show_progress=False)
    assert (out / "summary.md").read_text(encoding="utf-8") == "my own summary"
    assert (out / "runs" / "my_labels.jsonl").exists()

    report = tmp_path / "report"
    run_eval(folder, ["bm25", "llamaindex-bm25"], report, ks=(1, 3), show_progress=False)
    assert (report / "runs" / "llamaindex-bm25.jsonl").exists() and list(report.glob("delta_*.png"))
    (report / "runs" / "mine.jsonl").write_text("{}\n", encoding="utf-8")  # the user's own files
    (report / "delta_my_plot.png").write_bytes(b"png")
    run_eval(folder, ["bm25"], report, ks=(1, 3), show_progress=False)  # an earlier report: replaced
    assert not (report / "runs" / "llamaindex-bm25.jsonl").exists()  # stale: the earlier report listed it
    assert [p.name for p in report.glob("delta_*.png")] == ["delta_my_plot.png"]
    assert (report / "runs" / "mine.jsonl").exists() and (report / "runs" / "bm25.jsonl").exists()


def test_configs_whose_report_files_would_collide_are_refused(tmp_path: Path) -> None:
    (tmp_path / "q.yaml").write_text("name: 'bm25?'\nretriever: bm25\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"would share one report file name \('bm25'"):
        run_eval(write_beir(tmp_path / "tiny"), ["bm25", tmp_path / "q.yaml"], tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


def test_fill_depth_is_enough_for_the_worst_case() -> None:
    assert fill_depth([1, 1, 1], 2) == 2
    assert fill_depth([5, 3, 1, 1], 2) == 6  # the top 5 chunks may all be one document's
    assert fill_depth([5, 3, 1, 1], 3) == 9
    assert fill_depth([2, 2], 5) == 4  # fewer documents than asked: all chunks
    with pytest.raises(ValueError):
        fill_depth([1], 0)


# ------------------------------------------------------------------------------------- configs


def test_builtin_names_resolve_and_unknown_names_list_the_allowed_ones() -> None:
    assert resolve_config("hybrid").retriever == "hybrid"
    assert resolve_config("llamaindex-bm25").node_parser == "SentenceSplitter"
    assert resolve_config("dense").node_parser == "SectionWindowNodeParser"
    with pytest.raises(ConfigError, match="unknown configuration 'hybird'.*'bm25', 'dense'"):
        resolve_config("hybird")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("retriever: hybrid\nrrf: 60\n", r"key 'rrf': unknown key; allowed keys: \['name', 'retriever'"),
        ("retriever: hybrd\n", r"key 'retriever': unknown retriever 'hybrd'; choose one of \['bm25'"),
        ("name: x\n", r"key 'retriever': missing"),
        ("retriever: bm25\nrrf_k: 10\n", r"key 'rrf_k': does not apply to retriever 'bm25'"),
        ("retriever: hybrid\nnode_parser:\n  class: SentenceSplitter\n  chunk_sise: 10\n",
         r"key 'node_parser.chunk_sise': SentenceSplitter has no argument 'chunk_sise'; allowed: \[.*'chunk_size'"),
        ("retriever: hybrid\nnode_parser:\n  class: Splitter\n", r"key 'node_parser.class': unknown class 'Splitter'"),
        ("retriever: dense\nnode_parser:\n  chunk_size: -5\n", r"key 'node_parser': invalid arguments for SectionWindowNodeParser"),
        ("retriever: hybrid_rrf\nweights: [1, 2, 3]\n", r"key 'weights': must be a list of 2 numbers"),
        ("retriever: hybrid\nweights: [1, 2, 3, 4]\n", r"key 'weights': must be a list of 2 numbers \[bm25, dense\] or 3"),
        ("retriever: bm25\nbm25: {k1: 1.2, b: 2}\n", r"key 'bm25.b': must be a number in \[0, 1\]"),
        ("retriever: bm25\nsimilarity_top_k: 0\n", r"key 'similarity_top_k': must be an integer >= 1"),
        ("retriever: qdrant_hybrid\nrrf_k: 60.5\n", r"key 'rrf_k': must be a whole number for qdrant_hybrid"),
        ("retriever: hybrid\n  weights: x\n", r"not valid YAML \(line 2, column 10\): mapping values are not allowed"),
        ("", r"the file is empty"),
    ],
)
def test_yaml_errors_name_the_key_and_the_allowed_values(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        load_config_file(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"retriever: bm25\nname: caf\xe9\n", r"bad.yaml: not UTF-8 text \(byte 25: invalid continuation byte\); save it as UTF-8"),
        (b"retriever: " + b"[" * 100_000 + b"]" * 100_000 + b"\n", r"bad.yaml: nested too deeply to read"),
    ],
)
def test_unreadable_yaml_files_are_config_errors_naming_the_file(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config_file(path)
    assert caught.value.source == str(path)


def test_a_yaml_config_becomes_a_typed_config(tmp_path: Path) -> None:
    path = tmp_path / "heavy.yaml"
    path.write_text(HYBRID_YAML, encoding="utf-8")
    config = load_config_file(path)
    assert isinstance(config, EvalConfig)
    assert (config.name, config.retriever, config.weights) == ("hybrid-score-dense-heavy", "hybrid_score", (0.3, 0.7))
    assert config.parser_args == {"chunk_size": 200, "chunk_overlap": 40}
    assert config.chunking_key() == resolve_config("hybrid").chunking_key()  # the defaults, given explicitly
    assert config.chunking_key() != resolve_config("llamaindex-bm25").chunking_key()
    assert config.make_parser().chunk_size == 200
    assert set(RETRIEVERS) == {"bm25", "dense", "hybrid", "hybrid_score", "hybrid_rrf", "qdrant_hybrid", "llamaindex-bm25", "llamaindex-dense"}


# -------------------------------------------------------------------------------------- errors


def test_bad_datasets_and_arguments_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist: give a BEIR folder"):
        run_eval(tmp_path / "missing", ["bm25"], tmp_path / "out", show_progress=False)
    (tmp_path / "empty_beir").mkdir()
    with pytest.raises(ValueError, match="no judgments for split 'test'"):
        run_eval(tmp_path / "empty_beir", ["bm25"], tmp_path / "out", show_progress=False)
    own = tmp_path / "own.jsonl"
    own.write_text(QUESTIONS_FILE.read_text(encoding="utf-8"), encoding="utf-8")
    with pytest.raises(ValueError, match="pass the files or folders the questions are about with --docs"):
        run_eval(own, ["bm25"], tmp_path / "out", show_progress=False)
    with pytest.raises(ValueError, match=r"--docs path\(s\) not found"):
        run_eval(own, ["bm25"], tmp_path / "out", docs=[tmp_path / "nope"], show_progress=False)
    with pytest.raises(ConfigError, match=r"given twice"):
        run_eval(QUESTIONS_FILE, ["bm25", "bm25"], tmp_path / "out", show_progress=False)
    with pytest.raises(ValueError, match="no configuration given"):
        run_eval(QUESTIONS_FILE, [], tmp_path / "out", show_progress=False)
    with pytest.raises(ValueError, match="embedding cache .* not found"):
        run_eval(QUESTIONS_FILE, ["bm25"], tmp_path / "out", embedding_cache=tmp_path / "none.sqlite", show_progress=False)
    assert not (tmp_path / "out").exists()  # nothing written before the inputs are valid


def test_merge_embedding_cache_copies_missing_vectors_and_rejects_other_files(tmp_path: Path) -> None:
    import numpy as np

    from llama_index_retrieval_kit.indices import EmbeddingCache

    source = EmbeddingCache(tmp_path / "a.sqlite")
    source.put_many("m", [("k1", np.ones(3, dtype=np.float32)), ("k2", np.zeros(3, dtype=np.float32))])
    source.close()
    target = EmbeddingCache(tmp_path / "b.sqlite")
    target.put_many("m", [("k1", np.ones(3, dtype=np.float32))])
    target.close()
    assert merge_embedding_cache(tmp_path / "a.sqlite", tmp_path / "b.sqlite") == 1
    assert merge_embedding_cache(tmp_path / "a.sqlite", tmp_path / "b.sqlite") == 0
    (tmp_path / "c.sqlite").write_text("not a database", encoding="utf-8")
    with pytest.raises(ValueError, match="not an embedding cache"):
        merge_embedding_cache(tmp_path / "c.sqlite", tmp_path / "b.sqlite")


# ------------------------------------------------------------------------------------------ CLI


def eval_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rkit")
    parser.add_argument("-q", "--quiet", action="store_true")
    add_eval_subparser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_eval_runs_the_job_and_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = eval_parser().parse_args(
        ["-q", "eval", "--dataset", str(QUESTIONS_FILE), "--config", "bm25", "--out", str(tmp_path / "cli"),
         "--docs", *map(str, sample_files()), "--ks", "1,5", "--limit-queries", "6"]
    )
    assert args.func is cmd_eval and args.ks == (1, 5)
    assert cmd_eval(args) == 0
    out = capsys.readouterr().out
    assert "ndcg@5" in out and "coverage@5" in out and "bm25" in out and "summary.md" in out
    assert (tmp_path / "cli" / "summary.md").exists()


def test_cli_rejects_bad_ks(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        eval_parser().parse_args(["eval", "--dataset", "x", "--config", "bm25", "--out", "o", "--ks", "1,ten"])
    assert "--ks must be comma-separated integers" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError):
        parse_ks("0,5")


def test_rkit_eval_when_wired_into_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llama_index_retrieval_kit import cli

    try:
        cli.build_parser().parse_args(["eval", "--help"])
    except SystemExit:
        pass
    if "--dataset" not in capsys.readouterr().out:
        pytest.skip("rkit eval is not wired into cli.py yet")
    code = cli.main(["-q", "eval", "--dataset", str(tmp_path / "missing"), "--config", "bm25", "--out", str(tmp_path / "o")])
    assert code == 2 and "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------ do the labels name the documents?


def other_documents(folder: Path) -> Path:
    """Two files the bundled questions are not about."""
    folder.mkdir()
    (folder / "recipes.txt").write_text("Pancakes need flour, eggs and milk. Whisk, then fry in butter.\n", encoding="utf-8")
    (folder / "garden.md").write_text("# Tomatoes\n\nWater tomatoes deeply twice a week in summer.\n", encoding="utf-8")
    return folder


def own_questions(path: Path, rename_ids: bool = False) -> Path:
    """A copy of the bundled questions (optionally with reference_doc_ids that name nothing)."""
    rows = [json.loads(line) for line in QUESTIONS_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    for row in rows:
        if rename_ids and row.get("reference_doc_ids"):
            row["reference_doc_ids"] = [f"doc-{i}" for i, _ in enumerate(row["reference_doc_ids"])]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("relevance", ["auto", "doc", "text"])
def test_reference_ids_that_match_no_indexed_document_are_an_error_before_anything_is_written(
    tmp_path: Path, relevance: str
) -> None:
    questions, wrong = own_questions(tmp_path / "own.jsonl"), other_documents(tmp_path / "wrong")
    with pytest.raises(UnmatchedReferencesError) as caught:
        run_eval(questions, ["bm25"], tmp_path / "out", docs=[wrong], relevance=relevance, show_progress=False)
    message = str(caught.value)
    assert message.startswith("none of the reference doc ids of 'own' names an indexed document: 3 of 3 reference doc ids (in 30 questions)")
    assert "'credit_card_terms.md'" in message and "'garden.md'" in message  # what was expected, what was indexed
    assert "--docs" in message and "--allow-unmatched-references" in message
    assert caught.value.unmatched == ["credit_card_terms.md", "privacy_policy.txt", "product_manual.md"]
    assert isinstance(caught.value, ValueError)  # rkit: a usage error (exit 2)
    assert not (tmp_path / "out").exists()


def test_allow_unmatched_references_scores_anyway(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    questions, wrong = own_questions(tmp_path / "own.jsonl"), other_documents(tmp_path / "wrong")
    caplog.set_level(logging.WARNING, logger="llama_index_retrieval_kit.evaluation")
    result = run_eval(
        questions, ["bm25"], tmp_path / "out", docs=[wrong], relevance="doc", ks=(1, 5), allow_unmatched_references=True,
        show_progress=False,
    )
    assert result.evaluations["bm25"].mean["ndcg@5"] == 0.0 and result.num_documents == 2
    assert any("3 of 3 reference doc ids (in 30 questions) match no indexed document" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="allow_unmatched_references must be True or False, got 'yes'"):
        run_eval(questions, ["bm25"], tmp_path / "out2", docs=[wrong], allow_unmatched_references="yes", show_progress=False)  # type: ignore[arg-type]


def test_some_unmatched_reference_ids_are_a_warning_with_the_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    two_of_three = [p for p in sample_files() if Path(p).name != "privacy_policy.txt"]
    caplog.set_level(logging.WARNING, logger="llama_index_retrieval_kit.evaluation")
    result = run_eval(QUESTIONS_FILE, ["bm25"], tmp_path / "out", docs=two_of_three, relevance="doc", ks=(1, 5), show_progress=False)
    assert result.num_documents == 2 and result.evaluations["bm25"].mean["hit_rate@5"] > 0.5
    warnings = [r.getMessage() for r in caplog.records if "match no indexed document" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("1 of 3 reference doc ids (in 7 questions)")
    assert "'privacy_policy.txt'" in warnings[0]


def test_text_relevance_with_wrong_ids_but_the_right_documents_only_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    questions = own_questions(tmp_path / "renamed.jsonl", rename_ids=True)
    caplog.set_level(logging.WARNING, logger="llama_index_retrieval_kit.evaluation")
    result = run_eval(questions, ["bm25"], tmp_path / "out", docs=sample_files(), ks=(1, 5), limit_queries=6, show_progress=False)
    assert result.relevance == "text" and result.evaluations["bm25"].mean["coverage@5"] > 0.5
    assert any("reference doc ids" in r.getMessage() and "match no indexed document" in r.getMessage() for r in caplog.records)
    with pytest.raises(UnmatchedReferencesError):  # scored by doc ids, the same labels cannot work
        run_eval(questions, ["bm25"], tmp_path / "out2", docs=sample_files(), relevance="doc", show_progress=False)


def test_rkit_eval_refuses_unmatched_references_unless_allowed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llama_index_retrieval_kit import cli

    questions, wrong = own_questions(tmp_path / "own.jsonl"), other_documents(tmp_path / "wrong")
    argv = ["-q", "eval", "--dataset", str(questions), "--config", "bm25", "--out", str(tmp_path / "o"), "--docs", str(wrong),
            "--ks", "1,5"]
    args = eval_parser().parse_args([*argv, "--allow-unmatched-references"])
    assert args.allow_unmatched_references is True
    assert eval_parser().parse_args(argv).allow_unmatched_references is False
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "none of the reference doc ids of 'own' names an indexed document" in err
    assert not (tmp_path / "o").exists()
    assert cli.main([*argv, "--allow-unmatched-references"]) == 0
    assert (tmp_path / "o" / "summary.md").exists()


# ------------------------------------------------------------------------- damaged or busy index folders


@pytest.fixture()
def job_copy(job, tmp_path: Path) -> Path:
    """A copy of the module job's report folder (its HybridIndex folder holds every leg and the cache)."""
    copy = tmp_path / "report"
    shutil.copytree(job.out_dir, copy)
    return copy


def _storage(report: Path) -> Path:
    (folder,) = (report / "indexes").glob("hybrid-*")
    return folder


def _rerun(report: Path):
    return run_eval(QUESTIONS_FILE, ["hybrid"], report, embed_model=shared_embed_model(), ks=(1, 5), limit_queries=3, show_progress=False)


@pytest.mark.parametrize("damaged", ["eval_inputs.json", "edge/store.json", "index.json"])
def test_a_damaged_index_file_is_rebuilt_from_the_inputs_with_a_warning_naming_it(
    job_copy: Path, damaged: str, caplog: pytest.LogCaptureFixture
) -> None:
    storage = _storage(job_copy)
    data = (storage / damaged).read_bytes()
    (storage / damaged).write_bytes(b"\x00garbage" + data[len(data) // 3 : len(data) // 2])  # cut and overwritten
    caplog.set_level(logging.WARNING, logger="llama_index_retrieval_kit.evaluation")
    again = _rerun(job_copy)
    build = again.builds[0]
    assert not build.reused and build.embedded == 0  # rebuilt, and every vector came from the cache
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert str(storage) in warned and "rebuilding" in warned
    assert again.evaluations["hybrid"].mean["hit_rate@5"] > 0.5
    assert _rerun(job_copy).builds[0].reused  # the rebuilt folder reopens


def test_a_damaged_embedding_cache_is_an_error_naming_it(job_copy: Path) -> None:
    cache = _storage(job_copy) / "embeddings.sqlite"
    cache.write_bytes(b"not a database, just bytes" * 100)
    with pytest.raises(ValueError, match=rf"embedding cache {re.escape(str(cache))} is damaged .*: delete it and run again"):
        _rerun(job_copy)


def test_an_index_open_elsewhere_is_refused_and_left_intact(job_copy: Path) -> None:
    from llama_index_retrieval_kit.indices import HybridIndex, IndexBusyError

    storage = _storage(job_copy)
    files_before = sorted(p.relative_to(storage) for p in storage.rglob("*"))
    with HybridIndex.load(storage, embed_model=shared_embed_model()) as open_index:
        with pytest.raises(IndexBusyError):
            _rerun(job_copy)
        assert sorted(p.relative_to(storage) for p in storage.rglob("*")) == files_before
        assert open_index.as_retriever(mode="sparse", similarity_top_k=2).retrieve("annual fee")


def test_an_eval_config_keeps_its_own_parser_args() -> None:
    """The caller's nested node_parser lists edited after reading: the config and its chunking key stay."""
    from llama_index_retrieval_kit.evaluation.configs import config_from_dict

    data = {"retriever": "hybrid", "node_parser": {"class": "SectionWindowNodeParser", "heading_patterns": ["^X"]}}
    config = config_from_dict(data)
    key = config.chunking_key()
    data["node_parser"]["heading_patterns"].append("^Y")
    assert config.parser_args == {"heading_patterns": ["^X"]} and config.chunking_key() == key
    args = {"heading_patterns": ["^X"]}
    direct = EvalConfig(name="d", retriever="hybrid", node_parser="SectionWindowNodeParser", parser_args=args)
    args["heading_patterns"].append("^Y")
    assert direct.parser_args == {"heading_patterns": ["^X"]}


def test_the_hybrid_config_evaluates_the_index_default_hybrid(tmp_path: Path) -> None:
    """A config that does not set candidate_top_k evaluates what `as_retriever("hybrid")` gives
    users (its feedback fusion reads 200 candidates per leg). Before, the job passed 100 and 28 of
    the 38 bundled questions ranked otherwise than the default over 206 chunks."""
    small = {"chunk_size": 32, "chunk_overlap": 0}  # more chunks than 100, so the depth matters
    configs = [
        EvalConfig(name=name, retriever="hybrid", node_parser="SectionWindowNodeParser", parser_args=small, **extra)
        for name, extra in (("unset", {}), ("two-hundred", {"candidate_top_k": 200}), ("one-hundred", {"candidate_top_k": 100}))
    ]
    assert configs[0].candidate_top_k is None
    result = run_eval(QUESTIONS_FILE, configs, tmp_path / "out", embed_model=shared_embed_model(), relevance="node", show_progress=False)
    rankings = {name: {q: e.ranking for q, e in result.evaluations[name].per_query.items()} for name in ("unset", "two-hundred", "one-hundred")}
    assert rankings["unset"] == rankings["two-hundred"]
    assert sum(rankings["unset"][q] != rankings["one-hundred"][q] for q in rankings["unset"]) > 0
