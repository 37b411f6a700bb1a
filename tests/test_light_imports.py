"""Importing the package and running ``rkit --help`` load no heavy library (lazy exports)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "sentence_transformers", "ragas", "transformers", "llama_index.core", "qdrant_client")

PROBE = """
import sys
{code}
print("loaded:" + ",".join(m for m in {heavy!r} if m in sys.modules))
"""


def _loaded(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(code=code, heavy=HEAVY)], capture_output=True, text=True, check=True)
    line = [line for line in out.stdout.splitlines() if line.startswith("loaded:")][-1]
    return [m for m in line[len("loaded:"):].split(",") if m]


def test_importing_the_package_loads_nothing_heavy() -> None:
    assert _loaded("import llama_index_retrieval_kit") == []


@pytest.mark.parametrize("argv", [["--help"], ["index", "--help"], ["query", "--help"], ["calibrate", "--help"], ["inspect", "--help"], ["ingest", "--help"], ["eval", "--help"], ["demo", "--help"], ["delete", "--help"]])
def test_rkit_help_loads_nothing_heavy(argv: list[str]) -> None:
    code = f"from llama_index_retrieval_kit.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    assert _loaded(code) == []


def test_lazy_exports_still_resolve() -> None:
    import llama_index_retrieval_kit as kit
    from llama_index_retrieval_kit import evaluation, indices, postprocessor, retrievers

    for package in (kit, evaluation, indices, postprocessor, retrievers):
        missing = [name for name in package.__all__ if getattr(package, name, None) is None]
        assert missing == [], (package.__name__, missing)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        kit.NoSuchThing  # noqa: B018


def test_the_embedded_index_does_not_import_qdrant_client() -> None:
    """qdrant-client (~0.5 s to import) serves Qdrant servers; the embedded store is Qdrant Edge."""
    code = "from llama_index_retrieval_kit.indices import HybridIndex\nfrom llama_index_retrieval_kit.retrievers import QdrantHybridRetriever"
    assert "qdrant_client" not in _loaded(code)
