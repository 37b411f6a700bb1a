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
]
