"""Randomized crash test: kill -9 an index writer at random moments, many times, and check that
the folder always reopens consistent at the state before or after the write in flight.

    python benchmarks/kill_test.py --trials 200

Prints a table (trials, outcomes, writes committed before the kill). The suite runs a few trials
of the same code (tests/indices/test_kill_random.py).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm.auto import tqdm  # noqa: E402

from tests.indices import _kill  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100, help="kills (default: %(default)s)")
    parser.add_argument("--max-wait", type=float, default=2.5, help="kill within this many seconds of the child starting")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = _kill.new_folder(Path(tmp) / "index")
        with tqdm(total=args.trials, desc="kill -9 trials") as bar:
            trials = _kill.run_trials(folder, args.trials, seed=args.seed, max_wait_s=args.max_wait, progress=bar)
    outcomes = collections.Counter(t.outcome for t in trials)
    committed = sorted(t.committed for t in trials)
    print(f"| trials | consistent | reopened before the write in flight | after it | writes committed per trial (min / median / max) | minutes |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {len(trials)} | {len(trials)} | {outcomes['before']} | {outcomes['after']} | "
        f"{committed[0]} / {committed[len(committed) // 2]} / {committed[-1]} | {(time.perf_counter() - started) / 60:.1f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
