"""A serialisable name for a ``tokenizer=`` callable, so that what it measures survives
``to_dict()``/``from_dict()``, pickling and cache hashes instead of silently reverting to the default.

Names: ``tiktoken:<encoding>`` for tiktoken's ``encode`` (bound, or wrapped in ``functools.partial``
as LlamaIndex's ``get_tokenizer()`` does), else ``custom:<module>.<qualname>`` (a lambda also gets a
fingerprint of its code; a partial, its arguments; a Hugging Face tokenizer object, its
``name_or_path``; any other object holding state - a callable instance, or the owner of a bound
method such as ``AutoTokenizer.from_pretrained(...).encode`` - its ``name_or_path`` else a digest
of its pickled state, so two tokenizers of one class with different settings get different names
and an ``IngestionCache`` never returns one's chunks for the other). ``None`` means no callable:
the Hugging Face ``tokenizer_name`` counts.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import pickle
import re
from typing import Any, Callable, Dict, Optional, Sequence

logger = logging.getLogger(__name__)

TokenizerFn = Callable[[str], Sequence]


def tokenizer_label(tokenizer: TokenizerFn) -> str:
    """The name recorded for a ``tokenizer`` callable (see the module docstring)."""
    fn: Any = tokenizer
    bound_args = ""
    while isinstance(fn, functools.partial):
        bound_args += repr((fn.args, sorted(fn.keywords.items())))
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    encoding = getattr(owner, "name", None)
    if owner is not None and type(owner).__module__.partition(".")[0] == "tiktoken" and isinstance(encoding, str):
        return f"tiktoken:{encoding}"
    objclass = getattr(fn, "__objclass__", None)  # str.split and other method descriptors
    module = getattr(fn, "__module__", None) or getattr(objclass, "__module__", None) or type(fn).__module__
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    label = f"custom:{module}.{qualname}"
    code = getattr(fn, "__code__", None)
    if code is not None and "<lambda>" in qualname:
        digest = hashlib.sha256(code.co_code + repr(code.co_consts).encode() + repr(code.co_names).encode())
        label += f"#{digest.hexdigest()[:10]}"
    label += state_fingerprint(fn)
    if bound_args:
        label += f"#{hashlib.sha256(bound_args.encode()).hexdigest()[:10]}"
    return label


def state_holder(fn: Any) -> Any:
    """The object whose state decides what ``fn`` measures: the instance of a bound method, the
    callable object itself; None for plain functions, builtins, classes and module functions."""
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        return None if inspect.ismodule(owner) or inspect.isclass(owner) else owner
    if inspect.isroutine(fn) or inspect.isclass(fn):
        return None
    return fn


def state_fingerprint(fn: Any) -> str:
    """``[name_or_path]`` of a Hugging Face tokenizer (or the owner of its bound method), else
    ``@<digest of the pickled state>`` of the object holding ``fn``'s state; '' when there is none
    (or it cannot be pickled: such a tokenizer cannot be used with workers either)."""
    holder = state_holder(fn)
    for obj in (fn, holder):
        path = getattr(obj, "name_or_path", None)
        if isinstance(path, str):
            return f"[{path}]"
    if holder is None:
        return ""
    try:
        data = pickle.dumps(holder, protocol=4)
    except Exception:  # unpicklable: named by its class only
        logger.debug("tokenizer state of %r cannot be pickled; not fingerprinted", holder, exc_info=True)
        return ""
    return f"@{hashlib.sha256(data).hexdigest()[:10]}"


_STATE_DIGEST = re.compile(r"@[0-9a-f]{10}$")
_NAME_SUFFIX = re.compile(r"\[[^\[\]]*\]$")


def tokenizer_labels_agree(recorded: Optional[str], given: Optional[str]) -> bool:
    """Whether a recorded tokenizer label and a given one name the same tokenizer, as far as
    labels can tell across processes and versions: equal once a state digest (``@<hex>``) is set
    aside - a digest of pickled state can differ between processes (sets of strings pickle in hash
    order), so it keys caches, which then only miss, but never refuses an index - and a label
    recorded before owners of bound methods were named (``...encode``) agrees with the same label
    naming it now (``...encode[bert-base-uncased]``)."""
    if recorded == given:
        return True
    if recorded is None or given is None:
        return False
    recorded, given = _STATE_DIGEST.sub("", recorded), _STATE_DIGEST.sub("", given)
    return recorded == given or (not _NAME_SUFFIX.search(recorded) and _NAME_SUFFIX.sub("", given) == recorded)


def recorded_tokenizer(owner: str, tokenizer: Optional[TokenizerFn], recorded: Optional[str]) -> Optional[str]:
    """The ``tokenizer_callable`` of an object built with ``tokenizer`` where the data it is built from
    records ``recorded``; a ValueError when a callable was recorded but none is given (a dict, JSON or an
    index manifest cannot hold one: the default tokenizer would silently measure otherwise)."""
    if tokenizer is None:
        if recorded:
            raise ValueError(
                f"{owner} was saved with the tokenizer callable {recorded!r}, which a dict or JSON cannot hold: "
                f"pass it again as tokenizer= (e.g. {owner}.from_dict(data, tokenizer=...)); to open an index "
                "built with it, pass HybridIndex.load(..., node_parser=<the parser built with tokenizer=...>)"
            )
        return None
    if not callable(tokenizer):
        raise ValueError(f"tokenizer must be a callable str -> list of tokens, got {type(tokenizer).__name__}")
    label = tokenizer_label(tokenizer)
    if recorded and not tokenizer_labels_agree(recorded, label):
        logger.warning("%s: tokenizer %s given where %s was recorded; %s measures tokens", owner, label, recorded, label)
    return label


def check_tokenizer_picklable(owner: str, tokenizer: Optional[TokenizerFn], label: Optional[str]) -> None:
    """A ``pickle.PicklingError`` when ``tokenizer`` cannot be pickled (the copy would otherwise
    measure with the default tokenizer: LlamaIndex drops unpicklable attributes)."""
    if tokenizer is None:
        return
    try:
        pickle.dumps(tokenizer)
    except Exception as exc:
        raise pickle.PicklingError(
            f"{owner} cannot be pickled (e.g. for IngestionPipeline(num_workers=...)): its tokenizer {label} cannot "
            f"({type(exc).__name__}: {exc}). Pass a module-level function (not a lambda or a local function)"
        ) from exc


class PicklesTokenizer:
    """Mixin for LlamaIndex components holding a ``tokenizer`` callable in ``_tokenizer`` and its name in
    ``tokenizer_callable``, whose ``__init__`` takes ``tokenizer=``: pickled with the callable (a
    PicklingError when it cannot be), unpickled through ``__init__`` with it and its recorded name.
    (LlamaIndex's ``BaseComponent`` drops unpicklable attributes and rebuilds from fields only.)"""

    def __getstate__(self) -> Dict[str, Any]:
        check_tokenizer_picklable(self.class_name(), self._tokenizer, self.tokenizer_callable)  # type: ignore[attr-defined]
        return super().__getstate__()  # type: ignore[misc]

    def __setstate__(self, state: Dict[str, Any]) -> None:
        data = dict(state["__dict__"])
        recorded = data.pop("tokenizer_callable", None)  # kept: ``__main__`` is another module name in a worker
        tokenizer = (state.get("__pydantic_private__") or {}).get("_tokenizer")
        self.__init__(tokenizer=tokenizer, **data)  # type: ignore[misc]
        self.tokenizer_callable = recorded
