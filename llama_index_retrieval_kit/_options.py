"""Constructor keywords checked against a pydantic model's fields: a misspelt option is refused
(``TypeError`` listing the allowed ones), never silently dropped (pydantic's default)."""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping

from llama_index.core.bridge.pydantic import model_validator


def unknown_options(given: Iterable[str], allowed: Iterable[str]) -> List[str]:
    """The names of ``given`` that ``allowed`` lacks, sorted."""
    allowed = set(allowed)
    return sorted(str(name) for name in given if name not in allowed)


def check_options(owner: str, given: Mapping[str, Any], allowed: Iterable[str]) -> None:
    """A ``TypeError`` naming the unknown options of ``given`` and listing ``allowed``; else nothing."""
    allowed = list(allowed)
    unknown = unknown_options(given, allowed)
    if unknown:
        raise TypeError(
            f"{owner} got unknown option(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(allowed))}"
        )


class StrictOptions:
    """Mixin for LlamaIndex components (pydantic models): every constructor keyword must be a field
    or one of ``__init_options__`` (keywords the class's ``__init__`` takes itself). A
    ``class_name`` equal to the class's own (``to_dict()`` output given to ``model_validate``) is dropped."""

    __init_options__: tuple = ()

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_options(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "class_name" in data and data["class_name"] == cls.class_name():  # type: ignore[attr-defined]
                data = {k: v for k, v in data.items() if k != "class_name"}
            check_options(cls.__name__, data, [*cls.model_fields, *cls.__init_options__])  # type: ignore[attr-defined]
        return data
