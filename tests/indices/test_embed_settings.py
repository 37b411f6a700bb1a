"""The embedding model's document-vector settings in ``index.json`` (``embed_settings``).

A model of the index's name with another ``max_length`` or ``normalize`` makes other document
vectors: ``HybridIndex.load`` (and ``upsert``) must refuse it, naming both configurations, instead
of embedding queries otherwise and mixing two kinds of vectors in one index. Real MiniLM, real
Qdrant Edge folders in ``tmp_path``, a corpus of three short documents.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
from llama_index.core import Document, Settings
from llama_index.core.schema import MetadataMode

from llama_index_retrieval_kit.indices import HybridIndex, IndexManifest, storage
from llama_index_retrieval_kit.indices.hybrid_index import EmbedSettingsMismatchError
from llama_index_retrieval_kit.indices.manifest import embed_settings_of
from llama_index_retrieval_kit.indices.storage import DamagedIndexError
from llama_index_retrieval_kit.models import default_embed_model, document_vector_settings, packaged_minilm_path

SHORT = {"max_length": 16}  # cuts the documents below: other vectors than the model as it comes
TOPICS = {
    "fees.txt": "Late fees: an invoice paid after thirty days costs a late fee of five percent of the amount due, "
    "charged once per month until the invoice is paid in full by the customer.",
    "garden.txt": "Tomato plants need six hours of sun, deep watering twice a week and a stake to climb; prune the "
    "side shoots so that the plant puts its energy into the fruit rather than the leaves.",
    "rockets.txt": "A rocket engine burns fuel with an oxidiser and throws the exhaust backwards; by Newton's third "
    "law the rocket is pushed forwards, also in the vacuum of space where there is no air to push against.",
}


def documents() -> List[Document]:
    return [Document(text=text, id_=name, metadata={"file_name": name}) for name, text in TOPICS.items()]


@pytest.fixture(scope="module")
def short_model() -> Any:
    """The packaged MiniLM as LlamaIndex's HuggingFaceEmbedding, cut to 16 tokens."""
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=str(packaged_minilm_path()), **SHORT)


@pytest.fixture(scope="module")
def fast_short_model() -> Any:
    """The same configuration as this package's FastHuggingFaceEmbedding (same document vectors)."""
    return default_embed_model(**SHORT)


@pytest.fixture(scope="module")
def short_folder(tmp_path_factory: pytest.TempPathFactory, short_model: Any) -> Path:
    """An index built with ``short_model`` (closed); tests that write copy it."""
    path = tmp_path_factory.mktemp("embed_settings") / "short"
    HybridIndex.from_documents(documents(), path, embed_model=short_model).close()
    return path


@pytest.fixture(scope="module")
def default_folder(tmp_path_factory: pytest.TempPathFactory, embed_model: Any) -> Path:
    """An index built with the packaged model as it comes (closed)."""
    path = tmp_path_factory.mktemp("embed_settings") / "default"
    HybridIndex.from_documents(documents(), path, embed_model=embed_model).close()
    return path


def manifest_json(folder: Path) -> Dict[str, Any]:
    return json.loads((folder / storage.MANIFEST).read_text(encoding="utf-8"))


def top_doc(index: HybridIndex, question: str) -> str:
    return index.as_retriever("dense", similarity_top_k=1).retrieve(question)[0].node.ref_doc_id


# ---------------------------------------------------------------------------------- recording


def test_the_build_records_the_models_document_vector_settings(short_folder: Path, default_folder: Path, short_model: Any) -> None:
    assert document_vector_settings(short_model) == SHORT
    assert manifest_json(short_folder)["embed_settings"] == SHORT
    assert manifest_json(default_folder)["embed_settings"] == {}  # recorded: "as it comes" is checked too


def test_the_manifest_json_round_trips_the_settings(tmp_path: Path, default_folder: Path) -> None:
    data = manifest_json(default_folder)
    path = tmp_path / "index.json"
    for value in ({"max_length": 64, "normalize": False, "text_instruction": "passage: "}, {}):
        manifest = IndexManifest.from_json(dict(data, embed_settings=value), path)
        assert manifest.embed_settings == value and manifest.to_json()["embed_settings"] == value
        manifest.write(path)
        assert IndexManifest.read(path).embed_settings == value
    old = {k: v for k, v in data.items() if k != "embed_settings"}
    manifest = IndexManifest.from_json(copy.deepcopy(old), path)
    assert manifest.embed_settings is None and manifest.to_json() == old  # omitted when None: old readers see their keys
    assert manifest.embed_settings_match({"max_length": 16})  # nothing recorded: nothing checked


@pytest.mark.parametrize("value", [5, "max_length=16", [16], True])
def test_a_bad_recorded_value_is_a_damaged_index_error_naming_the_key(tmp_path: Path, default_folder: Path, value: Any) -> None:
    data = dict(manifest_json(default_folder), embed_settings=value)
    path = tmp_path / "index.json"
    with pytest.raises(DamagedIndexError) as expected:
        storage.validate_manifest(copy.deepcopy(data), path, (2,))
    with pytest.raises(DamagedIndexError) as got:
        IndexManifest.from_json(data, path)
    assert str(got.value) == str(expected.value) and "embed_settings" in str(got.value) and str(path) in str(got.value)


def test_embed_settings_of_is_the_models_document_vector_settings(embed_model: Any) -> None:
    from llama_index.core.embeddings import MockEmbedding

    assert embed_settings_of(embed_model) == {}
    assert embed_settings_of(MockEmbedding(embed_dim=8)) == {"embed_dim": 8}
    assert embed_settings_of(default_embed_model(normalize=False)) == {"normalize": False}


# ---------------------------------------------------------------------------------- load


def test_loading_with_another_configuration_names_both_and_what_to_do(short_folder: Path, embed_model: Any) -> None:
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    unnormalised = HuggingFaceEmbedding(model_name=str(packaged_minilm_path()), normalize=False)
    cases = [(None, {}, "the default model"), (embed_model, {}, "the given embed_model"), (unnormalised, {"normalize": False}, "the given embed_model")]
    for given, settings, source in cases:
        for read_only in (False, True):
            with pytest.raises(EmbedSettingsMismatchError) as err:
                HybridIndex.load(short_folder, embed_model=given, read_only=read_only)
            msg = str(err.value)
            assert str(short_folder) in msg and f"{source} has {settings!r}" in msg
            assert "document-vector settings {'max_length': 16}" in msg
            assert "embed_model=llama_index_retrieval_kit.models.default_embed_model(max_length=16)" in msg
            assert "overwrite=True" in msg and "--rebuild" in msg
            assert (err.value.recorded, err.value.given) == (SHORT, settings)
    assert manifest_json(short_folder)["embed_settings"] == SHORT  # a refused open writes nothing


def test_the_model_as_it_comes_is_refused_for_an_index_of_another_configuration_too(default_folder: Path, short_model: Any) -> None:
    with pytest.raises(EmbedSettingsMismatchError) as err:
        HybridIndex.load(default_folder, embed_model=short_model)
    assert "settings {} (the model used as it comes)" in str(err.value) and "has {'max_length': 16}" in str(err.value)
    assert "default_embed_model()" in str(err.value)
    with HybridIndex.load(default_folder) as index:  # the default load keeps working
        assert document_vector_settings(index.embed_model) == {}
        assert top_doc(index, "what does paying an invoice late cost?") == "fees.txt"


def test_the_same_configuration_loads_retrieves_and_upserts(
    short_folder: Path, tmp_path: Path, short_model: Any, fast_short_model: Any
) -> None:
    import shutil

    folder = shutil.copytree(short_folder, tmp_path / "short")
    for model in (short_model, fast_short_model):  # two classes of the same document vectors
        with HybridIndex.load(folder, embed_model=model) as index:
            assert top_doc(index, "how should I water tomato plants?") == "garden.txt"
    with HybridIndex.load(folder, embed_model=short_model) as index:
        index.upsert([Document(text="Bees carry pollen between flowers and make honey from nectar in the hive.", id_="bees.txt")])
        assert top_doc(index, "which insects make honey?") == "bees.txt"
        stored = index.dense_matrix()  # the new vectors are the recorded configuration's
        row = [n.ref_doc_id for n in stored.nodes].index("bees.txt")
        text = stored.nodes[row].get_content(metadata_mode=MetadataMode.EMBED)
        expected = np.asarray(short_model.get_text_embedding(text), dtype=np.float32)
        got = np.asarray(stored.vectors[row], dtype=np.float32)
        assert float(got @ expected / (np.linalg.norm(got) * np.linalg.norm(expected))) > 0.999
    assert manifest_json(folder)["embed_settings"] == SHORT


def test_upsert_refuses_a_model_replaced_after_load(short_folder: Path, tmp_path: Path, embed_model: Any, fast_short_model: Any) -> None:
    import shutil

    folder = shutil.copytree(short_folder, tmp_path / "short")
    with HybridIndex.load(folder, embed_model=fast_short_model) as index:
        before = manifest_json(folder)
        index.embed_model = embed_model
        with pytest.raises(EmbedSettingsMismatchError, match=r"index.embed_model has \{\}"):
            index.upsert([Document(text="Something new about bees.", id_="bees.txt")])
        assert manifest_json(folder) == before and "bees.txt" not in index.doc_ids()


def test_settings_embed_model_is_used_only_when_it_matches(short_folder: Path, default_folder: Path, short_model: Any) -> None:
    """As for a model of another name: a Settings.embed_model of other settings is passed over
    for the default model, which opens an index of the model as it comes and is refused otherwise."""
    Settings.embed_model = short_model
    try:
        with HybridIndex.load(short_folder, read_only=True) as index:
            assert index.embed_model is short_model
        with HybridIndex.load(default_folder, read_only=True) as index:
            assert index.embed_model is not short_model and document_vector_settings(index.embed_model) == {}
    finally:
        Settings._embed_model = None
    Settings.embed_model = default_embed_model(normalize=False)
    try:
        with pytest.raises(EmbedSettingsMismatchError, match="the default model used as it comes .Settings.embed_model was not used"):
            HybridIndex.load(short_folder, read_only=True)
    finally:
        Settings._embed_model = None


# ---------------------------------------------------------------------------------- older folders


def test_a_folder_written_before_settings_were_recorded_opens_unchecked_and_stays_so(
    default_folder: Path, tmp_path: Path, short_model: Any, embed_model: Any
) -> None:
    import shutil

    folder = shutil.copytree(default_folder, tmp_path / "old")
    old = {k: v for k, v in manifest_json(folder).items() if k != "embed_settings"}
    (folder / storage.MANIFEST).write_text(json.dumps(old, indent=2), encoding="utf-8")
    with HybridIndex.load(folder, embed_model=short_model, read_only=True) as index:  # not checked, as before
        assert index.manifest.embed_settings is None
    with HybridIndex.load(folder, embed_model=embed_model) as index:
        assert top_doc(index, "why does a rocket move in space?") == "rockets.txt"
        index.upsert([Document(text="Bees carry pollen between flowers and make honey.", id_="bees.txt")])
    assert "embed_settings" not in manifest_json(folder)  # an open never records the opener's settings


def test_rkit_query_names_the_recorded_settings_and_the_rebuild(short_folder: Path, capsys: pytest.CaptureFixture) -> None:
    from llama_index_retrieval_kit.cli import EXIT_USAGE, main

    assert main(["query", "--storage", str(short_folder), "late fee"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"rkit: error: {short_folder} was built with") and err.count("\n") == 1
    assert "settings {'max_length': 16}, but the default model has {}" in err and "rkit index ... --rebuild" in err
