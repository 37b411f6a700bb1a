"""Fixtures for the HybridIndex tests: one embedding model and one built sample index per session."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Tuple

import pytest
from llama_index.core.schema import QueryBundle

from llama_index_retrieval_kit.indices import HybridIndex

from . import _support


@pytest.fixture(scope="session")
def embed_model():
    """The packaged offline MiniLM, shared by every test of the session."""
    return _support.embed_model()


@pytest.fixture(scope="session")
def template(tmp_path_factory: pytest.TempPathFactory, embed_model) -> _support.Template:
    """The three samples indexed once (closed); tests copy the folder and reopen it."""
    return _support.build_template(tmp_path_factory.mktemp("hybrid_template"))


@pytest.fixture(scope="session")
def bundles(embed_model) -> Tuple[QueryBundle, ...]:
    """The sample questions with precomputed query embeddings."""
    return _support.query_bundles()


@pytest.fixture()
def index_dir(template: _support.Template, tmp_path: Path) -> Path:
    """A private copy of the template folder."""
    return _support.copy_index(template, tmp_path / "index")


@pytest.fixture()
def index(index_dir: Path, embed_model) -> Iterator[HybridIndex]:
    """The template, opened from a private copy (closed after the test)."""
    idx = HybridIndex.load(index_dir, embed_model=embed_model)
    try:
        yield idx
    finally:
        idx.close()
