"""Execute the notebooks and store their outputs (or check that the stored outputs are current).

The notebooks in ``notebooks/`` are committed *with* their outputs, so they can be read on GitHub
or in any viewer without running them. This script is the one way those outputs are written:

    .venv/bin/python scripts/execute_notebooks.py                      # every notebook
    .venv/bin/python scripts/execute_notebooks.py notebooks/04_*.ipynb # some
    .venv/bin/python scripts/execute_notebooks.py --check              # run, compare, write nothing

Each notebook runs top to bottom in a fresh kernel (the ``python3`` kernel of this environment)
with a temporary directory as its working directory, so nothing is written into the repository
except the notebook itself. The script records in the notebook's metadata a digest of its code
cells (``metadata["rkit"]["code_sha256"]``); ``tests/test_notebooks.py`` executes every notebook
again and fails when the stored outputs are stale (see :func:`staleness`). docs/notebooks.md
explains the choice.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
KERNEL = "python3"
CELL_TIMEOUT_S = 600
MAX_NOTEBOOK_BYTES = 150_000  # stored outputs included; figures are saved at ~70 dpi to stay under it
METADATA_KEY = "rkit"


def notebooks() -> List[Path]:
    """The walkthroughs, in reading order."""
    return sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def code_sha256(nb: Any) -> str:
    """Digest of the code cells' sources: the stored outputs belong to exactly this code."""
    sources = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    return hashlib.sha256(json.dumps(sources).encode("utf-8")).hexdigest()


def output_kind(output: Any) -> Tuple[str, ...]:
    """What an output is, without its content: ``("stream", "stdout")``, ``("display_data", "image/png", "text/plain")``."""
    kind = output.get("output_type")
    if kind == "stream":
        return (kind, output.get("name", ""))
    if kind == "error":
        return (kind, output.get("ename", ""))
    return (kind, *sorted(output.get("data", {})))


def structure(nb: Any) -> List[Tuple[Tuple[str, ...], ...]]:
    """Per code cell, the sequence of its output kinds (consecutive streams of one name count once)."""
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kinds: List[Tuple[str, ...]] = []
        for output in cell.get("outputs", []):
            kind = output_kind(output)
            if not (kinds and kind[0] == "stream" and kinds[-1] == kind):
                kinds.append(kind)
        cells.append(tuple(kinds))
    return cells


def execute(path: Path, timeout: int = CELL_TIMEOUT_S) -> Tuple[Any, float]:
    """Run a copy of the notebook at ``path`` in a fresh kernel; return it and the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix=f"nb-{path.stem}-") as workdir:
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name=KERNEL,
            resources={"metadata": {"path": workdir}},
            record_timing=False,
            coalesce_streams=True,
        )
        started = time.perf_counter()
        client.execute()
        seconds = time.perf_counter() - started
    return nb, seconds


def staleness(stored: Any, fresh: Any) -> List[str]:
    """Why the outputs stored in ``stored`` do not belong to its code, given a ``fresh`` run of it.

    Empty when they are current: the code digest recorded by this script matches the code cells,
    every code cell was executed in order in one run (execution counts 1, 2, 3, ...), and each
    code cell has the same sequence of output kinds as in the fresh run (a cell that printed or
    plotted in the fresh run has that output stored, and nothing else).
    """
    problems: List[str] = []
    recorded = stored.metadata.get(METADATA_KEY, {}).get("code_sha256")
    if recorded != code_sha256(stored):
        problems.append("the code cells changed since the outputs were stored" if recorded else "no outputs stored by the script")
    code = [cell for cell in stored.cells if cell.cell_type == "code"]
    counts = [cell.get("execution_count") for cell in code]
    if counts != list(range(1, len(code) + 1)):
        problems.append(f"execution counts are {counts}, not 1..{len(code)} from one top-to-bottom run")
    old, new = structure(stored), structure(fresh)
    for number, (a, b) in enumerate(zip(old, new), 1):
        if a != b:
            problems.append(f"code cell {number}: stored outputs {list(a)}, a fresh run gives {list(b)}")
    if len(old) != len(new):  # pragma: no cover - same file, same cells
        problems.append(f"{len(old)} code cells stored, {len(new)} run")
    return problems


def errors(nb: Any) -> List[str]:
    """The error outputs of an executed notebook, as ``cell N: Ename: message``."""
    found = []
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    for number, cell in enumerate(code, 1):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                found.append(f"code cell {number}: {output.get('ename')}: {output.get('evalue')}")
    return found


def store(path: Path, nb: Any) -> int:
    """Write the executed notebook back to ``path`` with its code digest; return its size in bytes."""
    nb.metadata[METADATA_KEY] = {"code_sha256": code_sha256(nb), "written_by": "scripts/execute_notebooks.py"}
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.validate(nb)
    text = nbformat.writes(nb) + "\n"
    path.write_text(text, encoding="utf-8")
    return len(text.encode("utf-8"))


def _resolve(names: Iterable[str]) -> List[Path]:
    paths = []
    for name in names:
        path = Path(name)
        if not path.exists() and (NOTEBOOK_DIR / name).exists():
            path = NOTEBOOK_DIR / name
        if not path.is_file() or path.suffix != ".ipynb":
            raise SystemExit(f"execute_notebooks: {name}: no such notebook")
        paths.append(path.resolve())
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="notebook files (default: notebooks/[0-9][0-9]_*.ipynb)")
    parser.add_argument("--check", action="store_true", help="execute and compare with the stored outputs; write nothing")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds per cell (default %(default)s)")
    args = parser.parse_args(argv)
    paths = _resolve(args.notebooks) if args.notebooks else notebooks()
    failed = 0
    for path in paths:
        name = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        try:
            fresh, seconds = execute(path, timeout=args.timeout)
        except CellExecutionError as exc:
            print(f"{name}: FAILED (not written)\n{exc}")
            failed += 1
            continue
        problems = errors(fresh)
        if args.check:
            problems += staleness(nbformat.read(path, as_version=4), fresh)
            status = "current" if not problems else "STALE"
        elif problems:
            status = "FAILED (not written)"
        else:
            size = store(path, fresh)
            status = f"written, {size / 1000:.0f} KB" + (f" (over {MAX_NOTEBOOK_BYTES // 1000} KB: shrink its figures)" if size > MAX_NOTEBOOK_BYTES else "")
        print(f"{name}: {seconds:.1f} s, {status}")
        for problem in problems:
            print(f"  {problem}")
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
