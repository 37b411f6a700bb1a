"""Section-aware node parsers (LlamaIndex ``NodeParser`` subclasses)."""

from .section_hierarchy import SectionHierarchyNodeParser
from .section_window import SectionWindowNodeParser
from .sections import Heading, HeadingRules, Section, detect_headings, split_sections

__all__ = [
    "SectionWindowNodeParser",
    "SectionHierarchyNodeParser",
    "Heading",
    "HeadingRules",
    "Section",
    "detect_headings",
    "split_sections",
]
