"""Runtime state of LlamaIndex components (locks, context variables, caches built on first use)
kept out of pickles and deep copies: a copy starts that state afresh, so a component that has
served queries copies and pickles like a new one (``copy.deepcopy`` of a lock raises otherwise,
and LlamaIndex's ``BaseComponent`` pickling logs a warning for each such attribute)."""

from __future__ import annotations

import contextvars
import copy
import logging
import pickle
from typing import Any, ClassVar, Dict, Optional, Tuple

from llama_index.core.bridge.pydantic import BaseModel

logger = logging.getLogger(__name__)


class TransientState:
    """Mixin for pydantic LlamaIndex components (put it before ``BaseComponent`` in the bases).

    ``__transient_private__``: private attributes that are per-object runtime state (locks, context
    variables, caches); pickles leave them out and a deep copy starts them from their defaults.
    ``__reloaded_private__``: state loaded on first use (a model); a deep copy shares it (it is
    only read, or guards itself), a pickle leaves it out (the copy loads it again when used).
    ``__shared_private__``: shared by a deep copy, pickled as it is (a tokenizer callable). Every
    other private attribute and every field is deep-copied and pickled as LlamaIndex's
    ``BaseComponent`` does (which drops, with a warning, whatever cannot be pickled).
    """

    __transient_private__: ClassVar[Tuple[str, ...]] = ()
    __reloaded_private__: ClassVar[Tuple[str, ...]] = ()
    __shared_private__: ClassVar[Tuple[str, ...]] = ()

    def __getstate__(self) -> Dict[str, Any]:
        state = BaseModel.__getstate__(self)  # type: ignore[arg-type]
        left_out = (*self.__transient_private__, *self.__reloaded_private__)
        private = {k: v for k, v in (state.get("__pydantic_private__") or {}).items() if k not in left_out}
        state["__pydantic_private__"] = private
        for part in ("__dict__", "__pydantic_private__"):  # as BaseComponent.__getstate__ does
            for key in [k for k, v in state[part].items() if not _picklable(v)]:
                logger.warning("Removing unpickleable %sattribute %s", "private " if part != "__dict__" else "", key)
                del state[part][key]
        return state

    def __deepcopy__(self, memo: Optional[Dict[int, Any]] = None) -> Any:
        memo = {} if memo is None else memo
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        object.__setattr__(new, "__dict__", copy.deepcopy(self.__dict__, memo))
        object.__setattr__(new, "__pydantic_extra__", copy.deepcopy(self.__pydantic_extra__, memo))  # type: ignore[attr-defined]
        object.__setattr__(new, "__pydantic_fields_set__", copy.copy(self.__pydantic_fields_set__))  # type: ignore[attr-defined]
        declared = cls.__private_attributes__  # type: ignore[attr-defined]
        private: Dict[str, Any] = {}
        for name, value in (self.__pydantic_private__ or {}).items():  # type: ignore[attr-defined]
            if name in self.__transient_private__:
                private[name] = declared[name].get_default(call_default_factory=True)
            elif name in self.__reloaded_private__ or name in self.__shared_private__:
                private[name] = value
            else:
                private[name] = copy.deepcopy(value, memo)
        object.__setattr__(new, "__pydantic_private__", private)
        return new


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


class LastValue:
    """The last value set in each thread or asyncio task (a ``ContextVar``), falling back to the
    last one set anywhere: a component serving concurrent queries (``query`` in a thread pool,
    ``asyncio.gather`` of ``aquery``) keeps each caller's last result apart."""

    def __init__(self, name: str) -> None:
        self._own: contextvars.ContextVar[Any] = contextvars.ContextVar(name, default=None)
        self._anywhere: Any = None

    def set(self, value: Any) -> None:
        self._anywhere = value
        self._own.set(value)

    def get(self) -> Any:
        own = self._own.get()
        return own if own is not None else self._anywhere
