"""Optional extras: what pyproject.toml installs, and the one-line error when an extra is missing.

A missing extra is simulated with ``sys.modules[name] = None`` (Python then refuses the import
as if the package were not installed), in process, or by a finder that refuses the modules, in a
subprocess running ``rkit`` as a user would.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import llama_index_retrieval_kit
from llama_index_retrieval_kit._extras import (
    EXTRA_MODULES,
    MissingExtraError,
    install_command,
    is_installed,
    require_extra,
    require_extras,
)
from llama_index_retrieval_kit.cli import EXIT_USAGE, main
from llama_index_retrieval_kit.samples import QUESTIONS_FILE

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]
EXTRAS = PROJECT["optional-dependencies"]

#: Packages that left the core install, and the extra each moved to.
MOVED = {
    "ragas": "eval",
    "langchain-community": "eval",
    "scipy": "eval",
    "matplotlib": "eval",
    "fpdf2": "samples",
    "onnx": "onnx",
    "onnxruntime": "onnx",
    "flagembedding": "rerank",
    "llama-index-postprocessor-flag-embedding-reranker": "rerank",
    "llama-index-retrievers-bm25": "bench",
    "psutil": "bench",
}
TEST_TOOLS = {"pytest", "hypothesis", "ranx", "nbclient", "nbformat", "ipykernel", "pandas"}  # pandas: the notebooks


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "requirements" / "lock.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


# ----------------------------------------------------------------------------- pyproject.toml
def test_no_moved_package_is_a_core_dependency() -> None:
    core = _names(PROJECT["dependencies"])
    assert core.isdisjoint(MOVED), sorted(core & set(MOVED))
    assert {"qdrant-edge-py", "qdrant-client", "llama-index-core"} <= core
    assert "qdrant-edge-py==0.9.0" in PROJECT["dependencies"]


@pytest.mark.parametrize("package, extra", sorted(MOVED.items()))
def test_each_moved_package_is_in_its_extra(package: str, extra: str) -> None:
    assert package in _names(EXTRAS[extra])


def test_all_holds_every_extra_and_dev_holds_all_and_the_test_tools() -> None:
    others = {name: reqs for name, reqs in EXTRAS.items() if name not in ("all", "dev")}
    assert set(others) >= set(EXTRA_MODULES), "an extra of _extras.EXTRA_MODULES is missing from pyproject.toml"
    for name, requirements in others.items():
        missing = set(requirements) - set(EXTRAS["all"])
        assert not missing, f"[all] lacks {sorted(missing)} of [{name}]"
    assert set(EXTRAS["all"]) <= set(EXTRAS["dev"]), sorted(set(EXTRAS["all"]) - set(EXTRAS["dev"]))
    assert _names(EXTRAS["dev"]) - _names(EXTRAS["all"]) == TEST_TOOLS


def test_the_lock_file_pins_everything_dev_installs_within_our_bounds() -> None:
    """CI installs ``-e .[dev]`` with requirements/lock.txt: every requirement is pinned there, inside its range."""
    pins = _lock()
    for requirement in map(Requirement, [*PROJECT["dependencies"], *EXTRAS["dev"]]):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not in requirements/lock.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (str(requirement), str(pins[name]))


def test_ragas_is_bounded_away_from_the_langchain_community_that_breaks_it() -> None:
    eval_requirements = {canonicalize_name(Requirement(r).name): Requirement(r) for r in EXTRAS["eval"]}
    assert not eval_requirements["langchain-community"].specifier.contains("0.4.2")
    assert eval_requirements["langchain-community"].specifier.contains("0.4.1")
    assert not eval_requirements["ragas"].specifier.contains("0.5.0")


def test_one_version_typed_package_and_complete_metadata() -> None:
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "llama_index_retrieval_kit.__about__.__version__"
    from llama_index_retrieval_kit.__about__ import __version__

    assert llama_index_retrieval_kit.__version__ == __version__
    assert importlib.metadata.version("llama-index-retrieval-kit") == __version__, "reinstall: pip install -e ."
    assert (REPO / "llama_index_retrieval_kit" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["llama_index_retrieval_kit"]
    for key in ("authors", "classifiers", "urls", "keywords", "license", "readme", "requires-python"):
        assert PROJECT.get(key), key
    assert "Typing :: Typed" in PROJECT["classifiers"]


# ----------------------------------------------------------------------------- the helper
def test_message_names_the_extra_and_the_command() -> None:
    with pytest.raises(MissingExtraError) as info:
        require_extra("eval", ("json", "no_such_module_xyz"), "rkit eval")
    assert str(info.value) == (
        "rkit eval needs the 'eval' extra: pip install 'llama-index-retrieval-kit[eval]' (not installed: no_such_module_xyz)"
    )
    assert isinstance(info.value, ImportError) and info.value.extras == ("eval",)
    require_extra("eval", "json", "nothing missing")  # no error
    assert install_command("samples", "eval") == "pip install 'llama-index-retrieval-kit[samples,eval]'"


def test_several_missing_extras_are_named_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fpdf", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"^rkit demo needs the 'samples' and 'eval' extras: "
                       r"pip install 'llama-index-retrieval-kit\[samples,eval\]' \(not installed: fpdf2, matplotlib\)$"):
        require_extras("rkit demo", {"samples": "fpdf", "eval": ("scipy", "matplotlib")})


def test_is_installed_never_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ragas", None)
    assert not is_installed("ragas") and not is_installed("no_such_package.sub")
    assert is_installed("json")


# ----------------------------------------------------------------------------- each feature
def test_ragas_adapter_names_the_eval_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_index.core.schema import NodeWithScore, TextNode

    from llama_index_retrieval_kit.evaluation import RetrievalDataset, to_ragas_dataset, to_ragas_samples

    monkeypatch.setitem(sys.modules, "ragas", None)
    dataset = RetrievalDataset(queries={"a": "q"}, qrels={})
    results = {"a": [NodeWithScore(node=TextNode(text="t"))]}
    assert to_ragas_samples(dataset, results)  # plain samples need no RAGAS
    with pytest.raises(MissingExtraError, match=r"needs the 'eval' extra: pip install 'llama-index-retrieval-kit\[eval\]' \(not installed: ragas\)"):
        to_ragas_dataset(dataset, results)


def test_writing_a_pdf_names_the_samples_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from llama_index_retrieval_kit.samples import sample_pdf
    from llama_index_retrieval_kit.samples.pdf_writer import write_pdf

    monkeypatch.setitem(sys.modules, "fpdf", None)
    with pytest.raises(MissingExtraError, match=r"needs the 'samples' extra: pip install 'llama-index-retrieval-kit\[samples\]' \(not installed: fpdf2\)"):
        write_pdf([("p", "text")], tmp_path / "x.pdf")
    with pytest.raises(MissingExtraError, match=r"'samples' extra"):
        sample_pdf(tmp_path)
    assert not list(tmp_path.iterdir())


def test_flag_embedding_reranker_names_the_rerank_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_index_retrieval_kit.postprocessor import CrossEncoderReranker

    monkeypatch.setitem(sys.modules, "FlagEmbedding", None)
    with pytest.raises(MissingExtraError, match=r"'flag_embedding' rerank backend .* needs the 'rerank' extra: "
                       r"pip install 'llama-index-retrieval-kit\[rerank\]' \(not installed: FlagEmbedding\); "
                       r"pass backend='sentence_transformers'"):
        CrossEncoderReranker()
    assert CrossEncoderReranker(backend="sentence_transformers").backend.value == "sentence_transformers"


def test_onnx_query_path_falls_back_to_pytorch_with_an_info_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The ONNX path is an optimisation: without the extra, queries run on PyTorch (same vectors), no warning."""
    from llama_index_retrieval_kit.models import default_embed_model

    monkeypatch.setitem(sys.modules, "onnx", None)  # onnxruntime alone cannot export the model
    caplog.set_level(logging.INFO, logger="llama_index_retrieval_kit.embeddings.onnx_query")
    model = default_embed_model(onnx_cache_dir=str(tmp_path))
    vector = model.get_query_embedding("What is the annual fee?")
    assert not model.onnx_active and len(vector) == 384
    records = [r for r in caplog.records if r.name == "llama_index_retrieval_kit.embeddings.onnx_query"]
    assert [r.levelno for r in records] == [logging.INFO], [r.getMessage() for r in records]
    assert "needs the 'onnx' extra: pip install 'llama-index-retrieval-kit[onnx]' (not installed: onnx)" in records[0].getMessage()
    assert not list(tmp_path.rglob("*.onnx"))


# ----------------------------------------------------------------------------- the command line
def test_rkit_eval_without_the_eval_extra_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "scipy", None)
    code = main(["-q", "eval", "--dataset", str(QUESTIONS_FILE), "--config", "bm25", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert err == (
        "rkit: error: rkit eval needs the 'eval' extra: pip install 'llama-index-retrieval-kit[eval]' (not installed: scipy)\n"
    )
    assert not (tmp_path / "out").exists()  # refused before any work


def test_rkit_eval_llamaindex_bm25_without_the_bench_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "llama_index.retrievers.bm25", None)
    code = main(["-q", "eval", "--dataset", str(QUESTIONS_FILE), "--config", "llamaindex-bm25", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and len(err.splitlines()) == 1
    assert "needs the 'bench' extra: pip install 'llama-index-retrieval-kit[bench]' (not installed: llama-index-retrievers-bm25)" in err
    assert not (tmp_path / "out").exists()


def test_rkit_demo_without_extras_names_them_before_any_work(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "fpdf", None)
    assert main(["-q", "demo", "--out", str(tmp_path / "demo")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("rkit: error: rkit demo needs the 'samples' extra: pip install 'llama-index-retrieval-kit[samples]'")
    assert len(err.splitlines()) == 1 and not (tmp_path / "demo").exists()


BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or any(name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
from llama_index_retrieval_kit.cli import main
code = main({argv!r})
heavy = [m for m in ("torch", "sentence_transformers", "ragas") if m in sys.modules]
print("heavy:" + ",".join(heavy))
raise SystemExit(code)
"""


def test_rkit_eval_in_an_install_without_the_extra(tmp_path: Path) -> None:
    """As a user sees it: a process where the eval extra's packages cannot be imported at all."""
    argv = ["eval", "--dataset", str(QUESTIONS_FILE), "--config", "bm25", "--out", str(tmp_path / "out")]
    code = BLOCKER.format(blocked=sorted(EXTRA_MODULES["eval"]), argv=argv)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stderr.splitlines() == [
        "rkit: error: rkit eval needs the 'eval' extra: pip install 'llama-index-retrieval-kit[eval]' "
        "(not installed: scipy, matplotlib)"
    ]
    assert proc.stdout.strip().splitlines()[-1] == "heavy:"  # refused before loading any model
    assert re.search(r"\[eval\]", proc.stderr)
