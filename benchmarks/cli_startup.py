"""Start-up cost of the command line and of importing the package, cold and warm.

    python benchmarks/cli_startup.py [--runs 5]

"cold" is the first run in this script (the OS may still cache the files: for a truly cold
start, run it after a reboot); "warm" is the median of the next ``--runs``. Also prints which heavy
modules an import pulls in (none of torch, transformers, sentence_transformers, ragas may).

Then one question with ``rkit query`` over the bundled samples (indexed in a temporary folder,
with a temporary ``RKIT_CACHE_DIR``): without a query export record (each run after deleting it:
the query embedder loads sentence-transformers and PyTorch, checks the cached ONNX export and
writes the record) and with one (embeddings/query_export.py: no PyTorch), alternating.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = ["--help", "index --help", "query --help", "eval --help", "calibrate --help", "inspect --help", "ingest --help", "migrate --help", "demo --help"]
HEAVY = ("torch", "transformers", "sentence_transformers", "ragas", "onnxruntime", "qdrant_edge")


def timed(argv: list, env: dict | None = None) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, env=env)
    return time.perf_counter() - started


def query_rows(rkit: str, runs: int) -> list:
    """``rkit query`` without and with a query export record (alternating, medians of ``runs``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from llama_index_retrieval_kit.samples import sample_files

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "RKIT_CACHE_DIR": str(Path(tmp) / "cache")}
        storage = Path(tmp) / "index"
        subprocess.run([rkit, "-q", "index", *map(str, sample_files()), "--storage", str(storage)], check=True, capture_output=True, env=env)
        query = [rkit, "query", "What is the annual fee?", "--storage", str(storage)]
        timed(query, env)  # the ONNX export (once per machine and model) and the first record
        records = Path(env["RKIT_CACHE_DIR"]) / "onnx" / "queries"
        without, with_record = [], []
        for _ in range(runs):
            shutil.rmtree(records, ignore_errors=True)
            without.append(timed(query, env))  # loads PyTorch, writes the record again
            with_record.append(timed(query, env))
    return [
        ("rkit query (no query export record: PyTorch)", without[0], statistics.median(without)),
        ("rkit query (query export record: no PyTorch)", with_record[0], statistics.median(with_record)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rkit = shutil.which("rkit") or str(Path(sys.executable).with_name("rkit"))
    rows = []
    probe = "import sys, llama_index_retrieval_kit; print(','.join(m for m in %r if m in sys.modules))" % (HEAVY,)
    for name, argv in [("import llama_index_retrieval_kit", [sys.executable, "-c", probe])] + [
        (f"rkit {c}", [rkit, *c.split()]) for c in COMMANDS
    ]:
        cold = timed(argv)
        warm = statistics.median(timed(argv) for _ in range(args.runs))
        rows.append((name, cold, warm))
    rows += query_rows(rkit, args.runs)
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    print("| command | cold s | warm s (median) |\n|---|---|---|")
    for name, cold, warm in rows:
        print(f"| `{name}` | {cold:.2f} | {warm:.2f} |")
    print(f"\nheavy modules loaded by the import: {loaded or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
