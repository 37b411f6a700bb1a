"""Honest retrieval evaluation: trec_eval-compatible metrics, datasets, chunking-proof labels."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "DatasetFormatError": ".datasets",
    "RetrievalDataset": ".datasets",
    "load_beir": ".datasets",
    "load_jsonl": ".datasets",
    "DEFAULT_KS": ".metrics",
    "METRIC_NAMES": ".metrics",
    "EvalResult": ".metrics",
    "average_precision_at_k": ".metrics",
    "evaluate_run": ".metrics",
    "hit_rate_at_k": ".metrics",
    "ndcg_at_k": ".metrics",
    "precision_at_k": ".metrics",
    "recall_at_k": ".metrics",
    "reciprocal_rank_at_k": ".metrics",
    "chars_at_k": ".relevance",
    "coverage_at_k": ".relevance",
    "doc_level_run": ".relevance",
    "normalize_text": ".relevance",
    "text_match": ".relevance",
    "RETRIEVERS": ".configs",
    "ConfigError": ".configs",
    "EvalConfig": ".configs",
    "load_config_file": ".configs",
    "resolve_config": ".configs",
    "RELEVANCE_MODES": ".relevance",
    "QueryEvaluation": ".evaluate",
    "Retrieval": ".evaluate",
    "RetrieverEvaluation": ".evaluate",
    "UnmatchedReferencesError": ".evaluate",
    "evaluate_retriever": ".evaluate",
    "retrieve_all": ".evaluate",
    "score_retrievals": ".evaluate",
    "EvalJobResult": ".job",
    "load_dataset": ".job",
    "run_eval": ".job",
    "DEFAULT_RAGAS_METRICS": ".ragas_adapter",
    "LLM_FREE_METRICS": ".ragas_adapter",
    "LLM_METRICS": ".ragas_adapter",
    "RAGAS_METRICS": ".ragas_adapter",
    "STRING_SIMILARITIES": ".ragas_adapter",
    "RagasMetricSpec": ".ragas_adapter",
    "RagasReport": ".ragas_adapter",
    "RagasSample": ".ragas_adapter",
    "run_ragas": ".ragas_adapter",
    "run_retriever_for_ragas": ".ragas_adapter",
    "to_ragas_dataset": ".ragas_adapter",
    "to_ragas_samples": ".ragas_adapter",
}

__all__ = [
    "DEFAULT_KS",
    "METRIC_NAMES",
    "EvalResult",
    "evaluate_run",
    "recall_at_k",
    "precision_at_k",
    "reciprocal_rank_at_k",
    "ndcg_at_k",
    "hit_rate_at_k",
    "average_precision_at_k",
    "RetrievalDataset",
    "DatasetFormatError",
    "load_beir",
    "load_jsonl",
    "doc_level_run",
    "text_match",
    "coverage_at_k",
    "chars_at_k",
    "normalize_text",
    "evaluate_retriever",
    "retrieve_all",
    "score_retrievals",
    "Retrieval",
    "QueryEvaluation",
    "RetrieverEvaluation",
    "UnmatchedReferencesError",
    "RELEVANCE_MODES",
    "run_eval",
    "load_dataset",
    "EvalJobResult",
    "EvalConfig",
    "ConfigError",
    "RETRIEVERS",
    "load_config_file",
    "resolve_config",
]

__all__ += [
    "RAGAS_METRICS",
    "DEFAULT_RAGAS_METRICS",
    "LLM_FREE_METRICS",
    "LLM_METRICS",
    "STRING_SIMILARITIES",
    "RagasMetricSpec",
    "RagasReport",
    "RagasSample",
    "to_ragas_samples",
    "to_ragas_dataset",
    "run_retriever_for_ragas",
    "run_ragas",
]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from .datasets import DatasetFormatError, RetrievalDataset, load_beir, load_jsonl
    from .metrics import (
        DEFAULT_KS,
        METRIC_NAMES,
        EvalResult,
        average_precision_at_k,
        evaluate_run,
        hit_rate_at_k,
        ndcg_at_k,
        precision_at_k,
        recall_at_k,
        reciprocal_rank_at_k,
    )
    from .relevance import chars_at_k, coverage_at_k, doc_level_run, normalize_text, text_match
    from .configs import RETRIEVERS, ConfigError, EvalConfig, load_config_file, resolve_config
    from .evaluate import (
        RELEVANCE_MODES,
        QueryEvaluation,
        Retrieval,
        RetrieverEvaluation,
        UnmatchedReferencesError,
        evaluate_retriever,
        retrieve_all,
        score_retrievals,
    )
    from .job import EvalJobResult, load_dataset, run_eval
    from .ragas_adapter import (
        DEFAULT_RAGAS_METRICS,
        LLM_FREE_METRICS,
        LLM_METRICS,
        RAGAS_METRICS,
        STRING_SIMILARITIES,
        RagasMetricSpec,
        RagasReport,
        RagasSample,
        run_ragas,
        run_retriever_for_ragas,
        to_ragas_dataset,
        to_ragas_samples,
    )
