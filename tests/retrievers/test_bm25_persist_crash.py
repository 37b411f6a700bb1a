"""BM25Retriever.persist over an earlier persist never loses it.

A persist that fails or is killed part-way leaves a folder that loads the earlier index, scoring
exactly as before (or the new one, once its config is in place); the next persist completes the
replacement. Files in the folder that persist did not write are never touched, and a first
persist into a fresh folder writes only its payload.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest
from llama_index.core.schema import TextNode

from llama_index_retrieval_kit.retrievers import BM25Retriever

PAYLOAD = ["bm25s", "nodes.json", "retriever.json", "tokens.npz", "tokens_vocab.json"]
QUERIES = ["annual fee", "payment missed", "interest balance", "clause", "card statement dispute"]
REPO = Path(__file__).resolve().parents[2]


def chunk(node_id: str, text: str) -> TextNode:
    return TextNode(id_=node_id, text=text)


def three_nodes() -> List[TextNode]:
    return [
        chunk("a-0", "The annual fee is charged every year on the card."),
        chunk("a-1", "Late payment fees apply when the minimum payment is missed."),
        chunk("a-2", "Interest is charged daily on the average balance."),
    ]


def five_nodes() -> List[TextNode]:
    return [
        chunk("b-0", "A new annual fee schedule for every card."),
        chunk("b-1", "Disputes must be raised within sixty days of the statement."),
        chunk("b-2", "Interest accrues on the statement balance."),
        chunk("b-3", "Each clause of the agreement applies to the card holder."),
        chunk("b-4", "A missed payment is reported after thirty days."),
    ]


def ranked(retriever: BM25Retriever) -> Dict[str, List[Tuple[str, float]]]:
    return {q: [(r.node.node_id, r.score) for r in retriever.retrieve(q)] for q in QUERIES}  # type: ignore[misc]


def signature(retriever: BM25Retriever) -> Tuple[List[dict], Dict[str, List[Tuple[str, float]]]]:
    """What tells two indexes apart: the nodes and the exact scores of every query."""
    return [n.to_dict() for n in retriever.nodes], ranked(retriever)


def tree(folder: Path) -> Dict[str, Optional[bytes]]:
    """Every path under ``folder`` with its bytes (None for a folder)."""
    return {
        p.relative_to(folder).as_posix(): (None if p.is_dir() else p.read_bytes()) for p in sorted(folder.rglob("*"))
    }


def add_foreign_files(folder: Path) -> Dict[str, Optional[bytes]]:
    """What LlamaIndex's StorageContext.persist (and a user) keep beside the BM25 files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docstore.json").write_text('{"docstore/data": {}}')
    (folder / "index_store.json").write_text('{"index_store/data": {}}')
    (folder / "notes").mkdir()
    (folder / "notes" / "readme.txt").write_text("mine")
    return tree(folder)


class InjectedCrash(Exception):
    """Stands for the process dying: nothing in persist may catch it."""


@contextmanager
def crash_after_step(monkeypatch: pytest.MonkeyPatch, step: int) -> Iterator[List[str]]:
    """Raise :class:`InjectedCrash` right after the ``step``-th file-system change (1-based):
    a move, a file or folder written or removed, an fsync. Yields the steps taken so far."""
    taken: List[str] = []

    def counting(name: str, real):
        def wrapper(*args, **kwargs):
            result = real(*args, **kwargs)
            taken.append(name)
            if len(taken) == step:
                raise InjectedCrash(f"after step {step} ({name})")
            return result

        return wrapper

    targets = [
        (os, "replace"),
        (os, "fsync"),
        (shutil, "rmtree"),
        (np, "save"),
        (np, "savez"),
        (Path, "mkdir"),
        (Path, "write_text"),
        (Path, "unlink"),
        (Path, "rmdir"),
    ]
    with monkeypatch.context() as patch:
        for owner, name in targets:
            patch.setattr(owner, name, counting(name, getattr(owner, name)))
        yield taken


def persist_crashing_after(monkeypatch: pytest.MonkeyPatch, retriever: BM25Retriever, folder: Path, step: int) -> bool:
    """Persist with a crash after ``step`` changes; returns whether the crash happened."""
    with crash_after_step(monkeypatch, step):
        try:
            retriever.persist(folder)
        except InjectedCrash:
            return True
    return False


def load_without_writing(folder: Path) -> BM25Retriever:
    before = tree(folder)
    loaded = BM25Retriever.load(folder)
    assert tree(folder) == before, "load changed the folder"
    return loaded


# ----- the reproduction: a persist over an earlier one, failing at every step ----------------------


def test_a_persist_failing_at_any_step_keeps_the_earlier_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    old = BM25Retriever.from_nodes(three_nodes(), similarity_top_k=10)
    new = BM25Retriever.from_nodes(five_nodes(), similarity_top_k=10)
    old_sig, new_sig = signature(old), signature(new)
    outcomes: List[str] = []
    step = 0
    while True:
        step += 1
        folder = tmp_path / f"step-{step}"
        foreign = add_foreign_files(folder)
        old.persist(folder)
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            crashed = persist_crashing_after(monkeypatch, new, folder, step)
            if not crashed:
                break  # the persist has fewer steps: every one was covered
            loaded = load_without_writing(folder)
        state = "old" if signature(loaded) == old_sig else "new" if signature(loaded) == new_sig else "other"
        assert state != "other", f"crash after step {step}: the folder loads neither index"
        outcomes.append(state)
        if state == "old" and not (folder / "retriever.json").exists():
            assert "interrupted" in caplog.text
        # The next persist finishes the replacement, whatever the crash left.
        new.persist(folder)
        assert signature(load_without_writing(folder)) == new_sig
        assert tree(folder) == {**foreign, **tree_of_payload(folder)}, "leftovers or foreign files changed"
        assert not (folder / ".previous").exists()
    assert step > 20  # the moves, the payload files, the config, the clean-up
    # Until the new config is in place the earlier index loads; from then on the new one.
    first_new = outcomes.index("new") if "new" in outcomes else len(outcomes)
    assert outcomes == ["old"] * first_new + ["new"] * (len(outcomes) - first_new)
    assert first_new > 10


def tree_of_payload(folder: Path) -> Dict[str, Optional[bytes]]:
    return {k: v for k, v in tree(folder).items() if k.split("/")[0] in PAYLOAD}


def test_crashing_again_while_finishing_an_interrupted_persist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two interruptions in a row (before and after the earlier payload was all set aside): still the earlier index."""
    old = BM25Retriever.from_nodes(three_nodes(), similarity_top_k=10)
    new = BM25Retriever.from_nodes(five_nodes(), similarity_top_k=10)
    old_sig, new_sig = signature(old), signature(new)
    for first in (3, 6, 12, 20, 32, 36):  # among the moves, after the marker, among the new files, after the config
        for second in range(1, 60, 2):
            folder = tmp_path / f"crash-{first}-{second}"
            old.persist(folder)
            assert persist_crashing_after(monkeypatch, new, folder, first)
            crashed = persist_crashing_after(monkeypatch, new, folder, second)
            loaded = signature(load_without_writing(folder))
            assert loaded in (old_sig, new_sig), f"crashes after steps {first} and {second}"
            if not crashed:
                assert loaded == new_sig
                break
            new.persist(folder)
            assert signature(load_without_writing(folder)) == new_sig
            assert sorted(p.name for p in folder.iterdir()) == PAYLOAD


def test_load_reads_an_interrupted_persist_from_a_read_only_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = BM25Retriever.from_nodes(three_nodes(), similarity_top_k=10)
    folder = tmp_path / "idx"
    old.persist(folder)
    assert persist_crashing_after(monkeypatch, BM25Retriever.from_nodes(five_nodes()), folder, 10)
    modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")] if p.is_dir()}
    try:
        for p in modes:
            p.chmod(0o555)
        assert signature(load_without_writing(folder)) == signature(old)
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


def test_a_persist_that_cannot_encode_a_node_changes_nothing(tmp_path: Path) -> None:
    old = BM25Retriever.from_nodes(three_nodes(), similarity_top_k=10)
    old.persist(tmp_path)
    before = tree(tmp_path)
    bad = BM25Retriever.from_nodes([chunk("bad", "lone \ud800 surrogate")])
    with pytest.raises(UnicodeEncodeError):
        bad.persist(tmp_path)
    assert tree(tmp_path) == before


# ----- what persist writes and leaves alone ----------------------------------------------------------


def test_persisting_over_an_earlier_persist_keeps_foreign_files(tmp_path: Path) -> None:
    umask = os.umask(0o027)
    try:
        BM25Retriever.from_nodes(three_nodes()).persist(tmp_path / "fresh")
        BM25Retriever.from_nodes(five_nodes()).persist(tmp_path / "fresh")
    finally:
        os.umask(umask)
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == PAYLOAD  # no .previous, no temporary file
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "fresh").iterdir() if p.is_file()}
    assert set(modes.values()) == {0o640}  # the config too: the umask's permissions, as open() gives
    folder = tmp_path / "storage"
    foreign = add_foreign_files(folder)
    BM25Retriever.from_nodes(three_nodes()).persist(folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted(PAYLOAD + ["docstore.json", "index_store.json", "notes"])
    new = BM25Retriever.from_nodes(five_nodes(), similarity_top_k=10)
    new.persist(folder)
    assert signature(BM25Retriever.load(folder)) == signature(new)
    after = tree(folder)
    assert {k: v for k, v in after.items() if k.split("/")[0] not in PAYLOAD} == foreign
    assert sorted(p.name for p in folder.iterdir()) == sorted(PAYLOAD + ["docstore.json", "index_store.json", "notes"])
    # An index without a bm25s index (no node has a term) drops the earlier bm25s folder.
    BM25Retriever.from_nodes([chunk("x", "the")]).persist(folder)
    assert not (folder / "bm25s").exists() and json.loads((folder / "retriever.json").read_text())["has_bm25_index"] is False
    assert {k: v for k, v in tree(folder).items() if k.split("/")[0] not in PAYLOAD} == foreign


def test_a_previous_folder_holding_foreign_files_is_kept_and_named(tmp_path: Path) -> None:
    BM25Retriever.from_nodes(three_nodes()).persist(tmp_path)
    (tmp_path / ".previous").mkdir()
    (tmp_path / ".previous" / "mine.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"mine\.txt.*did not write"):
        BM25Retriever.from_nodes(five_nodes()).persist(tmp_path)
    assert (tmp_path / ".previous" / "mine.txt").read_text() == "mine"
    assert len(BM25Retriever.load(tmp_path)) == 3


# ----- kill -9 at random moments -------------------------------------------------------------------

KILL_SIZES = (120, 160, 200)  # the states the child cycles through, told apart by their size

CHILD = r"""
import sys
sys.path.append({repo!r})
from tests.retrievers.test_bm25_persist_crash import persist_until_killed
persist_until_killed({folder!r}, {log!r})
"""


def kill_state(size: int) -> BM25Retriever:
    nodes = [
        chunk(f"n{size}-{i}", f"Clause {i} of version {size}: " + " ".join(f"term{(i * 7 + j * size) % 97}" for j in range(40)))
        for i in range(size)
    ]
    return BM25Retriever.from_nodes(nodes, similarity_top_k=5)


def persist_until_killed(folder: str, log: str) -> None:
    """The child: persist the states in turn, logging each one persisted, until killed."""
    states = [kill_state(size) for size in KILL_SIZES]
    print("ready", flush=True)
    i = 1
    while True:
        states[i % len(states)].persist(folder)
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(f"{i}\n")
        i += 1


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_random_kills_leave_the_index_before_or_after_the_persist(tmp_path: Path) -> None:
    rng = random.Random(11)
    signatures = [signature(kill_state(size)) for size in KILL_SIZES]
    interrupted = trials = 0
    while trials < 4 or (interrupted < 2 and trials < 12):
        trials += 1
        folder, log = tmp_path / f"trial-{trials}", tmp_path / f"log-{trials}"
        foreign = add_foreign_files(folder)
        kill_state(KILL_SIZES[0]).persist(folder)
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD.format(repo=str(REPO), folder=str(folder), log=str(log))],
            stdout=subprocess.PIPE,
            cwd=tmp_path,
        )
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            time.sleep(rng.uniform(0.05, 0.5))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()  # type: ignore[union-attr]
        done = [int(line) for line in log.read_text().split()] if log.exists() else []
        last = done[-1] if done else 0
        interrupted += (folder / ".previous").exists()
        loaded = signature(load_without_writing(folder))
        allowed = {last % 3, (last + 1) % 3}  # the last persist logged, or the one in flight
        assert loaded in [signatures[i] for i in allowed], f"trial {trials}: after persist {last}, neither it nor the next loads"
        ours = (*PAYLOAD, ".previous")
        kept = {k: v for k, v in tree(folder).items() if not k.startswith(".retriever.json.") and k.split("/")[0] not in ours}
        assert kept == foreign
        kill_state(KILL_SIZES[1]).persist(folder)  # the next persist finishes the job
        assert signature(load_without_writing(folder)) == signatures[1]
        assert not (folder / ".previous").exists()
    assert interrupted >= 2  # kills landed inside persists, not only between them
