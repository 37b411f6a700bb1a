"""_files: user-visible files are replaced whole or not at all, never through a fixed temp name."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from llama_index_retrieval_kit._files import atomic_writer, write_bytes_atomic, write_text_atomic


def test_a_failed_write_leaves_the_earlier_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "gate.json"
    write_text_atomic(path, "old")
    with pytest.raises(RuntimeError, match="disk gone"):
        with atomic_writer(path) as fh:
            fh.write("half of the new")
            raise RuntimeError("disk gone")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate.json"]


def test_a_symlink_at_the_target_or_at_the_old_temp_name_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "chunks.jsonl.tmp").symlink_to(victim)  # the fixed name earlier versions staged through
    write_text_atomic(tmp_path / "chunks.jsonl", "chunks")
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    write_text_atomic(link, "new")
    assert victim.read_text() == "keep me"
    assert (tmp_path / "chunks.jsonl").read_text() == "chunks"
    assert not link.is_symlink() and link.read_text() == "new"


def test_the_mode_of_the_replaced_file_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    write_bytes_atomic(path, b"a: 1\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    os.chmod(path, 0o600)
    write_text_atomic(path, "a: 2\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "a: 2\n"
    with pytest.raises(ValueError, match="mode must be"):
        with atomic_writer(path, "a"):
            pass


def test_writers_of_the_package_stage_through_fresh_names(tmp_path: Path) -> None:
    """The gate file, chunk JSONL and config YAML: a planted `<name>.tmp` symlink is left alone."""
    from llama_index.core.schema import TextNode

    from llama_index_retrieval_kit.ingest import write_chunks_jsonl
    from llama_index_retrieval_kit.pipeline import PipelineConfig
    from llama_index_retrieval_kit.postprocessor.no_answer import NoAnswerPostprocessor

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for name in ("gate.json.tmp", "chunks.jsonl.tmp", "p.yaml.tmp"):
        (tmp_path / name).symlink_to(victim)
    NoAnswerPostprocessor(similarity_cutoff=0.2).save(tmp_path / "gate.json")
    write_chunks_jsonl([TextNode(id_="a", text="fee")], tmp_path / "chunks.jsonl")
    PipelineConfig.from_dict({}).to_yaml(tmp_path / "p.yaml")
    assert victim.read_text() == "keep me"
    assert NoAnswerPostprocessor.load(tmp_path / "gate.json").similarity_cutoff == 0.2
    assert PipelineConfig.from_yaml(tmp_path / "p.yaml") == PipelineConfig.from_dict({})
