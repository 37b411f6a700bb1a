"""``rkit delete`` and what ``rkit index`` does about indexed documents whose files were deleted
(listed with the command that removes them; deleted with ``--prune``), on real files and a real index."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llama_index_retrieval_kit.cli import EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, file_is_gone, main, vanished_documents
from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.samples.pdf_writer import write_pdf

CONTRACT = "Acme supply contract. The zorblattine clause: the supplier pays a penalty of 9 percent per late week."
POLICY = "Gamma travel policy. Employees book economy class for flights shorter than six hours."
SHIPPING = "Shipping schedule. Containers leave the Rotterdam port every Tuesday at noon."
OLD_NOTE = "Old note. The Lisbon office closes in August for the summer holidays."
REPORT_BLOCKS = [("h1", "1. Audit"), ("p", "The audit found the warehouse inventory records complete and accurate. " * 3)]


def _run(*argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``rkit -q ARGV``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["-q", *argv])
    return code, out.getvalue(), err.getvalue()


def _doc_ids(storage: Path) -> list[str]:
    with HybridIndex.load(storage) as index:
        return index.doc_ids()


def _retrieved_doc_ids(storage: Path, question: str) -> list[str]:
    code, out, err = _run("query", question, "--storage", str(storage), "-k", "10", "--json")
    assert code == EXIT_OK, err
    return [r["doc_id"] for r in json.loads(out)["results"]]


@pytest.fixture()
def indexed(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(docs folder, other folder, index): docs/ holds a contract, a policy and a PDF report; other/
    a shipping schedule and an old note; both folders indexed into one index."""
    docs, other = tmp_path / "docs", tmp_path / "other"
    docs.mkdir()
    other.mkdir()
    (docs / "acme_contract.txt").write_text(CONTRACT, encoding="utf-8")
    (docs / "gamma_policy.txt").write_text(POLICY, encoding="utf-8")
    write_pdf(REPORT_BLOCKS, docs / "report.pdf", title="Report")
    (other / "shipping.txt").write_text(SHIPPING, encoding="utf-8")
    (other / "old_note.txt").write_text(OLD_NOTE, encoding="utf-8")
    storage = tmp_path / "index"
    for folder in (docs, other):
        code, out, err = _run("index", str(folder), "--storage", str(storage))
        assert code == EXIT_OK, out + err
    assert _doc_ids(storage) == ["acme_contract.txt", "gamma_policy.txt", "old_note.txt", "report.pdf", "shipping.txt"]
    return docs, other, storage


# ----------------------------------------------------------------------------- rkit delete
def test_delete_by_id_removes_the_document_from_queries(indexed: tuple[Path, Path, Path]) -> None:
    _, _, storage = indexed
    assert "acme_contract.txt" in _retrieved_doc_ids(storage, "What does the zorblattine clause say?")
    with HybridIndex.load(storage) as index:
        chunks_before = len(index)
    code, out, err = _run("delete", "--storage", str(storage), "acme_contract.txt")
    assert code == EXIT_OK, err
    assert f"deleted 1 document(s) (1 chunks) from {storage}: acme_contract.txt; {chunks_before - 1} chunks remain" in out
    assert _doc_ids(storage) == ["gamma_policy.txt", "old_note.txt", "report.pdf", "shipping.txt"]
    retrieved = _retrieved_doc_ids(storage, "What does the zorblattine clause say?")
    assert "acme_contract.txt" not in retrieved and retrieved  # the others still answer


def test_an_unknown_id_is_refused_and_nothing_is_deleted(indexed: tuple[Path, Path, Path]) -> None:
    docs, _, storage = indexed
    code, out, err = _run("delete", "--storage", str(storage), "acme_contract.txt", "acme.txt", str(docs / "gamma_policy.txt"))
    assert code == EXIT_USAGE and out == ""
    assert f"2 id(s) not in {storage}, nothing deleted: 'acme.txt', '{docs / 'gamma_policy.txt'}'" in err
    assert "'acme.txt': did you mean 'acme_contract.txt'?" in err
    assert f"'{docs / 'gamma_policy.txt'}' is the file of document 'gamma_policy.txt'" in err
    assert "holds 5: acme_contract.txt, gamma_policy.txt, old_note.txt, report.pdf, shipping.txt" in err
    assert len(_doc_ids(storage)) == 5  # the known id was not deleted either

    code, out, err = _run("delete", "--storage", str(storage), "acme_contract.txt", "acme.txt", "--missing-ok")
    assert code == EXIT_OK, err
    assert f"not in {storage}, skipped (--missing-ok): acme.txt" in out
    assert "deleted 1 document(s)" in out
    assert "acme_contract.txt" not in _doc_ids(storage)


def test_delete_needs_an_index(tmp_path: Path) -> None:
    code, _, err = _run("delete", "--storage", str(tmp_path / "nothing"), "a.txt")
    assert code == EXIT_USAGE and "holds no index" in err
    code, _, err = _run("delete", "a.txt")
    assert code == EXIT_USAGE and "--storage is required" in err


def test_delete_with_a_config(indexed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, _, storage = indexed
    config = tmp_path / "pipeline.yaml"
    config.write_text(f"index: {{storage_dir: {storage}}}\n", encoding="utf-8")
    code, out, err = _run("delete", "--config", str(config), "old_note.txt", "shipping.txt")
    assert code == EXIT_OK, err
    assert "deleted 2 document(s) (2 chunks)" in out
    assert _doc_ids(storage) == ["acme_contract.txt", "gamma_policy.txt", "report.pdf"]


# ----------------------------------------------------------------------------- rkit index on deleted files
def test_reindex_after_a_file_is_removed_warns_and_names_the_command(indexed: tuple[Path, Path, Path]) -> None:
    docs, _, storage = indexed
    (docs / "acme_contract.txt").unlink()  # the contract is withdrawn
    code, out, err = _run("index", str(docs), "--storage", str(storage))
    assert code == EXIT_OK, err
    assert f"warning: 1 indexed document(s) came from files that no longer exist under {docs}" in out
    assert f"  - acme_contract.txt (was {docs / 'acme_contract.txt'})\n" in out
    command = f"rkit delete --storage {shlex.quote(str(storage))} acme_contract.txt"
    assert f"remove them with: {command}\n" in out and "--prune" in out
    assert "acme_contract.txt" in _doc_ids(storage)  # listed, never deleted without --prune

    code, out, err = _run(*shlex.split(command)[1:])  # the printed command works as printed
    assert code == EXIT_OK, err
    assert "acme_contract.txt" not in _doc_ids(storage)
    code, out, _ = _run("index", str(docs), "--storage", str(storage))
    assert code == EXIT_OK and "warning" not in out


def test_prune_removes_exactly_the_vanished_documents(indexed: tuple[Path, Path, Path]) -> None:
    """Only documents of deleted files under the folder given go: not one from another folder
    (even one whose file was deleted too), not one whose file exists but can no longer be read."""
    docs, other, storage = indexed
    (docs / "acme_contract.txt").unlink()
    (other / "old_note.txt").unlink()  # also gone, but other/ is not given: untouched
    (docs / "report.pdf").write_bytes(b"%PDF-1.4\nthis file was damaged\n")  # exists, unreadable
    code, out, err = _run("index", str(docs), "--storage", str(storage), "--prune")
    assert code == EXIT_PARTIAL, out + err  # partial: report.pdf could not be read
    assert f"could not read {docs / 'report.pdf'}" in out
    assert f"pruned 1 document(s) (1 chunks) whose files no longer exist under {docs}: acme_contract.txt\n" in out
    assert _doc_ids(storage) == ["gamma_policy.txt", "old_note.txt", "report.pdf", "shipping.txt"]
    assert "acme_contract.txt" not in _retrieved_doc_ids(storage, "What does the zorblattine clause say?")


def test_prune_never_empties_the_index_of_a_folder_that_holds_nothing(indexed: tuple[Path, Path, Path]) -> None:
    """An emptied folder looks like an unmounted share's mount point: its documents are listed with
    the command that removes them, and --prune refuses to delete them (nothing indexed is lost to
    a drive that did not mount); rkit delete removes them when that was meant."""
    _, other, storage = indexed
    for f in other.iterdir():
        f.unlink()
    code, out, _ = _run("index", str(other), "--storage", str(storage))
    assert code == EXIT_PARTIAL and "nothing to index" in out
    assert "warning: 2 indexed document(s)" in out and "rkit delete --storage" in out and "old_note.txt shipping.txt" in out
    assert len(_doc_ids(storage)) == 5
    code, out, _ = _run("index", str(other), "--storage", str(storage), "--prune")
    assert "not pruning" in out and "holds no files at all" in out and "rkit delete --storage" in out
    assert len(_doc_ids(storage)) == 5
    code, out, _ = _run("delete", "--storage", str(storage), "old_note.txt", "shipping.txt")
    assert code == EXIT_OK, out
    assert _doc_ids(storage) == ["acme_contract.txt", "gamma_policy.txt", "report.pdf"]


def test_prune_with_only_files_given_says_there_is_nothing_to_prune(indexed: tuple[Path, Path, Path]) -> None:
    docs, _, storage = indexed
    code, out, err = _run("index", str(docs / "gamma_policy.txt"), "--storage", str(storage), "--prune")
    assert code == EXIT_OK, err
    assert "--prune: nothing to prune, no folder was given" in out
    assert len(_doc_ids(storage)) == 5


def test_index_with_a_config_names_the_config_in_the_delete_command(indexed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    docs, _, storage = indexed
    config = tmp_path / "pipeline.yaml"
    config.write_text(f"reader: {{component: document_folder, paths: [{docs}]}}\nindex: {{storage_dir: {storage}}}\n", encoding="utf-8")
    (docs / "gamma_policy.txt").unlink()
    code, out, err = _run("index", "--config", str(config))
    assert code == EXIT_OK, err
    assert f"remove them with: rkit delete --config {shlex.quote(str(config))} gamma_policy.txt\n" in out
    code, out, err = _run("index", "--config", str(config), "--prune")
    assert code == EXIT_OK, err
    assert "pruned 1 document(s)" in out and "gamma_policy.txt" not in _doc_ids(storage)


# ----------------------------------------------------------------------------- the pure parts
SEGMENTS = st.sampled_from(["a", "b", "ab", "docs", "docs2", "x.txt"])
PATHS = st.lists(SEGMENTS, min_size=1, max_size=4).map(lambda parts: str(PurePosixPath("/", *parts)))


@given(
    origins=st.dictionaries(st.text(min_size=1, max_size=5), st.one_of(st.none(), PATHS), max_size=8),
    folders=st.lists(PATHS, max_size=3),
    gone=st.sets(PATHS),
    keep=st.sets(st.text(min_size=1, max_size=5), max_size=3),
)
def test_vanished_documents_lists_only_gone_files_under_the_folders(
    origins: dict[str, str | None], folders: list[str], gone: set[str], keep: set[str]
) -> None:
    folder_paths = [Path(f) for f in folders]
    listed = vanished_documents(origins, folder_paths, is_gone=gone.__contains__, keep=keep)
    assert listed == sorted(listed)
    for doc_id, origin in origins.items():
        under = origin is not None and any(origin == f or origin.startswith(f.rstrip("/") + "/") for f in folders)
        assert (doc_id in listed) == (under and origin in gone and doc_id not in keep)


def test_a_folder_name_prefix_is_not_a_parent() -> None:
    origins = {"a": "/data/docs2/a.txt", "b": "/data/docs/b.txt"}
    assert vanished_documents(origins, [Path("/data/docs")], is_gone=lambda _: True) == ["b"]


def test_file_is_gone(tmp_path: Path) -> None:
    present = tmp_path / "present.txt"
    present.write_text("here", encoding="utf-8")
    assert not file_is_gone(present)
    assert file_is_gone(tmp_path / "deleted.txt")
    assert file_is_gone(present / "child.txt")  # a folder on the way is now a file


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), OSError(5, "Input/output error"), TimeoutError()])
def test_a_file_that_cannot_be_checked_is_not_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: OSError) -> None:
    """Only "no such file" means gone: a permission error, an I/O error or a share that does not
    answer never lets --prune delete a document whose file may still be there."""
    target = tmp_path / "file.txt"

    def failing_stat(path, *args, **kwargs):
        raise error

    monkeypatch.setattr(os, "stat", failing_stat)
    assert not file_is_gone(target)


def test_delete_help_loads_nothing_heavy() -> None:
    code = (
        "import sys\nfrom llama_index_retrieval_kit.cli import main\ntry:\n    main(['delete', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('loaded:' + ','.join(m for m in ('torch', 'transformers', 'llama_index.core', 'qdrant_client') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "loaded:"
