"""Postprocessors of the precision stage: the no-answer gate and cross-encoder reranking."""

from .no_answer import NoAnswerPostprocessor

__all__ = ["NoAnswerPostprocessor"]
