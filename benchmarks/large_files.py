"""Peak memory and time to read and chunk large text files (TextFileReader + SectionWindowNodeParser).

    nice -n 10 python benchmarks/large_files.py [--sizes 5,10,20,50] [--mem-limit-gib 4]
        [--kind prose|lines|unbroken] [--keep DIR]

Each size runs in its own child process, so one size's memory never pollutes another's. The
child writes a deterministic text of the given size (seed 0; prose of 8-30-word sentences in
paragraphs, with no headings, so the whole file is one section: the worst case for the window
planner), then reads it with ``TextFileReader`` and chunks it with the default
``SectionWindowNodeParser().get_nodes_from_documents``. It reports its peak RSS (the kernel's
``ru_maxrss``), the RSS after imports (the baseline: Python, LlamaIndex, the tokenizer), the
wall time of read + chunk and the chunk count. The parent samples the child's RSS every 50 ms
(psutil) and kills it past ``--mem-limit-gib``, reporting the size as aborted.

``--kind lines`` writes short log-like lines with numbers instead (about 2.6 times the tokens
per byte of prose, and a line every 30 characters: the worst case for heading detection).
``--kind unbroken`` writes one long run without whitespace instead (a word the tokenizer maps to
one ``[UNK]`` token), which checks the character limit on chunks (``max_chunk_chars``).

Measured on a 2-core shared VM (Python 3.11, tokenizers 0.23; baseline after imports 686 MiB):

    prose      5 MiB   6,209 chunks   peak   748 MiB    3.5 s
    prose     10 MiB  12,419 chunks   peak   800 MiB    7.4 s
    prose     20 MiB  24,851 chunks   peak   891 MiB   17.1 s
    prose     50 MiB  62,086 chunks   peak 1,121 MiB   41.0 s
    lines     50 MiB 101,453 chunks   peak 1,332 MiB   62.1 s
    unbroken  50 MiB  26,216 chunks   peak   889 MiB   18.9 s   (every chunk <= 2,000 chars)

Before the text was tokenized in bounded pieces (the whole text went to the Rust tokenizer in
one call and its spans were kept as Python tuples), prose peaked at 1,357 MiB for 5 MiB and
passed 6 GiB for 50 MiB; the unbroken 1 MB run became a single 1,000,000-character chunk.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

logger = logging.getLogger("large_files")

MIB = 1024 * 1024
WORDS = (
    "the card fee interest annual rate payment is of to a charged daily billing statement cardholder "
    "account balance credit limit days within notice agreement bank may will any each must under "
    "purchase cash advance transfer minimum due date late returned penalty promotional period"
).split()


def prose(size_bytes: int, seed: int = 0) -> str:
    """Deterministic English-like prose of ``size_bytes`` ASCII characters, no headings."""
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < size_bytes:
        sentences = []
        for _ in range(rng.randint(3, 8)):
            words = rng.choices(WORDS, k=rng.randint(8, 30))
            sentences.append(" ".join(words).capitalize() + rng.choice(".!?;") + (" %d%%" % rng.randint(1, 99)))
        para = " ".join(sentences) + "\n\n"
        parts.append(para)
        total += len(para)
    return "".join(parts)[:size_bytes]


def short_lines(size_bytes: int, seed: int = 0) -> str:
    """Deterministic log-like text: short lines with numbers (many lines, many tokens per byte)."""
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < size_bytes:
        line = "id %d, amount %d, status %s\n" % (rng.randint(1, 10**6), rng.randint(1, 999), rng.choice(WORDS))
        parts.append(line)
        total += len(line)
    return "".join(parts)[:size_bytes]


def unbroken(size_bytes: int) -> str:
    """One word of ``size_bytes`` letters (no whitespace at all)."""
    return ("abcdefghij" * (size_bytes // 10 + 1))[:size_bytes]


def child(path: str) -> dict:
    """Read and chunk ``path`` in this process; return the measurements."""
    from llama_index_retrieval_kit import SectionWindowNodeParser, TextFileReader

    parser = SectionWindowNodeParser()
    parser.count_tokens("warm up the tokenizer")
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    docs = TextFileReader().load_data(path)
    nodes = parser.get_nodes_from_documents(docs)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    text = docs[0].text
    exact = all(text[n.metadata["char_start"] : n.metadata["char_end"]] == n.text for n in nodes)
    return {
        "chars": len(text),
        "chunks": len(nodes),
        "max_chunk_chars": max((len(n.text) for n in nodes), default=0),
        "offsets_exact": exact,
        "baseline_rss": baseline,
        "peak_rss": peak,
        "seconds": seconds,
    }


def run_size(size_mib: float, kind: str, mem_limit: int, folder: Path) -> dict:
    """Write the file, measure it in a child process, and return the child's report."""
    import psutil

    path = folder / f"{kind}_{size_mib:g}mb.txt"
    if not path.exists():
        make = {"prose": prose, "lines": short_lines, "unbroken": unbroken}[kind]
        path.write_text(make(int(size_mib * MIB)), encoding="utf-8")
    cmd = [sys.executable, __file__, "--child", str(path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    ps = psutil.Process(proc.pid)
    seen = 0
    while proc.poll() is None:
        try:
            seen = max(seen, ps.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        if seen > mem_limit:
            proc.kill()
            proc.wait()
            return {"size_mib": size_mib, "aborted": True, "peak_rss": seen}
        time.sleep(0.05)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise RuntimeError(f"child for {path} failed with exit code {proc.returncode}")
    report = json.loads(out.strip().splitlines()[-1])
    report["size_mib"] = size_mib
    return report


def table(rows: list[dict]) -> str:
    """A Markdown table of the reports."""
    head = "| file | chars | chunks | max chunk chars | baseline RSS | peak RSS | seconds | offsets exact |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        if r.get("aborted"):
            lines.append(f"| {r['size_mib']:g} MiB | | | | | aborted past {r['peak_rss'] / MIB:,.0f} MiB | | |")
            continue
        lines.append(
            f"| {r['size_mib']:g} MiB | {r['chars']:,} | {r['chunks']:,} | {r['max_chunk_chars']:,} | "
            f"{r['baseline_rss'] / MIB:,.0f} MiB | {r['peak_rss'] / MIB:,.0f} MiB | {r['seconds']:.1f} | "
            f"{r['offsets_exact']} |"
        )
    return "\n".join(lines)


def parse_sizes(value: str) -> list[float]:
    """``"5,10,20"`` -> ``[5.0, 10.0, 20.0]``; names the bad entry."""
    sizes = []
    for part in value.split(","):
        try:
            size = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"size {part!r} is not a number of MiB; pass e.g. --sizes 5,10,20") from None
        if size <= 0:
            raise argparse.ArgumentTypeError(f"size {part!r} must be positive")
        sizes.append(size)
    return sizes


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=parse_sizes, default=parse_sizes("5,10,20,50"), help="file sizes in MiB")
    ap.add_argument("--kind", choices=("prose", "lines", "unbroken"), default="prose")
    ap.add_argument("--mem-limit-gib", type=float, default=4.0, help="kill a child past this RSS")
    ap.add_argument("--keep", type=Path, default=None, help="folder for the generated files (kept)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for size in args.sizes:
            rows.append(run_size(size, args.kind, int(args.mem_limit_gib * 1024 * MIB), folder))
            logger.info("%s", json.dumps(rows[-1]))
    sys.stdout.write(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
