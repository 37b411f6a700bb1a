"""Randomized kill -9 trials of index writes (shared by tests/indices/test_kill_random.py and
benchmarks/kill_test.py).

A child process applies a seeded sequence of upserts and deletes to an index (and, every fifth
write, ``HybridIndex.optimize``) and logs every committed state; the parent kills it (SIGKILL) at a random moment, reopens the folder and checks
that it opens consistent (every leg holds exactly the docstore's chunks) at the last logged state
or the one after it (the write in flight may have committed before it was logged).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding

from llama_index_retrieval_kit.indices import HybridIndex

EMBED_DIM = 8
DOC_IDS = 12
REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys
sys.path.insert(0, {repo!r})
from tests.indices._kill import apply_plan
apply_plan({path!r}, {log!r}, {seed})
"""


def embed_model() -> MockEmbedding:
    return MockEmbedding(embed_dim=EMBED_DIM)


def initial_documents() -> List[Document]:
    return [Document(id_=f"doc-{i}.txt", text=f"Section {i}. The annual fee is {i} dollars. " * 5) for i in range(4)]


def plan(seed: int, start: Sequence[str], steps: int = 400) -> List[Tuple[str, str, str, frozenset]]:
    """The seeded operations ``(kind, doc_id, text, state after)``; the same on both sides."""
    rng = random.Random(seed)
    state = set(start)
    out = []
    for step in range(steps):
        if state and rng.random() < 0.35:
            doc_id = rng.choice(sorted(state))
            state.discard(doc_id)
            out.append(("delete", doc_id, "", frozenset(state)))
        else:
            doc_id = f"doc-{rng.randrange(DOC_IDS)}.txt"
            words = " ".join(f"clause{step}x{rng.randrange(1000)}" for _ in range(rng.randint(5, 400)))
            state.add(doc_id)
            out.append(("upsert", doc_id, f"# Terms {step}\n\n{words}.", frozenset(state)))
    return out


def apply_plan(path: str, log: str, seed: int) -> None:
    """The child: apply ``plan(seed)`` until killed, logging each committed state."""
    with HybridIndex.load(path, embed_model=embed_model()) as index:
        ops = plan(seed, index.doc_ids())
        for step, (kind, doc_id, text, state) in enumerate(ops):
            if kind == "delete":
                index.delete(doc_id)
            else:
                index.upsert([Document(id_=doc_id, text=text)])
            with open(log, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(sorted(state)) + "\n")
            if step % 5 == 4:  # the engine's optimisers (segments merged, deleted points vacuumed): killed too
                index.optimize()
            if step == 0:  # warm (imports done): the kill lands among writes, not during start-up
                print("ready", flush=True)


@dataclass
class Trial:
    seed: int
    kill_after_s: float
    committed: int  # states logged before the kill
    outcome: str  # "before" (the last logged state) or "after" (the in-flight write committed)


def run_trial(folder: Path, seed: int, rng: random.Random, max_wait_s: float = 2.5) -> Trial:
    """One kill: returns where the reopened folder landed; AssertionError when it is inconsistent."""
    from . import _support

    with HybridIndex.load(folder, embed_model=embed_model()) as index:
        start = index.doc_ids()
    log = folder.parent / f"{folder.name}.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(repo=str(REPO), path=str(folder), log=str(log), seed=seed)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    try:
        line = child.stdout.readline().strip()
        if line != "ready":
            raise AssertionError(f"child did not start: {line!r} {child.stderr.read()}")
        wait = rng.uniform(0.0, max_wait_s)
        time.sleep(wait)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(60)
    lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    ops = plan(seed, start)
    states = [frozenset(start)] + [op[3] for op in ops]
    committed = len(lines)
    with HybridIndex.load(folder, embed_model=embed_model()) as index:
        _support.assert_consistent(index)
        got = frozenset(index.doc_ids())
    if got == states[committed]:
        outcome = "before"
    elif committed + 1 < len(states) and got == states[committed + 1]:
        outcome = "after"
    else:
        raise AssertionError(f"seed {seed}: reopened at {sorted(got)}, expected state {committed} or {committed + 1}")
    return Trial(seed, wait, committed, outcome)


def new_folder(path: Path) -> Path:
    HybridIndex.from_documents(initial_documents(), path, embed_model=embed_model()).close()
    return path


def run_trials(folder: Path, trials: int, seed: int = 0, max_wait_s: float = 2.5, progress: Optional[object] = None) -> List[Trial]:
    rng = random.Random(seed)
    out = []
    for i in range(trials):
        out.append(run_trial(folder, seed * 100_000 + i, rng, max_wait_s))
        if progress is not None:
            progress.update(1)  # type: ignore[attr-defined]
    return out
