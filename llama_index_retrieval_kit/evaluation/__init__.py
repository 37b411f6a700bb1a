"""Honest retrieval evaluation: trec_eval-compatible metrics, datasets, chunking-proof labels."""

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

# RAGAS glue (ragas itself is imported lazily, inside the functions).
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
