"""Pydantic objects built from values valid by construction, without validation.

One owner for the hot paths that build many small models per query (copies of result nodes,
fused results, trace records): pydantic's ``model_construct`` still walks every field for
defaults, and validation re-checks what the package has just made. What such an object needs is
its four slots, set here, as pydantic's own ``__copy__`` and ``model_construct`` set them.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Set


def assemble(
    cls: Any,
    values: Dict[str, Any],
    fields_set: Set[str],
    extra: Optional[Dict[str, Any]] = None,
    private: Optional[Dict[str, Any]] = None,
) -> Any:
    """An instance of the pydantic model ``cls`` whose ``__dict__`` is ``values`` (owned by the
    object from now on) with the given fields-set, extra and private values; nothing validated."""
    obj = cls.__new__(cls)
    object.__setattr__(obj, "__dict__", values)
    object.__setattr__(obj, "__pydantic_fields_set__", fields_set)
    object.__setattr__(obj, "__pydantic_extra__", extra)
    object.__setattr__(obj, "__pydantic_private__", private)
    return obj
