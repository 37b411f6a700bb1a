#!/usr/bin/env bash
# Create .venv and install the package with its test extras, offline-safe and pinned.
#   - torch is installed first from the CPU build pinned in constraints.txt (an unpinned torch
#     pulls gigabytes of CUDA wheels);
#   - requirements/lock.txt pins every other package to the versions CI runs with.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade "pip>=24" setuptools wheel
"${PIP[@]}" install -c constraints.txt "torch==2.13.0"
"${PIP[@]}" install -c constraints.txt -c requirements/lock.txt -e ".[dev]"
echo "setup done: $(.venv/bin/python -c 'import llama_index_retrieval_kit as k; print("llama_index_retrieval_kit", k.__version__)')"
