"""What the evaluation scores and reports: passages per chunk, score order, depth, abstention, split.

Each test pins one of the audit findings: a chunk holding several reference passages finds each
(F1); results are scored in score order, not a context assembler's presentation order, and doc
aggregation ranks documents by their best chunk (F2); metric@k where a config returned fewer
than k items is flagged (F3); a gate's abstentions are reported (F4); the split and the query
limit are chosen and recorded (F5).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_index_retrieval_kit.evaluation import (
    RetrievalDataset,
    doc_level_run,
    evaluate_retriever,
    evaluate_run,
    load_jsonl,
    run_eval,
    score_retrievals,
)
from llama_index_retrieval_kit.evaluation.evaluate import (
    Retrieval,
    passage_first_ranks,
    passage_metrics,
    passage_qrels,
    passage_ranking,
    ranked_by_score,
)
from llama_index_retrieval_kit.evaluation.job import load_dataset
from llama_index_retrieval_kit.evaluation.metrics import METRIC_NAMES
from llama_index_retrieval_kit.evaluation.report import CAPPED_MARK, comparison_table, significance_tests
from llama_index_retrieval_kit.samples import QUESTIONS_FILE, sample_files

from .test_metrics import ranx, ranx_per_query

LATE_FEE = "The late payment fee is 25 dollars per missed payment."
ANNUAL_FEE = "The annual fee is waived for the first year of membership."


# ------------------------------------------------------------------ F1: several passages in one chunk


def test_a_chunk_holding_two_reference_passages_finds_both() -> None:
    dataset = RetrievalDataset(queries={"q1": "fees"}, qrels={}, reference_contexts={"q1": [LATE_FEE, ANNUAL_FEE]})
    texts = (f"{LATE_FEE} {ANNUAL_FEE}", "unrelated text about filters", "more unrelated text")
    retrievals = {"q1": Retrieval("q1", ("n1", "n2", "n3"), (0.9, 0.8, 0.7), ("D", "D", "D"), texts, 0.01)}
    ev = score_retrievals(retrievals, dataset, ks=[1, 3], relevance="text")
    metrics = ev.per_query["q1"].metrics
    assert metrics["coverage@1"] == 1.0
    assert metrics["recall@1"] == metrics["recall@3"] == 1.0  # was 0.5: the chunk got credit for one passage
    assert metrics["map@3"] == 1.0 and metrics["ndcg@3"] == 1.0  # were 0.5 and 0.61
    assert metrics["precision@1"] == 1.0 and metrics["precision@3"] == pytest.approx(1 / 3)  # one relevant chunk
    assert ev.per_query["q1"].ranking == ("ref0+ref1", "chunk2", "chunk3")
    assert passage_first_ranks(texts, [LATE_FEE, ANNUAL_FEE]) == [1, 1]


def test_passage_metrics_by_hand() -> None:
    # Passages 0 and 1 first held by the chunk at rank 2, passage 2 by the chunk at rank 3.
    m = passage_metrics([2, 2, 3], ks=[1, 2, 3])
    assert all(m[f"{name}@1"] == 0.0 for name in METRIC_NAMES)
    assert m["recall@2"] == pytest.approx(2 / 3) and m["recall@3"] == 1.0
    assert m["precision@3"] == pytest.approx(2 / 3) and m["mrr@3"] == 0.5 and m["hit_rate@2"] == 1.0
    assert m["map@3"] == pytest.approx((1 / 2 + 1 / 2 + 2 / 3) / 3)
    ideal = 1 + 1 / math.log2(3) + 1 / math.log2(4)
    assert m["ndcg@3"] == pytest.approx((2 / math.log2(3) + 1 / math.log2(4)) / ideal)
    # A passage no chunk holds still counts in P.
    assert passage_metrics([1, None], ks=[5])["recall@5"] == 0.5
    with pytest.raises(ValueError, match=r"first_ranks\[1\] must be a rank >= 1 or None"):
        passage_metrics([1, 0])
    with pytest.raises(ValueError, match="non-empty list"):
        passage_metrics([])


@st.composite
def distinct_first_ranks(draw: st.DrawFn) -> tuple[list[int | None], int]:
    """First ranks of 1-6 passages, no two at one rank (some not found), and a chunk count."""
    num_chunks = draw(st.integers(1, 15))
    num_passages = draw(st.integers(1, 6))
    ranks = draw(st.lists(st.integers(1, num_chunks), unique=True, max_size=num_passages))
    ranks = ranks + [None] * (num_passages - len(ranks))
    return draw(st.permutations(ranks)), num_chunks


def _items(first_ranks: list[int | None], num_chunks: int) -> list[str]:
    """The passage ranking the definition gives: ref{j} at r_j, chunk{rank} elsewhere."""
    at = {rank: j for j, rank in enumerate(first_ranks) if rank is not None}
    return [f"ref{at[rank]}" if rank in at else f"chunk{rank}" for rank in range(1, num_chunks + 1)]


@settings(max_examples=150, deadline=None)
@given(case=distinct_first_ranks(), ks=st.lists(st.integers(1, 20), min_size=1, max_size=3, unique=True))
def test_with_one_passage_per_chunk_the_metrics_are_trec_eval_on_the_passage_ranking(case, ks) -> None:
    first_ranks, num_chunks = case
    references = [f"passage {j}" for j in range(len(first_ranks))]
    run, qrels = {"q": _items(first_ranks, num_chunks)}, {"q": passage_qrels(references)}
    expected = evaluate_run(run, qrels, ks=ks).per_query["q"]
    assert passage_metrics(first_ranks, ks) == pytest.approx(expected, abs=1e-12)
    if ranx is not None:  # and so ranx's values (the oracle of tests/evaluation/test_metrics.py)
        keys = [f"{name}@{k}" for name in METRIC_NAMES for k in ks]
        oracle = ranx_per_query(run, qrels, keys)["q"]
        assert passage_metrics(first_ranks, ks) == pytest.approx(oracle, abs=1e-9)


@settings(max_examples=150, deadline=None)
@given(
    ranks=st.lists(st.one_of(st.none(), st.integers(1, 12)), min_size=1, max_size=6),
    ks=st.lists(st.integers(1, 15), min_size=1, max_size=3, unique=True),
    data=st.data(),
)
def test_finding_a_passage_earlier_never_lowers_recall_ndcg_or_hits(ranks, ks, data) -> None:
    metrics = passage_metrics(ranks, ks)
    assert all(0.0 <= value <= 1.0 for value in metrics.values())
    for k in ks:
        assert metrics[f"recall@{k}"] == sum(1 for r in ranks if r is not None and r <= k) / len(ranks)
    j = data.draw(st.integers(0, len(ranks) - 1))
    earlier = list(ranks)
    earlier[j] = data.draw(st.integers(1, ranks[j] if ranks[j] is not None else 12))
    better = passage_metrics(earlier, ks)
    for name in ("recall", "ndcg", "mrr", "hit_rate"):
        for k in ks:
            assert better[f"{name}@{k}"] >= metrics[f"{name}@{k}"] - 1e-12


def test_passage_ranking_names_every_passage_a_chunk_finds_first() -> None:
    texts = ["intro", f"{ANNUAL_FEE} {LATE_FEE}", LATE_FEE]
    assert passage_ranking(texts, [LATE_FEE, ANNUAL_FEE]) == ["chunk1", "ref0+ref1", "chunk3"]


# ------------------------------------------------------------------ F2: score order, not display order


def test_doc_level_run_ranks_documents_by_their_best_score() -> None:
    chunk_to_doc = {"a1": "A", "a2": "A", "b1": "B", "c1": "C"}
    run = [("a1", 0.2), ("b1", 0.9), ("a2", 0.5), ("c1", 0.5)]
    # max score per document, ordered by it; A and C tie at 0.5 and keep first-occurrence order
    assert doc_level_run(run, chunk_to_doc) == [("B", 0.9), ("A", 0.5), ("C", 0.5)]


def _bookends(items: list) -> list:
    """best, 3rd, 5th, ..., 4th, 2nd: the context assembler's default presentation order."""
    return items[::2] + items[1::2][::-1]


def test_results_are_scored_in_score_order_whatever_order_they_came_in() -> None:
    refs = [f"The fee number {word} is listed in the schedule of charges." for word in ("one", "two", "three")]
    dataset = RetrievalDataset(
        queries={"q": "fees"}, qrels={"q": {"d0": 1, "d2": 1}}, reference_contexts={"q": refs}
    )
    node_ids = tuple(f"n{i}" for i in range(6))
    scores = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
    doc_ids = ("d0", "d1", "d2", "d3", "d4", "d5")
    texts = (refs[0], "filler one", refs[1], "filler two", refs[2], "filler three")
    in_order = Retrieval("q", node_ids, scores, doc_ids, texts, 0.01)
    shown = Retrieval(
        "q", *(tuple(_bookends(list(x))) for x in (node_ids, scores, doc_ids, texts)), 0.01  # type: ignore[arg-type]
    )
    assert ranked_by_score(shown).node_ids == node_ids and ranked_by_score(shown).reordered
    assert not ranked_by_score(in_order).reordered
    for relevance in ("doc", "text"):
        a = score_retrievals({"q": in_order}, dataset, ks=(1, 3, 6), relevance=relevance)
        b = score_retrievals({"q": shown}, dataset, ks=(1, 3, 6), relevance=relevance)
        assert a.mean == b.mean, relevance
        assert b.per_query["q"].retrieval.reordered and b.returned()["reordered_queries"] == 1
    # Without scores there is no relevance order to restore: the order given is the ranking.
    unscored = Retrieval("q", shown.node_ids, (None,) * 6, shown.doc_ids, shown.texts, 0.01)
    assert ranked_by_score(unscored) is unscored


def test_a_context_assemblers_bookends_order_scores_like_its_relevance_order() -> None:
    """Real chunks, BM25 and ContextAssembler: same spans in two presentation orders, same scores."""
    from llama_index_retrieval_kit.ingest import read_documents
    from llama_index_retrieval_kit.node_parser import SectionWindowNodeParser
    from llama_index_retrieval_kit.pipeline import PostprocessedRetriever
    from llama_index_retrieval_kit.postprocessor.context import ContextAssembler
    from llama_index_retrieval_kit.retrievers import BM25Retriever

    documents, failures = read_documents(sample_files())
    assert not failures
    nodes = SectionWindowNodeParser(chunk_size=96, chunk_overlap=16).get_nodes_from_documents(documents)
    dataset = load_jsonl(QUESTIONS_FILE)
    evaluations = {}
    for order in ("relevance", "bookends"):
        assembler = ContextAssembler(max_tokens=4096, order=order, tokenizer=str.split)
        retriever = PostprocessedRetriever(BM25Retriever(list(nodes), similarity_top_k=10), [assembler])
        evaluations[order] = {rel: evaluate_retriever(retriever, dataset, ks=(1, 3, 5), relevance=rel) for rel in ("doc", "text")}
    for rel in ("doc", "text"):
        relevance, bookends = evaluations["relevance"][rel], evaluations["bookends"][rel]
        # chars@k aside: compact citation hints depend on the span before, so the texts differ a little
        ir_keys = [key for key in relevance.mean if not key.startswith("chars@")]
        assert {key: bookends.mean[key] for key in ir_keys} == pytest.approx({key: relevance.mean[key] for key in ir_keys}, abs=1e-12), rel
    for rel in ("doc", "text"):
        relevance, bookends = evaluations["relevance"][rel], evaluations["bookends"][rel]
        assert bookends.returned()["reordered_queries"] > 0 and relevance.returned()["reordered_queries"] == 0


# ------------------------------------------------------------------ F3: depth


def _doc_retrieval(qid: str, docs: list[str]) -> Retrieval:
    return Retrieval(qid, tuple(f"{qid}-{d}" for d in docs), tuple(1.0 - i / 10 for i in range(len(docs))), tuple(docs), (), 0.0)


def test_metrics_at_a_k_beyond_what_most_queries_returned_are_flagged() -> None:
    queries = {f"q{i}": "x" for i in range(6)}
    dataset = RetrievalDataset(queries=queries, qrels={q: {"d9": 1, "d1": 1} for q in queries})
    deep = {q: _doc_retrieval(q, [f"d{j}" for j in range(12)]) for q in queries}
    shallow = {q: _doc_retrieval(q, ["d0", "d1", "d2"]) for q in queries}
    half = {q: _doc_retrieval(q, ["d0", "d1", "d2"] if i < 3 else [f"d{j}" for j in range(12)]) for i, q in enumerate(queries)}
    evs = {name: score_retrievals(r, dataset, ks=(1, 3, 10), relevance="doc") for name, r in
           (("deep", deep), ("shallow", shallow), ("half", half))}
    assert evs["shallow"].short_of_k() == {1: 0, 3: 0, 10: 6} and evs["shallow"].capped_ks() == [10]
    assert evs["half"].capped_ks() == [] and evs["deep"].capped_ks() == []  # 3 of 6 is not most
    returned = evs["shallow"].returned()
    assert returned["unit"] == "documents" and returned["mean_docs"] == 3.0 and returned["mean_chunks"] == 3.0
    assert evs["shallow"].is_capped("recall@10") and not evs["shallow"].is_capped("recall@3")
    table = comparison_table(evs, ["recall@3", "recall@10"], bold=[])
    assert f"| shallow | 0.5000 | 0.5000 {CAPPED_MARK} |" in table and f"| deep | 0.5000 | 1.0000 |" in table
    rows = significance_tests(evs, ["recall@10", "recall@3"])
    row = next(r for r in rows if (r["a"], r["b"], r["metric"]) == ("deep", "shallow", "recall@10"))
    assert row["capped"] == ["shallow"] and row["depth"] == "shallow returned < 10 documents for 6/6 queries"
    assert all(not r["capped"] and r["depth"] == "" for r in rows if r["metric"] == "recall@3")
    assert evs["shallow"].summary()["returned"]["capped_ks"] == [10]


# ------------------------------------------------------------------ F4: abstention


def test_a_gates_abstentions_are_scored_on_the_no_answer_questions() -> None:
    queries = {f"a{i}": "q" for i in range(4)} | {f"n{i}": "q" for i in range(4)}
    dataset = RetrievalDataset(queries=queries, qrels={f"a{i}": {"D": 1} for i in range(4)})
    hit = lambda q: Retrieval(q, ("c1", "c2"), (0.9, 0.1), ("D", "E"), (), 0.0)  # noqa: E731
    junk = lambda q: Retrieval(q, ("c9",), (0.2,), ("E",), (), 0.0)  # noqa: E731
    empty = lambda q: Retrieval(q, (), (), (), (), 0.0)  # noqa: E731
    ungated = {f"a{i}": hit(f"a{i}") for i in range(4)} | {f"n{i}": junk(f"n{i}") for i in range(4)}
    gated = {f"a{i}": hit(f"a{i}") for i in range(3)} | {"a3": empty("a3")} | {f"n{i}": empty(f"n{i}") for i in range(4)}
    gate = score_retrievals(gated, dataset, ks=[1], relevance="doc").abstention()
    assert gate == {
        "num_no_answer": 4, "num_answerable": 4, "abstained": 5, "abstained_no_answer": 4, "abstained_answerable": 1,
        "recall": 1.0, "precision": 0.8, "answerable_kept": 0.75,
    }
    plain = score_retrievals(ungated, dataset, ks=[1], relevance="doc")
    assert plain.abstention()["recall"] == 0.0 and plain.abstention()["precision"] is None
    assert plain.summary()["abstention"]["answerable_kept"] == 1.0
    answerable_only = RetrievalDataset(queries={"a0": "q"}, qrels={"a0": {"D": 1}})
    ev = score_retrievals({"a0": hit("a0")}, answerable_only, ks=[1], relevance="doc")
    assert ev.abstention() is None and "abstention" not in ev.summary()


# ------------------------------------------------------------------ the report: F3, F4, F5 end to end


def write_beir_with_splits(folder: Path) -> Path:
    """Six documents; test split: 3 answerable questions and 1 no-answer one; train split: 2."""
    folder.mkdir(parents=True)
    topics = ["late payment fee forty dollars", "annual fee waived first year", "water filter cartridge replacement",
              "privacy policy location data", "warranty claim receipt", "foreign transaction fee three percent"]
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": f"d{i}", "title": f"Doc {i}", "text": f"All about the {t}."}) + "\n" for i, t in enumerate(topics)),
        encoding="utf-8",
    )
    questions = {"q1": "late payment fee", "q2": "annual fee waived", "q3": "filter cartridge", "q4": "boarding gate",
                 "t1": "privacy location", "t2": "warranty receipt"}
    (folder / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in questions.items()), encoding="utf-8"
    )
    header = "query-id\tcorpus-id\tscore\n"
    (folder / "qrels_test.tsv").write_text(header + "q1\td0\t1\nq2\td1\t1\nq3\td2\t1\nq4\td5\t0\n", encoding="utf-8")
    (folder / "qrels_train.tsv").write_text(header + "t1\td3\t1\nt2\td4\t1\n", encoding="utf-8")
    return folder


def test_the_report_records_split_limit_depth_and_abstention(tmp_path: Path) -> None:
    folder = write_beir_with_splits(tmp_path / "tiny")
    top1 = tmp_path / "top1.yaml"
    top1.write_text("name: bm25-top1\nretriever: bm25\nsimilarity_top_k: 1\n", encoding="utf-8")
    result = run_eval(folder, ["bm25", top1], tmp_path / "out", ks=(1, 3), limit_queries=4, show_progress=False)
    data = json.loads((tmp_path / "out" / "metrics.json").read_text(encoding="utf-8"))
    assert data["dataset"]["split"] == "test" and data["dataset"]["num_queries_available"] == 4
    assert data["dataset"]["limit_queries"] == 4 and data["dataset"]["num_queries"] == 4
    by_name = {c["name"]: c for c in data["configs"]}
    assert by_name["bm25-top1"]["capped_metrics"] == [f"{m}@3" for m in METRIC_NAMES]
    assert by_name["bm25"]["capped_metrics"] == [] and 1.0 < by_name["bm25"]["returned"]["mean_docs"] <= 3.0
    assert by_name["bm25-top1"]["returned"]["mean_chunks"] == 1.0 and by_name["bm25-top1"]["returned"]["short_of_k"] == {"1": 0, "3": 3}
    for config in data["configs"]:  # BM25 returns nothing for "boarding gate" (no shared term): an abstention
        assert config["num_no_answer"] == 1 and config["abstention"]["abstained_no_answer"] == 1
        assert config["abstention"]["recall"] == config["abstention"]["precision"] == 1.0
        assert config["abstention"]["answerable_kept"] == 1.0
    rows = [r for r in data["significance"] if r["metric"] == "ndcg@3"]
    assert rows and all(r["capped"] == ["bm25-top1"] for r in rows)
    summary = (tmp_path / "out" / "summary.md").read_text(encoding="utf-8")
    assert f"`{folder}`, split `test` (4 queries;" in summary
    assert "## Returned per query" in summary and "## No-answer questions" in summary
    assert f"bm25-top1 returned < 3 documents for 3/3 queries" in summary
    assert "ordered by score" in summary
    table_row = next(line for line in summary.splitlines() if line.startswith("| bm25-top1 |"))
    assert f" {CAPPED_MARK} |" in table_row
    assert result.split == "test"

    limited = run_eval(folder, ["bm25"], tmp_path / "limited", ks=(1,), limit_queries=2, split="test", show_progress=False)
    assert len(limited.dataset) == 2 and limited.num_queries_available == 4
    text = (tmp_path / "limited" / "summary.md").read_text(encoding="utf-8")
    assert "split `test` (first 2 of 4 queries (--limit-queries 2);" in text
    assert "No-answer questions" not in text  # the first two questions are answerable


def test_split_is_chosen_validated_and_refused_for_jsonl(tmp_path: Path) -> None:
    folder = write_beir_with_splits(tmp_path / "tiny")
    train = run_eval(folder, ["bm25"], tmp_path / "train", ks=(1, 3), split="train", show_progress=False)
    assert list(train.dataset.queries) == ["t1", "t2"] and train.split == "train"
    assert json.loads((tmp_path / "train" / "metrics.json").read_text(encoding="utf-8"))["dataset"]["split"] == "train"
    with pytest.raises(ValueError, match=r"split 'dev' is not in .*its splits are \['test', 'train'\]"):
        run_eval(folder, ["bm25"], tmp_path / "dev", split="dev", show_progress=False)
    assert not (tmp_path / "dev").exists()
    with pytest.raises(ValueError, match="JSONL question file, which has no splits: drop --split test"):
        load_dataset(QUESTIONS_FILE, split="test")
    assert load_dataset(folder).split == "test" and load_dataset(QUESTIONS_FILE).split == ""


def test_rkit_eval_takes_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llama_index_retrieval_kit.cli import EXIT_USAGE, main

    folder = write_beir_with_splits(tmp_path / "tiny")
    assert main(["-q", "eval", "--dataset", str(folder), "--config", "bm25", "--out", str(tmp_path / "o"),
                 "--split", "train", "--ks", "1,3"]) == 0
    out = capsys.readouterr().out
    assert "tiny (train split): 2 scored queries" in out
    code = main(["-q", "eval", "--dataset", str(folder), "--config", "bm25", "--out", str(tmp_path / "p"), "--split", "dev"])
    assert code == EXIT_USAGE and "its splits are ['test', 'train']" in capsys.readouterr().err


# ------------------------------------------------------------------ F5: rkit calibrate


def questions_as_beir(folder: Path) -> Path:
    """The bundled questions as a BEIR folder over the sample files' ids: odd questions in train, even in test."""
    folder.mkdir(parents=True)
    rows = [json.loads(line) for line in QUESTIONS_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": p.name, "title": "", "text": p.name}) + "\n" for p in sample_files()), encoding="utf-8"
    )
    (folder / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": r["id"], "text": r["question"]}) + "\n" for r in rows), encoding="utf-8"
    )
    for split, part in (("train", rows[1::2]), ("test", rows[::2])):
        lines = ["query-id\tcorpus-id\tscore"]
        for r in part:
            docs = r.get("reference_doc_ids") or []
            lines += [f"{r['id']}\t{d}\t1" for d in docs] or [f"{r['id']}\t{sample_files()[0].name}\t0"]
        (folder / f"qrels_{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def _rkit(*argv: str) -> tuple[int, str]:
    from llama_index_retrieval_kit.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["-q", *argv])
    return code, buf.getvalue()


def test_rkit_calibrate_takes_split_and_says_its_figures_are_in_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llama_index_retrieval_kit.cli import EXIT_USAGE, build_parser

    storage = tmp_path / "index"
    code, out = _rkit("index", *map(str, sample_files()), "--storage", str(storage))
    assert code == 0, out
    beir = questions_as_beir(tmp_path / "beir")
    code, out = _rkit("calibrate", "--storage", str(storage), "--dataset", str(beir), "--split", "train",
                      "--out", str(tmp_path / "gate.json"))
    assert code == 0, out
    assert "in-sample: these figures are measured on the calibration questions themselves (train split)" in out
    from llama_index_retrieval_kit.postprocessor.no_answer import NoAnswerPostprocessor

    fit = NoAnswerPostprocessor.load(tmp_path / "gate.json").fit_report
    assert fit["split"] == "train" and fit["in_sample"] is True
    capsys.readouterr()
    code, _ = _rkit("calibrate", "--storage", str(storage), "--dataset", str(beir), "--split", "dev",
                    "--out", str(tmp_path / "gate2.json"))
    assert code == EXIT_USAGE and "its splits are ['test', 'train']" in capsys.readouterr().err
    capsys.readouterr()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["calibrate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--split NAME" in help_text and "(in-sample)" in help_text and "calibrate on a train/dev split" in help_text
