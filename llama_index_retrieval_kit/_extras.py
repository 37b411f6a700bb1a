"""Optional extras: one check, one message, for every feature that needs one.

The core install (``pip install llama-index-retrieval-kit``) carries what retrieval needs:
readers, chunking, ``HybridIndex`` on Qdrant Edge, the retrievers, the no-answer gate, the
sentence-transformers reranker, context assembly, tracing and the retrieval metrics. The rest is
an extra (``pyproject.toml``):

======== ============================================================================
extra    what it adds
======== ============================================================================
eval     ``rkit eval`` / ``rkit demo`` reports (scipy tests, matplotlib plots), RAGAS
samples  writing the bundled agreement as a PDF (fpdf2): ``rkit demo``, ``sample_pdf``
onnx     ONNX Runtime for the query embedder and ``CrossEncoderReranker(onnx=True)``
rerank   the FlagEmbedding reranker backend (bge-reranker), LlamaIndex's FlagEmbedding reranker
bench    the comparison systems of ``benchmarks/`` and ``rkit eval --config llamaindex-bm25``
all      every extra; ``dev`` is ``all`` plus the test tools
======== ============================================================================

A feature that needs a missing extra raises :class:`MissingExtraError` (an ``ImportError``) with
one line naming the extra and the command that installs it; ``rkit`` turns it into exit code 2.
The checks use ``importlib.util.find_spec``, so checking imports nothing heavy.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Mapping, Sequence, Union

DISTRIBUTION = "llama-index-retrieval-kit"

#: The modules each extra provides (for messages and tests; pyproject.toml is the source of truth
#: for what gets installed).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "eval": ("ragas", "scipy", "matplotlib"),
    "samples": ("fpdf",),
    "onnx": ("onnx", "onnxruntime"),
    "rerank": ("FlagEmbedding", "llama_index.postprocessor.flag_embedding_reranker"),
    "bench": ("llama_index.retrievers.bm25", "psutil"),
}

#: What the evaluation report (``rkit eval``, ``run_eval``) imports: significance tests and plots.
REPORT_MODULES = ("scipy", "matplotlib")

#: Import name -> the package to install, where they differ (for the message).
_PACKAGE_OF = {
    "fpdf": "fpdf2",
    "llama_index.retrievers.bm25": "llama-index-retrievers-bm25",
    "llama_index.postprocessor.flag_embedding_reranker": "llama-index-postprocessor-flag-embedding-reranker",
}

Modules = Union[str, Sequence[str]]


class MissingExtraError(ImportError):
    """A feature needs an optional extra that is not installed; the message says what to install."""

    def __init__(self, message: str, extras: Sequence[str] = (), missing: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.extras = tuple(extras)
        self.missing = tuple(missing)


def install_command(*extras: str) -> str:
    """``pip install 'llama-index-retrieval-kit[eval]'`` (several extras: ``[samples,eval]``)."""
    return f"pip install '{DISTRIBUTION}[{','.join(extras)}]'"


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it; a ``None`` in sys.modules counts as absent)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing or broken
        return False


def _names(modules: Modules) -> tuple[str, ...]:
    return (modules,) if isinstance(modules, str) else tuple(modules)


def missing_extra_error(feature: str, needs: Mapping[str, Modules], hint: str = "") -> MissingExtraError | None:
    """The error for ``feature`` when a module of ``needs`` (extra -> modules) is missing, else None."""
    missing: dict[str, list[str]] = {}
    for extra, modules in needs.items():
        absent = [m for m in _names(modules) if not is_installed(m)]
        if absent:
            missing[extra] = absent
    if not missing:
        return None
    extras = list(missing)
    packages = [_PACKAGE_OF.get(m, m) for absent in missing.values() for m in absent]
    quoted = " and ".join(f"'{e}'" for e in extras)
    noun = "extra" if len(extras) == 1 else "extras"
    message = f"{feature} needs the {quoted} {noun}: {install_command(*extras)} (not installed: {', '.join(packages)})"
    if hint:
        message += f"; {hint}"
    return MissingExtraError(message, extras, packages)


def require_extras(feature: str, needs: Mapping[str, Modules], hint: str = "") -> None:
    """Raise :class:`MissingExtraError` naming every extra of ``needs`` with a missing module."""
    error = missing_extra_error(feature, needs, hint)
    if error is not None:
        raise error


def require_extra(extra: str, modules: Modules, feature: str, hint: str = "") -> None:
    """Raise :class:`MissingExtraError` unless every module in ``modules`` (provided by ``extra``) is installed.

    ``feature`` starts the message: ``"rkit eval needs the 'eval' extra: pip install
    'llama-index-retrieval-kit[eval]' (not installed: scipy)"``; ``hint`` is appended.
    """
    require_extras(feature, {extra: modules}, hint)


def import_extra(extra: str, module: str, feature: str, hint: str = "") -> ModuleType:
    """``import module`` for ``feature``, or :class:`MissingExtraError` naming ``extra`` when it is absent.

    A module that is installed but fails to import (a broken install) raises its own error.
    """
    require_extra(extra, module, feature, hint)
    return importlib.import_module(module)
