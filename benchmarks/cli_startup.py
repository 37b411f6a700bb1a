"""Start-up cost of the command line and of importing the package, cold and warm.

    python benchmarks/cli_startup.py [--runs 5]

"cold" is the first run in this script (the OS may still cache the files: for a truly cold
start, run it after a reboot); "warm" is the median of the next ``--runs``. Also prints which heavy
modules an import pulls in (none of torch, transformers, sentence_transformers, ragas may).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = ["--help", "index --help", "query --help", "eval --help", "calibrate --help", "inspect --help", "ingest --help", "migrate --help", "demo --help"]
HEAVY = ("torch", "transformers", "sentence_transformers", "ragas", "onnxruntime", "qdrant_edge")


def timed(argv: list) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - started


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
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    print("| command | cold s | warm s (median) |\n|---|---|---|")
    for name, cold, warm in rows:
        print(f"| `{name}` | {cold:.2f} | {warm:.2f} |")
    print(f"\nheavy modules loaded by the import: {loaded or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
