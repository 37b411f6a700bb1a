"""Named components: readers, node parsers and node postprocessors found by name.

A pipeline configuration (:mod:`llama_index_retrieval_kit.pipeline`) names its components
instead of importing them. A name is either

* a registered name: an entry point of the group ``llama_index_retrieval_kit.components``
  (this package declares its own in ``pyproject.toml``, e.g. ``section_window``,
  ``cross_encoder``; any installed package can add its own the same way), or
* a fully qualified ``"package.module:Class"``.

Entry points are read with :mod:`importlib.metadata` on first use, and a component's module is
imported only when that component is resolved, so importing this module stays light.

Every component of a kind has LlamaIndex's serialisation: :func:`component_to_dict` gives
``{"component": name, **options}`` (JSON-ready: enums become their values) and
:func:`component_from_dict` builds the component again. Options are the component's pydantic
fields minus LlamaIndex plumbing (``callback_manager``, ``id_func``, ``class_name``,
``is_remote``); an option the component does not have is refused with the list of those it
has (LlamaIndex components would silently ignore it). Retrievers are not components: they are
bound to an open index and cannot be serialised (:func:`component_to_dict` says so); serialise
the :class:`~llama_index_retrieval_kit.pipeline.PipelineConfig` and rebuild instead.
"""

from __future__ import annotations

import enum
import functools
import importlib
import json
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ._enums import ChoiceEnum

#: The entry point group that names components (``[project.entry-points."<group>"]``).
ENTRY_POINT_GROUP = "llama_index_retrieval_kit.components"
#: Fields of LlamaIndex components that are plumbing, not settings: never options.
INTERNAL_FIELDS = frozenset({"callback_manager", "id_func", "class_name", "is_remote", "doc_id_func"})


class ComponentKind(ChoiceEnum):
    """What a component is: the LlamaIndex base class it must subclass."""

    READER = "reader"  # this package's FileReader: one Document per file, page offsets, ids
    NODE_PARSER = "node_parser"  # llama_index NodeParser
    POSTPROCESSOR = "postprocessor"  # llama_index BaseNodePostprocessor


class ComponentError(ValueError):
    """A component name or its options are wrong; the message names the key, the value and what is allowed."""

    def __init__(self, message: str, key: Optional[str] = None) -> None:
        self.key = key
        super().__init__(message)


def _base_class(kind: ComponentKind) -> type:
    if kind is ComponentKind.READER:
        from .readers.base import FileReader

        return FileReader
    if kind is ComponentKind.NODE_PARSER:
        from llama_index.core.node_parser.interface import NodeParser

        return NodeParser
    from llama_index.core.postprocessor.types import BaseNodePostprocessor

    return BaseNodePostprocessor


_KIND_WORDS = {
    ComponentKind.READER: "a reader (a subclass of llama_index_retrieval_kit.readers.base.FileReader)",
    ComponentKind.NODE_PARSER: "a node parser (a subclass of llama_index.core.node_parser.NodeParser)",
    ComponentKind.POSTPROCESSOR: "a node postprocessor (a subclass of llama_index.core.postprocessor.types.BaseNodePostprocessor)",
}


@functools.lru_cache(maxsize=1)
def _entry_points() -> Dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def refresh() -> None:
    """Read the entry points again (after installing a package that declares components)."""
    _entry_points.cache_clear()


def registered_components() -> Dict[str, str]:
    """Registered name -> ``"module:Class"`` for every entry point of :data:`ENTRY_POINT_GROUP`."""
    return {name: ep.value for name, ep in sorted(_entry_points().items())}


def _kind_of(cls: type) -> Optional[ComponentKind]:
    for kind in ComponentKind:
        try:
            if issubclass(cls, _base_class(kind)):
                return kind
        except TypeError:
            return None
    return None


def names_for(kind: ComponentKind | str) -> List[str]:
    """Registered names whose class is of ``kind`` (imports each registered class once)."""
    kind = ComponentKind.from_str(kind)
    out = []
    for name, ep in sorted(_entry_points().items()):
        try:
            cls = ep.load()
        except Exception:  # a broken third-party entry point must not hide the others
            continue
        if isinstance(cls, type) and _kind_of(cls) is kind:
            out.append(name)
    return out


def _allowed_text(kind: Optional[ComponentKind]) -> str:
    names = names_for(kind) if kind is not None else list(registered_components())
    return f"allowed: {', '.join(repr(n) for n in names)}, or a fully qualified 'package.module:Class'"


def _import_qualified(name: str, key: Optional[str]) -> Any:
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ComponentError(f"{name!r} is not 'package.module:Class'", key)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ComponentError(f"cannot import module {module_name!r} of component {name!r}: {exc}", key) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ComponentError(f"module {module_name!r} has no {attr!r} (component {name!r})", key) from None
    return obj


def resolve_component(name: Any, kind: ComponentKind | str | None = None, key: Optional[str] = None) -> type:
    """The class a component name stands for: a registered name or ``"module:Class"``.

    With ``kind``, the class must be of that kind (a reader, a node parser, a postprocessor);
    errors are :class:`ComponentError` naming ``key`` (the config key), the value and the allowed names.
    """
    kind = ComponentKind.from_str(kind) if kind is not None else None
    if not isinstance(name, str) or not name.strip():
        raise ComponentError(f"a component name must be a non-empty string, got {name!r}; {_allowed_text(kind)}", key)
    name = name.strip()
    if ":" in name:
        cls = _import_qualified(name, key)
    else:
        ep = _entry_points().get(name)
        if ep is None:
            raise ComponentError(f"unknown component {name!r}; {_allowed_text(kind)}", key)
        try:
            cls = ep.load()
        except Exception as exc:
            raise ComponentError(f"component {name!r} ({ep.value}) cannot be loaded: {type(exc).__name__}: {exc}", key) from None
    if not isinstance(cls, type):
        raise ComponentError(f"component {name!r} is {type(cls).__name__} {cls!r}, not a class", key)
    if kind is not None and not issubclass(cls, _base_class(kind)):
        found = _kind_of(cls)
        what = f"is {_KIND_WORDS[found]}" if found is not None else "is not a LlamaIndex component of a known kind"
        raise ComponentError(f"component {name!r} ({cls.__module__}.{cls.__qualname__}) {what}, not {_KIND_WORDS[kind]}; {_allowed_text(kind)}", key)
    return cls


def component_name(component: Any) -> str:
    """The name a config uses for a component class or instance: its registered name, else ``module:Class``."""
    cls = component if isinstance(component, type) else type(component)
    qualified = f"{cls.__module__}:{cls.__qualname__}"
    for name, ep in sorted(_entry_points().items()):
        if ep.value == qualified:
            return name
        try:
            if ep.load() is cls:
                return name
        except Exception:
            continue
    return qualified


def component_options(cls: type) -> List[str]:
    """The options (constructor keywords) a config may give component class ``cls``."""
    fields = getattr(cls, "model_fields", None)
    if not isinstance(fields, Mapping):
        raise ComponentError(f"{cls.__module__}.{cls.__qualname__} is not a pydantic (LlamaIndex) component: it has no options to configure")
    return [name for name in fields if name not in INTERNAL_FIELDS]


def _format_validation_error(exc: Any, prefix: Optional[str]) -> ComponentError:
    """The first error of a pydantic ValidationError as a ComponentError naming the full key."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    loc = ".".join(str(part) for part in first.get("loc", ()) if part != "__root__")
    key = ".".join(p for p in (prefix, loc) if p) or None
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = "missing (required)"
    elif "input" in first and first.get("type") not in ("value_error",):
        msg = f"{msg}, got {first['input']!r}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error(s))"
    return ComponentError(msg, key)


#: Options that let a model folder run its own Python code (``transformers``' ``trust_remote_code``).
#: A component built from a config gets them False unless the config sets them: some LlamaIndex
#: components default to True (``SentenceTransformerRerank``), and a config is often handed around.
REMOTE_CODE_OPTIONS = ("trust_remote_code",)


def _is_own_component(cls: type) -> bool:
    """Whether ``cls`` comes from this package, whose components load nothing when constructed."""
    return cls.__module__.partition(".")[0] == __name__.partition(".")[0]


def _checked_options(
    name: str, options: Optional[Mapping[str, Any]], kind: ComponentKind | str | None, key: Optional[str]
) -> tuple[type, Dict[str, Any]]:
    """The class of ``name`` and ``options`` with every name checked and the remote-code options
    defaulted to False (see :data:`REMOTE_CODE_OPTIONS`)."""
    cls = resolve_component(name, kind, key=f"{key}.component" if key else None)
    options = dict(options or {})
    allowed = component_options(cls)
    for option in options:
        if option not in allowed:
            raise ComponentError(
                f"unknown option {option!r} of component {name!r} ({cls.__qualname__}); allowed: {', '.join(allowed)}",
                f"{key}.{option}" if key else option,
            )
    for option in REMOTE_CODE_OPTIONS:
        if option in allowed and option not in options:
            options[option] = False
    return cls, options


def _component_error(exc: Exception, cls: type, key: Optional[str]) -> ComponentError:
    if hasattr(exc, "errors") and callable(exc.errors):  # pydantic's ValidationError
        return _format_validation_error(exc, key)
    return ComponentError(f"{cls.__qualname__}: {exc}", key)


def check_component(
    name: str,
    options: Optional[Mapping[str, Any]] = None,
    kind: ComponentKind | str | None = None,
    key: Optional[str] = None,
) -> type:
    """Check component ``name`` and its ``options`` as :func:`make_component` would, without
    running a constructor from outside this package; returns the class.

    Reading a config must not load models or run a model folder's code: LlamaIndex components
    such as ``SentenceTransformerRerank`` load their model in ``__init__`` (which pydantic's
    ``model_validate`` calls too). Those are checked field by field with pydantic alone (types,
    constraints, field validators; required fields present) and built when the pipeline is built;
    this package's components load lazily and are built once to check them fully.
    """
    cls, options = _checked_options(name, options, kind, key)
    try:
        if _is_own_component(cls):
            cls(**options)
        else:
            _validate_fields(cls, options, key)
    except ComponentError:
        raise
    except Exception as exc:  # pydantic's ValidationError, the component's ValueError/ImportError
        raise _component_error(exc, cls, key) from None
    return cls


def _validate_fields(cls: Any, options: Mapping[str, Any], key: Optional[str]) -> None:
    """Each option validated as an assignment to an instance made without ``__init__``."""
    missing = [n for n, f in cls.model_fields.items() if f.is_required() and n not in options and n not in INTERNAL_FIELDS]
    if missing:
        raise ComponentError("missing (required)", f"{key}.{missing[0]}" if key else missing[0])
    blank = cls.model_construct()
    for option, value in options.items():
        cls.__pydantic_validator__.validate_assignment(blank, option, value)


def make_component(
    name: str,
    options: Optional[Mapping[str, Any]] = None,
    kind: ComponentKind | str | None = None,
    key: Optional[str] = None,
) -> Any:
    """An instance of component ``name`` with ``options``, every option checked.

    An option the component does not have is refused (naming the allowed ones); a bad value
    is the component's own error, re-raised as :class:`ComponentError` naming ``key.option``.
    Options of :data:`REMOTE_CODE_OPTIONS` the component has are False unless given.
    """
    cls, options = _checked_options(name, options, kind, key)
    try:
        return cls(**options)
    except Exception as exc:  # pydantic's ValidationError, the component's ValueError/ImportError
        raise _component_error(exc, cls, key) from None


def _plain(value: Any) -> Any:
    """JSON-ready values: enums become their values, tuples lists."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def component_to_dict(component: Any) -> Dict[str, Any]:
    """``{"component": name, **options}`` for a reader, node parser or postprocessor (JSON-ready).

    Raises TypeError for objects that cannot be rebuilt from settings alone, such as retrievers
    bound to an open index.
    """
    from llama_index.core.base.base_retriever import BaseRetriever

    if isinstance(component, BaseRetriever):
        raise TypeError(
            f"{type(component).__name__} is a retriever bound to an open index and cannot be serialised: "
            "serialise the PipelineConfig it was built from (config.to_dict() / to_yaml()) and rebuild it "
            "with llama_index_retrieval_kit.pipeline.build_retriever(config)"
        )
    if _kind_of(type(component)) is None or not hasattr(component, "to_dict"):
        raise TypeError(
            f"{type(component).__name__} is not a reader, node parser or node postprocessor with to_dict(); "
            "only those are components"
        )
    data = component.to_dict()
    allowed = set(component_options(type(component)))
    options = {k: v for k, v in data.items() if k in allowed}
    return {"component": component_name(component), **_plain(options)}


def component_from_dict(data: Mapping[str, Any], kind: ComponentKind | str | None = None, key: Optional[str] = None) -> Any:
    """The component :func:`component_to_dict` described."""
    if not isinstance(data, Mapping) or "component" not in data:
        raise ComponentError(f"a component dict needs a 'component' key (a registered name or 'module:Class'), got {data!r:.200}", key)
    options = {k: v for k, v in data.items() if k != "component"}
    return make_component(data["component"], options, kind, key)


def describe_components(kinds: Sequence[ComponentKind] = tuple(ComponentKind)) -> str:
    """A text listing of the registered components per kind (for docs and error messages)."""
    lines = []
    for kind in kinds:
        lines.append(f"{kind.value}: {', '.join(names_for(kind)) or '(none)'}")
    return "\n".join(lines)


def json_safe(value: Any) -> Any:
    """``value`` round-tripped through JSON (str for the rest): what a YAML or JSON file would hold."""
    return json.loads(json.dumps(_plain(value), default=str))
