"""The walkthroughs in notebooks/ run top to bottom, quickly, and their stored outputs are current.

The notebooks are committed *with* their outputs so they can be read without running them
(docs/notebooks.md). Each test executes a fresh copy of a notebook with the package's own kernel,
exactly as ``scripts/execute_notebooks.py`` does before it writes the outputs, and checks that:

* no cell fails, and the notebook finishes within ``RUNTIME_LIMIT_S``;
* the stored outputs belong to the stored code and match a fresh run in structure (same output
  kinds per cell: every cell that prints, plots or shows a table in the fresh run has that output
  stored, and nothing else), see ``execute_notebooks.staleness``;
* the notebook shows what it is meant to show (``EXPECTED``: its figures, and text that only a
  working run prints);
* the stored file stays small, and running it writes nothing next to the notebooks or samples.

A notebook that fails the staleness check is fixed by re-running the script:
``.venv/bin/python scripts/execute_notebooks.py notebooks/NAME.ipynb``.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any, Dict, List, Tuple

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("execute_notebooks", REPO / "scripts" / "execute_notebooks.py")
execute_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute_notebooks)  # type: ignore[union-attr]

NOTEBOOKS = execute_notebooks.notebooks()
RUNTIME_LIMIT_S = 120  # each notebook runs in 10-20 s on the 2-core machine; the limit leaves room for a loaded one
WATCHED_DIRS = [REPO / "notebooks", REPO / "llama_index_retrieval_kit" / "samples"]

# What each notebook must show in a fresh run: at least `figures` PNG images, and these strings in
# its text outputs (stdout, tables' text/plain, Markdown). Every notebook needs an entry.
EXPECTED: Dict[str, Dict[str, Any]] = {
    "01_chunking_a_pdf.ipynb": {
        "figures": 1,
        "text": ["credit_card_terms.pdf: 5 pages", "Page 2 of 5", "36 sections", "SectionWindowNodeParser: 38 chunks, 0 mix sections",
                 "parents,", "product_manual.md"],
    },
    "02_hybrid_vs_bm25_vs_dense.ipynb": {
        "figures": 2,
        "text": ["62 chunks from", "hybrid_rrf top: ranks", "hit_rate@1", "BM25 better on", "5 results, all from product_manual.md",
                 "chunks after reopening"],
    },
    "03_evaluation_job.ipynb": {
        "figures": 2,
        "text": ["index build HybridIndex: shared by ['bm25', 'dense', 'hybrid', 'hybrid-dense-heavy'], 62 texts embedded",
                 "#### Main metrics", "metrics_vs_k", "wilcoxon_p", "answerable questions"],
    },
    "04_no_answer_calibration.ipynb": {
        "figures": 1,
        "text": ["near miss", "answerable_kept", "off-topic: 6 of 6 abstained", "answerable: 0 of 6 abstained"],
    },
    "05_rerank_context_trace.ipynb": {
        "figures": 1,
        "text": ["model.safetensors", "rerank score (random)", "RerankStats(candidates=20", "left out: {'over budget'",
                 "== rerank (rerank, CrossEncoderReranker)", "confidence", "context tokens", "Context information is below."],
    },
    "06_query_and_chat_engine.ipynb": {
        "figures": 0,
        "text": ["no_answer: True | confidence", "I could not find the answer to this question in the indexed documents.",
                 "LLM calls this turn: {'condense': 1}", "late payment fee of up to $40",
                 "[condense_plus_context] I could not find the answer", "[context] I could not find the answer",
                 "LLM calls this turn: none"],
    },
}


def _snapshot() -> set:
    return {p for d in WATCHED_DIRS for p in d.rglob("*") if "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts}


@functools.lru_cache(maxsize=None)
def fresh_run(path: Path) -> Tuple[Any, float, set]:
    """Execute the notebook once per test session: (executed copy, seconds, files that appeared)."""
    before = _snapshot()
    nb, seconds = execute_notebooks.execute(path)
    return nb, seconds, _snapshot() - before


def text_outputs(nb: Any) -> str:
    parts: List[str] = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                parts.append(output.get("text", ""))
            for mime in ("text/plain", "text/markdown"):
                if mime in output.get("data", {}):
                    parts.append(output["data"][mime])
    return "\n".join(parts)


def figures(nb: Any) -> int:
    return sum("image/png" in o.get("data", {}) for cell in nb.cells for o in cell.get("outputs", []))


def test_every_notebook_has_expectations() -> None:
    assert [p.name for p in NOTEBOOKS] == sorted(EXPECTED), "add an EXPECTED entry for each notebook (and remove stale ones)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_shows_its_results(path: Path) -> None:
    nb, seconds, new_files = fresh_run(path)
    assert not execute_notebooks.errors(nb)
    assert seconds < RUNTIME_LIMIT_S, f"{path.name} took {seconds:.0f} s (limit {RUNTIME_LIMIT_S} s): keep the walkthroughs small"
    assert not new_files, f"{path.name} wrote into the repository: {sorted(map(str, new_files))}"
    expected = EXPECTED[path.name]
    assert figures(nb) >= expected["figures"], f"{path.name}: {figures(nb)} figures, expected at least {expected['figures']}"
    text = text_outputs(nb)
    missing = [s for s in expected["text"] if s not in text]
    assert not missing, f"{path.name}: the fresh run's outputs lack {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_stored_outputs_are_current(path: Path) -> None:
    stored = nbformat.read(path, as_version=4)
    fresh, _, _ = fresh_run(path)
    problems = execute_notebooks.staleness(stored, fresh)
    assert not problems, (
        f"{path.name}: stored outputs are stale; run `.venv/bin/python scripts/execute_notebooks.py {path.relative_to(REPO)}`:\n  "
        + "\n  ".join(problems)
    )
    size = path.stat().st_size
    assert size < execute_notebooks.MAX_NOTEBOOK_BYTES, f"{path.name} is {size / 1000:.0f} KB: shrink its figures"
    assert figures(stored) == figures(fresh)
