"""Section-aware node parsers (LlamaIndex ``NodeParser`` subclasses)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "SectionHierarchyNodeParser": ".section_hierarchy",
    "SectionWindowNodeParser": ".section_window",
    "Heading": ".sections",
    "HeadingRules": ".sections",
    "Section": ".sections",
    "detect_headings": ".sections",
    "split_sections": ".sections",
}

__all__ = [
    "SectionWindowNodeParser",
    "SectionHierarchyNodeParser",
    "Heading",
    "HeadingRules",
    "Section",
    "detect_headings",
    "split_sections",
]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from .section_hierarchy import SectionHierarchyNodeParser
    from .section_window import SectionWindowNodeParser
    from .sections import Heading, HeadingRules, Section, detect_headings, split_sections
