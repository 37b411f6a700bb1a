"""Lazy package exports (PEP 562): ``import llama_index_retrieval_kit`` loads no heavy library.

A package lists ``name -> submodule`` and gets a module ``__getattr__`` that imports the
submodule on first use (and caches the attribute), so ``from llama_index_retrieval_kit import
HybridIndex`` works as before while ``import llama_index_retrieval_kit`` or ``rkit --help`` never
import torch, sentence-transformers, ragas or LlamaIndex.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, MutableMapping, Tuple


def lazy_exports(namespace: MutableMapping[str, Any], exports: Dict[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for the package whose globals are ``namespace``.

    ``exports`` maps each public name to the relative submodule defining it (``".bm25"``).
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> List[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
