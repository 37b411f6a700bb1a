"""``retriever.dense_search`` and ``embedding.query_backend`` are ChoiceEnums defined once: configs
take the same strings as before (and the members), write the same strings, and refuse a bad value
naming it and the allowed ones, with the message ``HybridIndex.as_retriever`` gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llama_index_retrieval_kit._enums import ChoiceEnum, DenseSearch, QueryBackend
from llama_index_retrieval_kit.pipeline import PipelineConfig, PipelineConfigError


def _error(data: dict) -> PipelineConfigError:
    with pytest.raises(PipelineConfigError) as caught:
        PipelineConfig.from_dict(data, source="p.yaml")
    return caught.value


def test_both_kinds_are_choice_enums_with_today_s_strings() -> None:
    assert issubclass(QueryBackend, ChoiceEnum) and issubclass(DenseSearch, ChoiceEnum)
    assert [m.value for m in QueryBackend] == ["onnx", "torch"]
    assert [m.value for m in DenseSearch] == ["auto", "memory", "qdrant"]
    assert QueryBackend.from_str("torch") is QueryBackend.TORCH and QueryBackend.TORCH == "torch"


@pytest.mark.parametrize(
    ("data", "key", "message"),
    [
        ({"embedding": {"query_backend": "tf"}}, "embedding.query_backend", "unknown query backend 'tf'; allowed: 'onnx', 'torch'"),
        ({"embedding": {"query_backend": "ONNX"}}, "embedding.query_backend", "unknown query backend 'ONNX'; allowed: 'onnx', 'torch'"),
        ({"embedding": {"query_backend": 1}}, "embedding.query_backend", "unknown query backend 1; allowed: 'onnx', 'torch'"),
        ({"retriever": {"dense_search": "faiss"}}, "retriever.dense_search", "unknown dense search 'faiss'; allowed: 'auto', 'memory', 'qdrant'"),
        ({"retriever": {"dense_search": True}}, "retriever.dense_search", "unknown dense search True; allowed: 'auto', 'memory', 'qdrant'"),
    ],
)
def test_a_bad_value_is_refused_naming_it_and_the_allowed_ones(data: dict, key: str, message: str) -> None:
    err = _error(data)
    assert err.key == key
    assert str(err) == f"p.yaml: key {key!r}: {message}"


def test_the_config_refuses_a_dense_search_as_the_index_does() -> None:
    """One message for one mistake, whether it comes from a config or from as_retriever's keyword."""
    with pytest.raises(ValueError) as direct:
        DenseSearch.from_str("faiss")
    assert str(direct.value) in str(_error({"retriever": {"dense_search": "faiss"}}))


@pytest.mark.parametrize("backend", [QueryBackend.ONNX, QueryBackend.TORCH, "onnx", "torch"])
@pytest.mark.parametrize("dense", [DenseSearch.AUTO, DenseSearch.MEMORY, DenseSearch.QDRANT, "auto", "memory", "qdrant", None])
def test_strings_and_members_are_taken_and_written_as_the_same_strings(backend: Any, dense: Any, tmp_path: Path) -> None:
    config = PipelineConfig.from_dict({"embedding": {"query_backend": backend}, "retriever": {"dense_search": dense}})
    assert type(config.embedding.query_backend) is str and config.embedding.query_backend == str(QueryBackend.from_str(backend).value)
    written = config.to_dict()
    assert written["embedding"]["query_backend"] == config.embedding.query_backend
    assert written["retriever"]["dense_search"] == (None if dense is None else DenseSearch.from_str(dense).value)
    if dense is not None:
        assert config.retriever.as_retriever_kwargs()["dense_search"] == DenseSearch.from_str(dense).value
    path = tmp_path / "p.yaml"
    config.to_yaml(path)
    text = path.read_text(encoding="utf-8")
    assert f"query_backend: {config.embedding.query_backend}\n" in text  # a plain YAML string, no enum tag
    assert "!!" not in text
    assert PipelineConfig.from_yaml(path) == config


def test_the_defaults_are_unchanged() -> None:
    config = PipelineConfig.from_dict({})
    assert config.embedding.query_backend == "onnx" and config.retriever.dense_search is None
    assert "dense_search" not in config.retriever.as_retriever_kwargs()


def test_an_existing_yaml_config_reads_as_before(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "embedding: {query_backend: torch}\nretriever: {mode: dense, dense_search: memory}\n", encoding="utf-8"
    )
    config = PipelineConfig.from_yaml(path)
    assert (config.embedding.query_backend, config.retriever.mode, config.retriever.dense_search) == ("torch", "dense", "memory")
    assert _error({"retriever": {"mode": "sparse", "dense_search": "memory"}}).key == "retriever.dense_search"  # still mode-checked
