"""Progress on the long index operations: ``HybridIndex.purge`` / ``rkit purge``, the migration of a
folder of the first format (``HybridIndex.load`` / ``rkit migrate``), the roll-back of an unfinished
write on open (``HybridIndex.load``, the ``rkit`` commands that open an index writable) and the HNSW
build (``HybridIndex.optimize``, ``from_documents(build_hnsw=True)``, ``rkit index --hnsw``).

Each takes ``show_progress`` as the package's other long calls do (off by default; the command line
turns it on unless ``-q``): tqdm bars on stderr over the real units (points written, chunks embedded
again), and for a step that is one opaque call (Qdrant Edge's optimize, SQLite's VACUUM) a line
naming it with its elapsed time. Nothing on stdout, nothing at all without ``show_progress``, and the
same results either way. Real Qdrant Edge and the packaged MiniLM on the bundled samples.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sqlite3
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import tqdm.auto  # noqa: F401 - imported before any `rkit -q` below sets TQDM_DISABLE (tqdm reads it once, at import)
from llama_index.core import Document

from llama_index_retrieval_kit.cli import EXIT_OK, main
from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.indices import storage as storage_module  # index.json writes: a full disk
from llama_index_retrieval_kit.indices.hybrid_index import HNSW_STEP, ROLL_BACK_STEP

from .indices import _support

REWRITING = "Purging: rewriting the shard"
CLEANING = "Purging: cleaning the embedding cache"
MIGRATING = "Migrating to Qdrant Edge"
DELETED = "privacy_policy.txt"
QUERIES = 3


def bar_lines(err: str) -> List[str]:
    """The lines tqdm drew on stderr (each redraw starts with a carriage return)."""
    return [line.strip() for line in err.split("\r")[1:] if line.strip()]


def counted(err: str, desc: str) -> List[str]:
    """The ``n/total`` counts of the bar named ``desc``, in the order drawn."""
    return [m.group(1) for line in bar_lines(err) if line.startswith(desc) for m in [re.search(r"\| (\d+/\d+) \[", line)] if m]


def package_bars(err: str) -> List[str]:
    """The lines drawn on stderr, but transformers' own "Loading weights" bar: a real ``rkit -q`` turns
    that off by setting TQDM_DISABLE before tqdm is imported, which in this process happened long before."""
    return [line for line in bar_lines(err) if not line.startswith("Loading weights")]


def results(index: HybridIndex) -> Dict:
    return _support.run_modes(index, _support.query_bundles()[:QUERIES])


@pytest.fixture(scope="module")
def edited(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The samples indexed with the packaged MiniLM, then one document deleted (something to purge)."""
    folder = tmp_path_factory.mktemp("progress") / "index"
    with HybridIndex.from_documents(_support.sample_documents(), folder, embed_model=_support.embed_model()) as index:
        index.delete(DELETED)
    return folder


@pytest.fixture()
def copies(edited: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Two private copies of ``edited``: one run without progress, one with."""
    return shutil.copytree(edited, tmp_path / "quiet"), shutil.copytree(edited, tmp_path / "shown")


def as_format_1(folder: Path, drop_cached: int = 0) -> None:
    """Turn a built folder into one of the first format (Qdrant local mode: format_version 1, no
    ``edge/``; its ``qdrant/`` is never read), its cache missing ``drop_cached`` vectors."""
    manifest = json.loads((folder / "index.json").read_text(encoding="utf-8"))
    manifest["format_version"] = 1
    (folder / "index.json").write_text(json.dumps(manifest), encoding="utf-8")
    shutil.rmtree(folder / "edge")
    (folder / "qdrant").mkdir()
    (folder / "qdrant" / "meta.json").write_text('{"collections": {}, "aliases": {}}', encoding="utf-8")
    if drop_cached:
        with contextlib.closing(sqlite3.connect(folder / "embeddings.sqlite")) as conn, conn:
            conn.execute("DELETE FROM vectors WHERE rowid IN (SELECT rowid FROM vectors ORDER BY key LIMIT ?)", (drop_cached,))


def interrupted_delete(folder: Path) -> List[str]:
    """Leave an unfinished delete in ``folder``'s index.json, as a process killed half-way does: the
    disk refuses every index.json write that would end it (its commit, then its own roll-back's).
    Returns the chunk ids its journal records (the ones an open rolls back)."""
    real = storage_module.write_json_atomic

    def disk_full_when_the_journal_ends(path: Path, data: Dict) -> None:
        if data.get("pending") is None:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    with HybridIndex.load(folder, embed_model=_support.embed_model()) as index, pytest.MonkeyPatch.context() as patch:
        patch.setattr(storage_module, "write_json_atomic", disk_full_when_the_journal_ends)
        with pytest.raises(OSError, match="No space left"):
            index.delete(index.doc_ids()[0])
    return json.loads((folder / "index.json").read_text(encoding="utf-8"))["pending"]["touched_ids"]


def rkit(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str]:
    """stdout and stderr of ``rkit ARGV`` run in this process (exit code checked)."""
    capfd.readouterr()
    code = main(list(argv))
    out, err = capfd.readouterr()
    assert code == EXIT_OK, out + err
    return out, err


@pytest.fixture()
def quiet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rkit -q`` sets TQDM_DISABLE in this process: as it was before, after the test."""
    was = os.environ.get("TQDM_DISABLE")
    monkeypatch.setenv("TQDM_DISABLE", "1")  # recorded: restored (or removed) at teardown
    if was is None:
        monkeypatch.delenv("TQDM_DISABLE")
    else:
        monkeypatch.setenv("TQDM_DISABLE", was)


# ------------------------------------------------------------------------------------- library calls


def quiet_then_shown(copies: tuple[Path, Path], capfd: pytest.CaptureFixture[str], call: Callable[..., Any]) -> tuple[Any, Any, Any, Any, str]:
    """``call(index)`` on the quiet copy (checked silent), then ``call(index, show_progress=True)``
    on the other: ``(want, want_results, got, got_results, stderr)`` (stdout checked empty)."""
    embed_model = _support.embed_model()
    quiet, shown = copies
    capfd.readouterr()
    with HybridIndex.load(quiet, embed_model=embed_model) as index:
        want = call(index)
        assert capfd.readouterr() == ("", "")
        want_results = results(index)
    with HybridIndex.load(shown, embed_model=embed_model) as index:
        got = call(index, show_progress=True)
        out, err = capfd.readouterr()
        got_results = results(index)
    assert out == ""
    return want, want_results, got, got_results, err


def test_purge_shows_its_steps_only_when_asked_and_purges_alike(copies: tuple[Path, Path], capfd: pytest.CaptureFixture[str]) -> None:
    want, want_results, got, got_results, err = quiet_then_shown(copies, capfd, lambda index, **kw: index.purge(**kw))
    points = got["points"]
    assert points > 0 and counted(err, REWRITING)[-1] == f"{points}/{points}"  # the bar counts the points written
    assert any(line.startswith(CLEANING) and re.search(r"\[\d\d:\d\d\]$", line) for line in bar_lines(err))  # the opaque step, timed
    assert "Embedding" not in err  # a purge embeds nothing
    assert {k: v for k, v in got.items() if k != "bytes_freed"} == {k: v for k, v in want.items() if k != "bytes_freed"}
    _support.assert_same_results(got_results, want_results)


def test_optimize_shows_the_hnsw_build_as_one_timed_step(copies: tuple[Path, Path], capfd: pytest.CaptureFixture[str]) -> None:
    want, want_results, got, got_results, err = quiet_then_shown(copies, capfd, lambda index, **kw: index.optimize(**kw))
    assert got == want
    assert bar_lines(err) and all(line.startswith(HNSW_STEP) for line in bar_lines(err))
    assert re.search(r"\[\d\d:\d\d\]$", bar_lines(err)[-1])
    _support.assert_same_results(got_results, want_results)
    with HybridIndex.load(copies[0], embed_model=_support.embed_model()) as index, pytest.raises(TypeError, match="show_progress must be True or False, got 'yes'"):
        index.optimize(show_progress="yes")  # type: ignore[arg-type]


def test_a_build_with_hnsw_shows_the_step_with_show_progress(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    embed_model = _support.embed_model()
    doc = Document(text="Clause 1. The annual fee is 95 dollars.", id_="fees.txt")
    capfd.readouterr()
    HybridIndex.from_documents([doc], tmp_path / "quiet", embed_model=embed_model, build_hnsw=True).close()
    assert capfd.readouterr() == ("", "")
    HybridIndex.from_documents([doc], tmp_path / "shown", embed_model=embed_model, build_hnsw=True, show_progress=True).close()
    out, err = capfd.readouterr()
    assert out == "" and any(line.startswith(HNSW_STEP) for line in bar_lines(err))


def test_migration_shows_the_chunks_embedded_again_and_the_points_written(copies: tuple[Path, Path], capfd: pytest.CaptureFixture[str]) -> None:
    embed_model = _support.embed_model()
    quiet, shown = copies
    for folder in copies:
        as_format_1(folder, drop_cached=2)
    capfd.readouterr()
    with HybridIndex.load(quiet, embed_model=embed_model) as index:
        assert capfd.readouterr() == ("", "")
        want_results, want_len = results(index), len(index)
    with HybridIndex.load(shown, embed_model=embed_model, show_progress=True) as index:
        out, err = capfd.readouterr()
        got_results, got_len = results(index), len(index)
        assert index.manifest.format_version == 2
    assert out == "" and got_len == want_len > 0
    assert counted(err, "Embedding")[-1] == "2/2"  # only the vectors the cache lacked
    assert counted(err, MIGRATING)[-1] == f"{got_len}/{got_len}"
    _support.assert_same_results(got_results, want_results)
    with HybridIndex.load(shown, embed_model=embed_model, show_progress=True):  # migrated: nothing left to show
        assert capfd.readouterr() == ("", "")


def test_an_open_shows_the_roll_back_of_an_unfinished_write_only_when_asked(
    edited: Path, copies: tuple[Path, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A killed upsert or delete (or purge: then every chunk) is rolled back by the next open, which
    rewrites the points it touched: minutes at 100k chunks, shown like the migration's."""
    embed_model = _support.embed_model()
    with HybridIndex.load(shutil.copytree(edited, tmp_path / "committed"), embed_model=embed_model) as committed:
        committed_results, committed_docs = results(committed), committed.doc_ids()
    quiet, shown = copies
    touched = [interrupted_delete(folder) for folder in copies]
    assert touched[0] == touched[1] and len(touched[0]) > 0
    capfd.readouterr()
    with HybridIndex.load(quiet, embed_model=embed_model) as index:
        out, err = capfd.readouterr()
        assert out == "" and bar_lines(err) == []
        assert index.config["pending"] is None
        want_results, want_docs = results(index), index.doc_ids()
    with HybridIndex.load(shown, embed_model=embed_model, show_progress=True) as index:
        out, err = capfd.readouterr()
        assert index.config["pending"] is None
        got_results, got_docs = results(index), index.doc_ids()
    chunks = len(touched[1])
    assert out == "" and counted(err, ROLL_BACK_STEP)[-1] == f"{chunks}/{chunks}"  # every touched chunk rewritten
    assert counted(err, "Embedding") == []  # their vectors came from the embedding cache
    assert got_docs == want_docs == committed_docs
    _support.assert_same_results(got_results, want_results)
    _support.assert_same_results(got_results, committed_results)
    with HybridIndex.load(shown, embed_model=embed_model, show_progress=True):  # rolled back: nothing left to show
        assert capfd.readouterr() == ("", "")


# ------------------------------------------------------------------------------------- command line


def test_rkit_query_shows_the_roll_back_on_open_unless_quiet(copies: tuple[Path, Path], capfd: pytest.CaptureFixture[str], quiet_env: None) -> None:
    quiet, shown = copies
    chunks = [len(interrupted_delete(folder)) for folder in copies]
    out_shown, err = rkit(capfd, "query", "annual fee", "--storage", str(shown), "--json")
    assert counted(err, ROLL_BACK_STEP)[-1] == f"{chunks[1]}/{chunks[1]}"
    out_quiet, err_quiet = rkit(capfd, "-q", "query", "annual fee", "--storage", str(quiet), "--json")
    assert package_bars(err_quiet) == []
    assert json.loads(out_shown) == json.loads(out_quiet)


def test_rkit_purge_shows_bars_unless_quiet(copies: tuple[Path, Path], capfd: pytest.CaptureFixture[str], quiet_env: None) -> None:
    quiet, shown = copies
    out_shown, err = rkit(capfd, "purge", "--storage", str(shown))
    assert counted(err, REWRITING) and any(line.startswith(CLEANING) for line in bar_lines(err))
    out_quiet, err_quiet = rkit(capfd, "purge", "--storage", str(quiet), "-q")
    assert package_bars(err_quiet) == []

    def same(out: str, folder: Path) -> str:
        return re.sub(r"[\d.]+ [KMG]?i?B freed", "N freed", out.replace(str(folder), "DIR"))

    assert same(out_shown, shown) == same(out_quiet, quiet) and "purged DIR" in same(out_shown, shown)


def test_rkit_migrate_shows_bars_unless_quiet(copies: tuple[Path, Path], capfd: pytest.CaptureFixture[str], quiet_env: None) -> None:
    quiet, shown = copies
    for folder in copies:
        as_format_1(folder)
    out_shown, err = rkit(capfd, "migrate", str(shown))
    chunks = int(re.search(r"\((\d+) chunks\)", out_shown).group(1))
    assert counted(err, MIGRATING)[-1] == f"{chunks}/{chunks}"
    out_quiet, err_quiet = rkit(capfd, "-q", "migrate", str(quiet))
    assert package_bars(err_quiet) == []
    assert out_shown.replace(str(shown), "DIR") == out_quiet.replace(str(quiet), "DIR") == f"DIR: migrated to Qdrant Edge ({chunks} chunks)\n"


def test_rkit_index_hnsw_shows_the_step_unless_quiet(tmp_path: Path, capfd: pytest.CaptureFixture[str], quiet_env: None) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "fees.txt").write_text("1. Fees\n\nThe annual fee is 95 dollars, charged on the first statement.", encoding="utf-8")
    (docs / "travel.txt").write_text("1. Travel\n\nEconomy class for flights under six hours.", encoding="utf-8")
    out_shown, err = rkit(capfd, "index", str(docs), "--storage", str(tmp_path / "shown"), "--hnsw")
    assert any(line.startswith(HNSW_STEP) for line in bar_lines(err))
    out_quiet, err_quiet = rkit(capfd, "-q", "index", str(docs), "--storage", str(tmp_path / "quiet"), "--hnsw")
    assert package_bars(err_quiet) == []
    assert out_shown.replace(str(tmp_path / "shown"), "DIR") == out_quiet.replace(str(tmp_path / "quiet"), "DIR")
    assert "'hnsw':" in out_shown
