"""Config-driven pipelines (``llama_index_retrieval_kit.pipeline``) and named components (``components``).

The end-to-end part builds one index from ``examples/pipeline.yaml`` (the bundled samples) in a
temporary folder and runs it through ``build_query_engine`` with LlamaIndex's offline MockLLM,
and through ``rkit index/query/calibrate/eval --config``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from llama_index_retrieval_kit import components
from llama_index_retrieval_kit.cli import EXIT_OK, EXIT_USAGE, main
from llama_index_retrieval_kit.components import (
    ComponentError,
    ComponentKind,
    component_from_dict,
    component_to_dict,
    registered_components,
    resolve_component,
)
from llama_index_retrieval_kit.pipeline import (
    PipelineConfig,
    PipelineConfigError,
    build_index,
    build_postprocessors,
    build_query_engine,
    build_retriever,
    is_pipeline_config,
    to_eval_config,
)
from llama_index_retrieval_kit.samples import QUESTIONS_FILE, SAMPLES_DIR

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "pipeline.yaml"
ANSWERABLE = "How much is the late payment fee?"
NO_ANSWER = "What is the checked baggage allowance on international flights?"
#: What pyproject.toml declares under [project.entry-points."llama_index_retrieval_kit.components"].
OWN_COMPONENTS = {
    "document_folder": "DocumentFolderReader",
    "paged_pdf": "PagedPDFReader",
    "text_file": "TextFileReader",
    "markdown": "MarkdownReader",
    "section_window": "SectionWindowNodeParser",
    "section_hierarchy": "SectionHierarchyNodeParser",
    "no_answer": "NoAnswerPostprocessor",
    "cross_encoder": "CrossEncoderReranker",
    "context_assembler": "ContextAssembler",
}


def _error(data: Any, source: str = "p.yaml") -> PipelineConfigError:
    with pytest.raises(PipelineConfigError) as caught:
        PipelineConfig.from_dict(data, source=source)
    return caught.value


def _example_dict(**sections: Any) -> dict:
    """The example config as data (absolute paths), with sections replaced or removed (None)."""
    data = PipelineConfig.from_yaml(EXAMPLE).to_dict()
    for name, value in sections.items():
        if value is None:
            data.pop(name, None)
        else:
            data[name] = value
    return data


def _write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _rkit(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["-q", *argv])
    return code, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------------------- validation errors
def test_unknown_key_names_the_key_and_the_allowed_keys() -> None:
    err = _error({"retriever": {"top_k": 3}})
    assert err.key == "retriever.top_k"
    message = str(err)
    assert message.startswith("p.yaml: key 'retriever.top_k': unknown key")
    for allowed in ("mode", "similarity_top_k", "candidate_top_k", "weights", "rrf_k"):
        assert allowed in message


def test_unknown_top_level_section_lists_the_sections() -> None:
    err = _error({"embeddings": {"model": "x"}})
    assert err.key == "embeddings"
    assert "allowed keys: version, name, reader, chunking, embedding, index, retriever, no_answer, reranker, context, tracing" in str(err)


@pytest.mark.parametrize(
    ("data", "key", "fragments"),
    [
        ({"retriever": {"mode": "hybird"}}, "retriever.mode", ["'hybird'", "'hybrid'", "'hybrid_rrf'", "'sparse'", "'qdrant_hybrid'"]),
        ({"retriever": {"similarity_top_k": 0}}, "retriever.similarity_top_k", ["greater than or equal to 1", "got 0"]),
        ({"retriever": {"similarity_top_k": "5"}}, "retriever.similarity_top_k", ["valid integer", "got '5'"]),
        ({"retriever": {"weights": [1, 2, 3, 4]}}, "retriever.weights", ["[bm25, dense]", "[bm25, dense, feedback]", "[1, 2, 3, 4]"]),
        ({"retriever": {"mode": "hybrid_rrf", "weights": [1, 2, 3]}}, "retriever.weights", ["mode 'hybrid' only", "[bm25, dense]", "[1, 2, 3]"]),
        ({"reranker": {"backend": "fast"}}, "reranker.backend", ["'fast'", "'flag_embedding'", "'sentence_transformers'"]),
        ({"context": {"max_tokens": 100, "order": "random"}}, "context.order", ["'random'", "'relevance'", "'document'", "'bookends'"]),
        ({"embedding": {"query_backend": "tf"}}, "embedding.query_backend", ["'onnx'", "'torch'", "unknown query backend 'tf'"]),
        ({"index": {"bm25_b": 2}}, "index.bm25_b", ["less than or equal to 1", "got 2"]),
        ({"tracing": {"enabled": "yes"}}, "tracing.enabled", ["valid boolean", "got 'yes'"]),
        ({"chunking": {"chunk_size": 0}}, "chunking.chunk_size", ["greater than 0", "got 0"]),
        ({"version": 2}, "version", ["got 2"]),
    ],
)
def test_bad_value_names_the_key_the_value_and_the_allowed_ones(data: dict, key: str, fragments: list) -> None:
    err = _error(data)
    assert err.key == key
    assert f"key {key!r}" in str(err)
    for fragment in fragments:
        assert fragment in str(err)


def test_a_component_option_typo_is_refused_with_the_component_s_options() -> None:
    err = _error({"chunking": {"component": "section_window", "chunk_sise": 100}})
    assert err.key == "chunking.chunk_sise"
    assert "SectionWindowNodeParser" in str(err)
    assert "chunk_size" in str(err) and "chunk_overlap" in str(err) and "contextual_header" in str(err)


def test_an_option_the_mode_does_not_use_is_refused() -> None:
    err = _error({"retriever": {"mode": "sparse", "candidate_top_k": 50}})
    assert err.key == "retriever.candidate_top_k"
    assert "mode 'sparse' does not use candidate_top_k" in str(err)
    assert "hybrid_rrf" in str(err)
    assert _error({"retriever": {"mode": "hybrid", "rrf_k": 60}}).key == "retriever.rrf_k"
    assert _error({"retriever": {"mode": "qdrant_hybrid", "rrf_k": 60.5}}).key == "retriever.rrf_k"


def test_context_max_chunks_is_refused_with_what_bounds_chunks() -> None:
    err = _error({"context": {"max_tokens": 512, "max_chunks": 5}})
    assert err.key == "context.max_chunks"
    assert "max_tokens" in str(err) and "similarity_top_k" in str(err)


def test_required_component_option_and_gate_source() -> None:
    assert _error({"context": {"order": "relevance"}}).key == "context.max_tokens"
    err = _error({"no_answer": {}})
    assert err.key == "no_answer.gate_path" and "similarity_cutoff" in str(err)
    assert _error({"no_answer": {"similarity_cutoff": 0.2, "threshold": 0.5}}).key == "no_answer.threshold"


def test_bad_filters_are_refused_and_good_ones_reach_the_retriever_options() -> None:
    err = _error({"retriever": {"filters": {"filters": [{"key": "doc_id", "value": "a", "operator": "??"}]}}})
    assert err.key == "retriever.filters"
    config = PipelineConfig.from_dict({"retriever": {"filters": {"filters": [{"key": "doc_id", "value": "terms.md"}]}}})
    filters = config.retriever.as_retriever_kwargs()["filters"]
    assert filters.filters[0].key == "doc_id" and filters.filters[0].value == "terms.md"


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("retriever:\n  mode: hybrid\n  similarity_topk: 3\n", encoding="utf-8")
    with pytest.raises(PipelineConfigError, match=r"bad\.yaml: key 'retriever\.similarity_topk': unknown key"):
        PipelineConfig.from_yaml(path)
    path.write_text("retriever: [\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.yaml: not valid YAML \(line"):
        PipelineConfig.from_yaml(path)


def test_yaml_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "conf"
    folder.mkdir()
    path = folder / "p.yaml"
    path.write_text(
        "reader: {paths: [docs, /abs/file.md]}\nindex: {storage_dir: ../index}\n"
        "no_answer: {gate_path: gate.json}\ntracing: {enabled: true, jsonl_path: t.jsonl}\n",
        encoding="utf-8",
    )
    config = PipelineConfig.from_yaml(path)
    assert config.reader.paths == [str(folder / "docs"), "/abs/file.md"]
    assert config.index.storage_dir == str(tmp_path / "index")
    assert config.no_answer is not None and config.no_answer.gate_path == str(folder / "gate.json")
    assert config.tracing.jsonl_path == str(folder / "t.jsonl")
    assert PipelineConfig.from_dict({"index": {"storage_dir": "rel"}}).index.storage_dir == "rel"  # from_dict: as given


def test_command_line_overrides_are_validated_again() -> None:
    config = PipelineConfig.from_dict({"retriever": {"mode": "hybrid", "candidate_top_k": 50}})
    assert config.with_overrides({"retriever.similarity_top_k": 3, "retriever.mode": None}).retriever.similarity_top_k == 3
    with pytest.raises(PipelineConfigError, match="mode 'sparse' does not use candidate_top_k") as caught:
        config.with_overrides({"retriever.mode": "sparse"}, source="cli")
    assert str(caught.value).startswith("cli: ")


# ----------------------------------------------------------------------------- named components
def test_entry_points_resolve_every_own_component() -> None:
    registered = registered_components()
    for name, class_name in OWN_COMPONENTS.items():
        assert name in registered, f"{name} missing from the entry points: reinstall (pip install -e .)"
        assert resolve_component(name).__name__ == class_name
        assert components.component_name(resolve_component(name)) == name
    assert set(components.names_for("node_parser")) >= {"section_window", "section_hierarchy"}
    assert set(components.names_for(ComponentKind.POSTPROCESSOR)) >= {"no_answer", "cross_encoder", "context_assembler"}


def test_resolving_checks_the_kind_and_lists_the_allowed_names() -> None:
    with pytest.raises(ComponentError, match="unknown component 'nope'; allowed: 'section_hierarchy', 'section_window'"):
        resolve_component("nope", "node_parser", key="chunking.component")
    with pytest.raises(ComponentError, match="is a node postprocessor .* not a node parser"):
        resolve_component("cross_encoder", ComponentKind.NODE_PARSER)
    err = _error({"reranker": {"component": "section_window"}})
    assert err.key == "reranker.component" and "not a node postprocessor" in str(err)
    # a LlamaIndex reader without this package's contract (pages, ids) is not a reader component
    with pytest.raises(ComponentError, match="not a reader"):
        resolve_component("llama_index.core.readers.file.base:SimpleDirectoryReader", "reader")


def test_module_colon_class_names_resolve() -> None:
    from llama_index.core.node_parser import SentenceSplitter

    assert resolve_component("llama_index.core.node_parser:SentenceSplitter", "node_parser") is SentenceSplitter
    config = PipelineConfig.from_dict(
        {"chunking": {"component": "llama_index.core.node_parser:SentenceSplitter", "chunk_size": 128, "chunk_overlap": 16}}
    )
    parser = config.chunking.build()
    assert isinstance(parser, SentenceSplitter) and parser.chunk_size == 128
    assert components.component_name(parser) == f"{SentenceSplitter.__module__}:SentenceSplitter"
    assert resolve_component(components.component_name(parser)) is SentenceSplitter
    with pytest.raises(ComponentError, match="cannot import module 'no_such_module'"):
        resolve_component("no_such_module:Thing")
    with pytest.raises(ComponentError, match="has no 'NoSuchParser'"):
        resolve_component("llama_index.core.node_parser:NoSuchParser")


def _remote_code_model(folder: Path, marker: Path) -> Path:
    """A model folder whose config asks transformers to import its own Python file, which writes ``marker``."""
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["BertForSequenceClassification"],
                "model_type": "markerbert",
                "auto_map": {"AutoConfig": "configuration_marker.MarkerConfig"},
                "num_labels": 1,
            }
        )
    )
    (folder / "configuration_marker.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\n"
        "class MarkerConfig(PretrainedConfig):\n    model_type = 'markerbert'\n"
    )
    return folder


def test_reading_a_config_never_builds_a_third_party_component_nor_runs_model_code(tmp_path: Path, monkeypatch) -> None:
    """LlamaIndex's SentenceTransformerRerank loads its model in __init__ with trust_remote_code=True
    by default: reading a config that names it must not load it, and building it from a config
    must not run the model folder's code unless the config says trust_remote_code: true."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    marker = tmp_path / "ran.txt"
    model = _remote_code_model(tmp_path / "model", marker)
    name = "llama_index.core.postprocessor:SentenceTransformerRerank"
    section = {"component": name, "model": str(model), "top_n": 3}
    config = PipelineConfig.from_dict({"reranker": section})  # checked, not built
    assert not marker.exists()
    # values are still checked, naming the key
    error = _error({"reranker": {**section, "top_n": "three"}})
    assert error.key == "reranker.top_n" and "integer" in str(error)
    # building it refuses the model folder's code: trust_remote_code is False unless the config sets it
    with pytest.raises(ComponentError, match="custom code"):
        config.reranker.build()
    assert not marker.exists()
    # the same through component_from_dict, and an explicit option is kept
    with pytest.raises(ComponentError, match="custom code"):
        component_from_dict(section, "postprocessor")
    assert not marker.exists()
    assert PipelineConfig.from_dict({"reranker": {**section, "trust_remote_code": True}}).reranker.options["trust_remote_code"] is True
    assert not marker.exists()


def test_a_third_party_entry_point_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rkit_plugin_demo.py").write_text(
        textwrap.dedent(
            '''
            from typing import List, Optional
            from llama_index.core.postprocessor.types import BaseNodePostprocessor

            class KeepFirst(BaseNodePostprocessor):
                n: int = 1

                @classmethod
                def class_name(cls) -> str:
                    return "KeepFirst"

                def _postprocess_nodes(self, nodes, query_bundle=None):
                    return list(nodes)[: self.n]
            '''
        ),
        encoding="utf-8",
    )
    dist = tmp_path / "rkit_plugin_demo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rkit-plugin-demo\nVersion: 0.1\n", encoding="utf-8")
    (dist / "entry_points.txt").write_text(
        f"[{components.ENTRY_POINT_GROUP}]\nkeep_first = rkit_plugin_demo:KeepFirst\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    components.refresh()
    try:
        assert registered_components()["keep_first"] == "rkit_plugin_demo:KeepFirst"
        config = PipelineConfig.from_dict({"reranker": {"component": "keep_first", "n": 2}})
        reranker = config.reranker.build()
        assert type(reranker).__name__ == "KeepFirst" and reranker.n == 2
        assert component_to_dict(reranker) == {"component": "keep_first", "n": 2}
        assert _error({"reranker": {"component": "keep_first", "top_n": 2}}).key == "reranker.top_n"
    finally:
        monkeypatch.undo()
        sys.modules.pop("rkit_plugin_demo", None)
        components.refresh()


# ----------------------------------------------------------------------------- serialisation
def _components_to_round_trip(tmp_path: Path) -> list:
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index_retrieval_kit.node_parser import SectionHierarchyNodeParser, SectionWindowNodeParser
    from llama_index_retrieval_kit.postprocessor import ContextAssembler, CrossEncoderReranker, NoAnswerPostprocessor
    from llama_index_retrieval_kit.readers import DocumentFolderReader, MarkdownReader, PagedPDFReader, TextFileReader

    return [
        DocumentFolderReader(recursive=False),
        PagedPDFReader(header_footer_min_share=0.6, dehyphenate=False),
        TextFileReader(encoding="latin-1"),
        MarkdownReader(normalize_whitespace=True),
        SectionWindowNodeParser(chunk_size=128, chunk_overlap=16, heading_patterns=[r"^Clause (?P<number>\d+) (?P<title>.+)$"]),
        SectionHierarchyNodeParser(parent_chunk_size=512, child_chunk_size=64, child_chunk_overlap=8),
        SentenceSplitter(chunk_size=256, chunk_overlap=20),
        ContextAssembler(max_tokens=300, order="relevance", hint_style="full"),
        NoAnswerPostprocessor(similarity_cutoff=0.25, no_answer_text="Not in the documents."),
        NoAnswerPostprocessor(
            feature_set="score", feature_names=_score_features(), coefficients=[0.5] * len(_score_features()),
            intercept=-0.3, feature_means=[0.1] * len(_score_features()), feature_scales=[1.0] * len(_score_features()),
            threshold=0.4, fit_report={"auroc": 0.9},
        ),
        CrossEncoderReranker(model="cross-encoder/ms-marco-MiniLM-L6-v2", backend="sentence_transformers", top_n=3, batch_size=8),
    ]


def _score_features() -> list:
    from llama_index_retrieval_kit.postprocessor.no_answer import FeatureSet, feature_names

    return feature_names(FeatureSet.SCORE)


def test_every_component_round_trips_to_dict_and_from_dict(tmp_path: Path) -> None:
    for component in _components_to_round_trip(tmp_path):
        cls = type(component)
        if cls.__module__.startswith("llama_index_retrieval_kit."):  # LlamaIndex's own serialisation
            assert cls.from_dict(component.to_dict()).to_dict() == component.to_dict(), cls.__name__
        else:  # LlamaIndex's parsers fail their own round trip on id_func; the registry's leaves it out
            with pytest.raises(ValueError, match="id_func"):
                cls.from_dict(component.to_dict())
        # the registry's: a JSON-ready {"component": name, **options}
        data = component_to_dict(component)
        assert json.loads(json.dumps(data)) == data, cls.__name__
        rebuilt = component_from_dict(json.loads(json.dumps(data)))
        assert type(rebuilt) is cls
        assert rebuilt.to_dict() == component.to_dict(), cls.__name__


def test_a_retriever_is_not_a_component() -> None:
    from llama_index_retrieval_kit.retrievers import BM25Retriever

    with pytest.raises(TypeError, match="retriever bound to an open index and cannot be serialised.*PipelineConfig"):
        component_to_dict(BM25Retriever([]))


def test_the_config_round_trips_through_dict_and_yaml(tmp_path: Path) -> None:
    config = PipelineConfig.from_dict(
        {
            "name": "all-stages",
            "chunking": {"component": "section_hierarchy", "child_chunk_size": 64},
            "index": {"storage_dir": str(tmp_path / "index"), "bm25_k1": 1.5},
            "retriever": {"mode": "hybrid_rrf", "rrf_k": 30, "weights": [1.0, 2.0], "similarity_top_k": 8},
            "no_answer": {"gate_path": str(tmp_path / "gate.json"), "threshold": 0.3},
            "reranker": {"model": "cross-encoder/ms-marco-MiniLM-L6-v2", "backend": "sentence_transformers", "max_candidates": None},
            "context": {"max_tokens": 256, "order": "document", "enabled": False},
            "tracing": {"enabled": True, "jsonl_path": str(tmp_path / "t.jsonl")},
        }
    )
    assert PipelineConfig.from_dict(config.to_dict()) == config
    assert PipelineConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    path = tmp_path / "round.yaml"
    config.to_yaml(path)
    assert PipelineConfig.from_yaml(path) == config
    assert config.reranker is not None and config.reranker.options["max_candidates"] is None  # None survives (score all)
    assert not config.stage_enabled("context") and config.stage_enabled("reranker") and config.stage_enabled("tracing")
    example = PipelineConfig.from_yaml(EXAMPLE)
    assert PipelineConfig.from_dict(example.to_dict()) == example


# ----------------------------------------------------------------------------- precision stage order
def _save_gate(path: Path, feature_set: str) -> Path:
    from llama_index_retrieval_kit.postprocessor.no_answer import FeatureSet, NoAnswerPostprocessor, feature_names

    names = feature_names(FeatureSet.from_str(feature_set))
    gate = NoAnswerPostprocessor(
        feature_set=feature_set, feature_names=names, coefficients=[0.1] * len(names), feature_means=[0.0] * len(names),
        feature_scales=[1.0] * len(names), threshold=0.5,
    )
    return gate.save(path)


def test_the_gate_runs_before_the_reranker_unless_calibrated_after_it(tmp_path: Path) -> None:
    reranker = {"model": "cross-encoder/ms-marco-MiniLM-L6-v2", "backend": "sentence_transformers", "top_n": 3}
    legs_gate = _save_gate(tmp_path / "legs.json", "legs")
    config = PipelineConfig.from_dict(
        {"no_answer": {"gate_path": str(legs_gate)}, "reranker": reranker, "context": {"max_tokens": 200}}
    )
    assert [type(p).__name__ for p in build_postprocessors(config)] == ["NoAnswerPostprocessor", "CrossEncoderReranker", "ContextAssembler"]

    rerank_gate = _save_gate(tmp_path / "rerank.json", "rerank")
    config = PipelineConfig.from_dict({"no_answer": {"gate_path": str(rerank_gate), "threshold": 0.2}, "reranker": reranker})
    stages = build_postprocessors(config)
    assert [type(p).__name__ for p in stages] == ["CrossEncoderReranker", "NoAnswerPostprocessor"]
    assert stages[1].threshold == 0.2  # the config's override of the calibrated threshold

    with pytest.raises(PipelineConfigError, match="calibrated on reranked results, but the config has no reranker"):
        build_postprocessors(PipelineConfig.from_dict({"no_answer": {"gate_path": str(rerank_gate)}}))
    with pytest.raises(PipelineConfigError, match="no gate file at .*rkit calibrate --config"):
        build_postprocessors(PipelineConfig.from_dict({"no_answer": {"gate_path": str(tmp_path / "missing.json")}}))
    disabled = PipelineConfig.from_dict({"no_answer": {"gate_path": str(tmp_path / "missing.json"), "enabled": False}})
    assert build_postprocessors(disabled) == []


# ----------------------------------------------------------------------------- rkit eval
def test_eval_reads_a_pipeline_config(tmp_path: Path) -> None:
    from llama_index_retrieval_kit.evaluation.configs import load_config_file, resolve_config

    eval_config = resolve_config(str(EXAMPLE))
    assert (eval_config.name, eval_config.retriever, eval_config.node_parser) == ("samples-hybrid", "hybrid", "SectionWindowNodeParser")
    assert eval_config.parser_args == {"chunk_size": 200, "chunk_overlap": 40}
    assert eval_config.similarity_top_k == 5
    assert [p["component"] for p in eval_config.postprocessors] == ["context_assembler"]
    assert eval_config.to_dict()["postprocessors"][0]["max_tokens"] == 1024
    assert [type(p).__name__ for p in eval_config.make_postprocessors()] == ["ContextAssembler"]
    assert is_pipeline_config(yaml.safe_load(EXAMPLE.read_text())) and not is_pipeline_config({"retriever": "hybrid"})

    sparse = to_eval_config(PipelineConfig.from_dict({"retriever": {"mode": "sparse"}, "index": {"bm25_k1": 1.5}}), default_name="s")
    assert (sparse.name, sparse.retriever, sparse.bm25_k1, sparse.postprocessors) == ("s", "bm25", 1.5, ())

    traced = _write_config(tmp_path / "traced.yaml", _example_dict(tracing={"enabled": True}))
    with pytest.raises(PipelineConfigError, match=r"traced\.yaml: key 'tracing\.enabled': .*rkit eval cannot honour it"):
        load_config_file(traced)
    pdf_only = _write_config(tmp_path / "pdf.yaml", _example_dict(reader={"component": "paged_pdf"}))
    with pytest.raises(PipelineConfigError, match="key 'reader'"):
        load_config_file(pdf_only)


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> PipelineConfig:
    """The example pipeline with its index in a temporary folder (built once, closed)."""
    folder = tmp_path_factory.mktemp("pipeline")
    config = PipelineConfig.from_yaml(EXAMPLE).with_overrides({"index.storage_dir": str(folder / "index")})
    assert config.reader.paths == [str(SAMPLES_DIR / name) for name in ("credit_card_terms.md", "product_manual.md", "privacy_policy.txt")]
    with build_index(config) as index:
        assert len(index) > 20
        assert sorted(index.doc_ids()) == ["credit_card_terms.md", "privacy_policy.txt", "product_manual.md"]
    return config


def test_example_pipeline_answers_end_to_end_with_a_mock_llm(built: PipelineConfig, tmp_path: Path) -> None:
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.llms import MockLLM
    from llama_index.core.query_engine import RetrieverQueryEngine

    config = built.with_overrides({"tracing.enabled": True, "tracing.jsonl_path": str(tmp_path / "traces.jsonl")})
    with build_query_engine(config, llm=MockLLM(max_tokens=8)) as engine:
        assert isinstance(engine, RetrieverQueryEngine)
        response = engine.query(ANSWERABLE)
        assert str(response).strip()  # the mock LLM's text
        sources = response.source_nodes
        assert 1 <= len(sources) <= config.retriever.similarity_top_k
        assert any("Late Payment Fee" in n.node.get_content() for n in sources)
        assert all(n.node.metadata.get("citation") for n in sources)  # assembled context spans with their hints
        trace = response.metadata["trace"]
        assert [s["name"] for s in trace["stages"]] == ["bm25", "dense", "feedback", "fusion", "context"]
        assert len(engine.tracer.traces) == 1
        assert all(h is not engine.tracer for h in get_dispatcher().event_handlers)  # listens only during a query
        with pytest.raises(TypeError, match="cannot be serialised: serialise its config"):
            engine.retriever.to_dict()
        with pytest.raises(TypeError, match="cannot be serialised"):
            engine.to_dict()
    lines = (tmp_path / "traces.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["query_str"] == ANSWERABLE
    with pytest.raises(ValueError, match="needs an LLM"):
        build_query_engine(config)


def test_an_index_built_otherwise_is_refused(built: PipelineConfig) -> None:
    changed = built.with_overrides({"chunking.chunk_size": 128, "index.bm25_k1": 0.9})
    with pytest.raises(ValueError, match=r"chunking\.chunk_size: built with 200, the config says 128; index\.bm25_k1: built with 1\.2") as caught:
        build_retriever(changed)
    assert "--rebuild" in str(caught.value)
    with build_retriever(built) as retriever:  # the index was closed again: it opens
        assert [r.node.metadata["doc_id"] for r in retriever.retrieve(ANSWERABLE)][0] == "credit_card_terms.md"


def test_setting_filters_on_a_pipeline_retriever_filters_every_query(built: PipelineConfig) -> None:
    """``retriever.filters = ...`` on build_retriever's retriever was stored on the wrapper and
    ignored by the index retriever inside: every document came back (a leak)."""
    from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters

    only = MetadataFilters(filters=[MetadataFilter(key="doc_id", value="privacy_policy.txt")])
    with build_retriever(built) as retriever:
        assert {r.node.metadata["doc_id"] for r in retriever.retrieve(ANSWERABLE)} != {"privacy_policy.txt"}
        retriever.filters = only
        assert retriever.filters is only and retriever.inner.filters is only
        assert {r.node.metadata["doc_id"] for r in retriever.retrieve(ANSWERABLE)} == {"privacy_policy.txt"}
        retriever.filters = None
        assert {r.node.metadata["doc_id"] for r in retriever.retrieve(ANSWERABLE)} != {"privacy_policy.txt"}


def test_three_weights_set_the_hybrid_feedback_leg(built: PipelineConfig) -> None:
    def ranked(config: PipelineConfig) -> list:
        with build_retriever(config) as retriever:
            return [(r.node.node_id, round(float(r.score), 9)) for r in retriever.retrieve(ANSWERABLE)]

    default = ranked(built)
    assert ranked(built.with_overrides({"retriever.weights": [0.3, 0.3, 0.4]})) == default  # the default's weights
    bm25_only = ranked(built.with_overrides({"retriever.weights": [1.0, 0.0, 0.0]}))
    assert bm25_only != default


def test_rkit_index_query_calibrate_with_config(built: PipelineConfig, tmp_path: Path) -> None:
    gate = tmp_path / "gate.json"
    data = built.to_dict()
    data["no_answer"] = {"gate_path": str(gate)}
    config_file = _write_config(tmp_path / "pipeline.yaml", data)

    code, out, err = _rkit("index", "--config", str(config_file))  # reader.paths into the existing index: updated in place
    assert code == EXIT_OK, err
    assert "indexed {'documents': 3" in out

    code, out, err = _rkit("index", "--config", str(config_file), "--chunk-size", "100")  # explicit option overrides the config
    assert code == EXIT_USAGE
    assert "chunking.chunk_size: built with 200, the config says 100" in err

    code, out, err = _rkit("calibrate", "--config", str(config_file), "--dataset", str(QUESTIONS_FILE))  # --out: no_answer.gate_path
    assert code == EXIT_OK, err
    fitted = json.loads(gate.read_text())["fit_report"]
    assert fitted["retriever"]["mode"] == "hybrid" and fitted["retriever"]["similarity_top_k"] == 5
    assert f"{config_file} uses it" in out

    code, out, err = _rkit("query", NO_ANSWER, "--config", str(config_file), "--json")
    assert code == EXIT_OK, err
    payload = json.loads(out)
    assert payload["gate"]["abstained"] is True and payload["results"] == []
    assert payload["gate"]["path"] == str(gate)

    code, out, err = _rkit("query", ANSWERABLE, "--config", str(config_file), "--json", "-k", "3", "--trace")
    assert code == EXIT_OK, err
    payload = json.loads(out)
    assert (payload["mode"], payload["top_k"]) == ("hybrid", 3)
    assert payload["gate"]["abstained"] is False
    assert "Late Payment Fee" in payload["results"][0]["text"]
    assert [s["name"] for s in payload["traces"][0]["stages"]][-2:] == ["no_answer", "context"]

    code, out, err = _rkit("query", ANSWERABLE, "--config", str(config_file), "--mode", "sparse", "--json")
    assert code == EXIT_USAGE  # --mode overrides the config, but this gate reads the fused legs: refused, not misread
    assert "key 'no_answer.gate_path'" in err and "retriever.mode 'sparse'" in err and "(hybrid)" in err
    no_gate = _write_config(tmp_path / "no_gate.yaml", {**data, "no_answer": {"gate_path": str(gate), "enabled": False}})
    code, out, err = _rkit("query", ANSWERABLE, "--config", str(no_gate), "--mode", "sparse", "--json")
    assert code == EXIT_OK, err
    payload = json.loads(out)
    assert payload["mode"] == "sparse" and "gate" not in payload

    bad = _write_config(tmp_path / "bad.yaml", {**data, "retriever": {"mode": "hybrid", "topk": 3}})
    code, out, err = _rkit("query", ANSWERABLE, "--config", str(bad))
    assert code == EXIT_USAGE
    assert "bad.yaml: key 'retriever.topk': unknown key" in err and "similarity_top_k" in err


def test_rkit_eval_with_a_pipeline_config(built: PipelineConfig, tmp_path: Path) -> None:
    cache = Path(built.index.storage_dir) / "embeddings.sqlite"  # the vectors are already computed
    code, out, err = _rkit(
        "eval", "--dataset", str(QUESTIONS_FILE), "--config", "bm25", "--config", str(EXAMPLE),
        "--out", str(tmp_path / "eval"), "--ks", "1,5", "--embedding-cache", str(cache),
    )
    assert code == EXIT_OK, err
    assert "samples-hybrid" in out
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    settings = {c["name"]: c["settings"] for c in metrics["configs"]}
    assert settings["samples-hybrid"]["postprocessors"][0]["component"] == "context_assembler"
    assert settings["samples-hybrid"]["similarity_top_k"] == 5


def test_a_reranker_from_the_config_reranks_and_its_gate_is_calibrated_after_it(built: PipelineConfig, tmp_path: Path) -> None:
    from llama_index.core.llms import MockLLM

    from llama_index_retrieval_kit.postprocessor import RerankedNodeWithScore

    from .postprocessor._cross_encoder_folder import build_tiny_cross_encoder

    model = build_tiny_cross_encoder(tmp_path / "tiny-cross-encoder")
    gate = tmp_path / "reranked-gate.json"
    data = built.to_dict()
    data["reranker"] = {"model": str(model), "backend": "sentence_transformers", "top_n": 2, "batch_size": 4, "device": "cpu", "max_length": 128}
    data["no_answer"] = {"gate_path": str(gate)}
    data["context"] = {"max_tokens": 400, "enabled": False}
    config_file = _write_config(tmp_path / "reranked.yaml", data)

    code, out, err = _rkit("calibrate", "--config", str(config_file), "--dataset", str(QUESTIONS_FILE), "--no-exclude-relevant")
    assert code == EXIT_OK, err
    assert "after the reranker" in out
    saved = json.loads(gate.read_text())
    assert saved["feature_set"] == "rerank" and saved["fit_report"]["reranker"]["model"] == str(model)

    config = PipelineConfig.from_yaml(config_file)
    assert [type(p).__name__ for p in build_postprocessors(config)] == ["CrossEncoderReranker", "NoAnswerPostprocessor"]
    ungated = config.with_overrides({"no_answer.enabled": False})
    with build_query_engine(ungated, llm=MockLLM(max_tokens=4)) as engine:
        sources = engine.query(ANSWERABLE).source_nodes
    assert len(sources) == 2  # reranker.top_n
    assert all(isinstance(n, RerankedNodeWithScore) and 0.0 < n.score < 1.0 for n in sources)
    assert [n.pre_rerank_rank for n in sources] != [] and all(n.leg_ranks for n in sources)


def test_the_reader_section_reads_the_files(tmp_path: Path) -> None:
    from llama_index_retrieval_kit.pipeline import read_pipeline_documents
    from llama_index_retrieval_kit.readers import DocumentReadError

    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "top.md").write_text("# Fees\nThe annual fee is $95.\n", encoding="utf-8")
    (docs / "sub" / "deep.txt").write_text("A deeper file.\n", encoding="utf-8")
    flat = PipelineConfig.from_dict({"reader": {"recursive": False, "paths": [str(docs)]}})
    documents, failures = read_pipeline_documents(flat)
    assert [d.id_ for d in documents] == ["top.md"] and failures == []
    deep, _ = read_pipeline_documents(PipelineConfig.from_dict({"reader": {"paths": [str(docs)]}}))
    assert sorted(d.id_ for d in deep) == ["sub/deep.txt", "top.md"]

    pdf_reader = PipelineConfig.from_dict({"reader": {"component": "paged_pdf"}, "index": {"storage_dir": str(tmp_path / "index")}})
    documents, failures = read_pipeline_documents(pdf_reader, [docs / "top.md"])
    assert documents == [] and "top.md" in str(failures[0])
    with pytest.raises(DocumentReadError, match="top.md"):  # nothing is indexed when a file cannot be read
        build_index(pdf_reader, [docs / "top.md"])
    assert not (tmp_path / "index").exists()
    with pytest.raises(PipelineConfigError, match="key 'reader.paths': no files to read"):
        read_pipeline_documents(PipelineConfig.from_dict({}))



def test_build_hnsw_in_the_config_runs_the_engine_optimisers_after_a_build_and_an_update(tmp_path, monkeypatch) -> None:
    from llama_index.core import Document
    from llama_index.core.embeddings import MockEmbedding

    from llama_index_retrieval_kit.indices.store import EdgePoints
    from llama_index_retrieval_kit.pipeline import PipelineConfig, build_index

    runs = []
    real = EdgePoints.optimize
    monkeypatch.setattr(EdgePoints, "optimize", lambda self: runs.append(self.path.name) or real(self))
    model = MockEmbedding(embed_dim=8)
    for build_hnsw in (False, True):
        runs.clear()
        config = PipelineConfig.model_validate({"index": {"storage_dir": str(tmp_path / f"index-{build_hnsw}"), "build_hnsw": build_hnsw}})
        with build_index(config, [Document(id_=f"d{i}", text=f"clause {i} about fees") for i in range(3)], embed_model=model):
            pass
        with build_index(config, [Document(id_="d9", text="a new clause")], embed_model=model) as index:
            assert len(index) == 4
        assert len(runs) == (2 if build_hnsw else 0)  # after the build and after the update
    with pytest.raises(Exception, match="build_hnsw"):
        PipelineConfig.model_validate({"index": {"storage_dir": "x", "build_hnsw": "sometimes"}})


def test_a_config_shares_nothing_with_the_data_it_was_read_from() -> None:
    """A caller reusing its filter template per tenant: each validated config keeps the filters
    it was built with, and a later edit of the caller's data never reaches it (nor breaks it)."""
    template = {"filters": [{"key": "tenant", "value": None, "operator": "=="}]}
    configs = {}
    for tenant in ("A", "B"):
        template["filters"][0]["value"] = tenant
        configs[tenant] = PipelineConfig.from_dict(
            {"index": {"storage_dir": "ix"}, "retriever": {"mode": "sparse", "filters": template}}
        )
    template["filters"][0]["operator"] = "not-an-operator"
    for tenant, config in configs.items():
        assert config.retriever.as_retriever_kwargs()["filters"].filters[0].value == tenant
    # the section built directly keeps its own copy too
    direct_filters = {"filters": [{"key": "tenant", "value": "A"}]}
    from llama_index_retrieval_kit.pipeline import RetrieverConfig

    section = RetrieverConfig(mode="sparse", filters=direct_filters)
    direct_filters["filters"][0]["value"] = "B"
    assert section.filters == {"filters": [{"key": "tenant", "value": "A"}]}
