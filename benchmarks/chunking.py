"""Chunking throughput: our parsers vs LlamaIndex's SentenceSplitter / HierarchicalNodeParser.

    python benchmarks/chunking.py [--dataset ../shared/datasets/beir/scifact] [--limit N] [--json PATH]

All parsers run in the same process on the same Documents with the same chunk sizes. Token
counts: our parsers use the embedding model's (MiniLM) tokenizer; SentenceSplitter is run twice,
with its default tokenizer (tiktoken cl100k, bundled with llama-index-core) and with the same
MiniLM tokenizer, so the comparison at equal tokenizer is in the table. Prints one row per
(corpus, parser) with chunks/s and MB/s and the speed ratio to SentenceSplitter.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Callable, List

from llama_index.core import Document
from llama_index.core.node_parser import HierarchicalNodeParser, SentenceSplitter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_index_retrieval_kit import SectionHierarchyNodeParser, SectionWindowNodeParser  # noqa: E402
from llama_index_retrieval_kit.models import DEFAULT_EMBED_MODEL, load_hf_tokenizer  # noqa: E402
from llama_index_retrieval_kit.samples import sample_files  # noqa: E402

DEFAULT_DATASET = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "beir" / "scifact"


def load_beir_documents(folder: Path, limit: int | None) -> List[Document]:
    docs = []
    with gzip.open(folder / "corpus.jsonl.gz", "rt", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            text = f"{row['title']}\n\n{row['text']}" if row.get("title") else row["text"]
            docs.append(Document(text=text, id_=row["_id"], metadata={"doc_id": row["_id"]}))
            if limit and len(docs) >= limit:
                break
    return docs


def sample_documents(copies: int) -> List[Document]:
    base = [f.read_text(encoding="utf-8") for f in sample_files()]
    return [
        Document(text=text, id_=f"sample-{i}-{j}", metadata={"doc_id": f"sample-{i}-{j}"})
        for j in range(copies)
        for i, text in enumerate(base)
    ]


def time_parser(parse: Callable[[List[Document]], list], docs: List[Document], repeats: int) -> tuple[float, int]:
    best, count = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        nodes = parse(docs)
        best = min(best, time.perf_counter() - start)
        count = len(nodes)
    return best, count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", type=Path, default=DEFAULT_DATASET)
    ap.add_argument("--limit", type=int, default=None, help="first N corpus documents only")
    ap.add_argument("--chunk-size", type=int, default=200)
    ap.add_argument("--chunk-overlap", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2, help="best of N runs")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)

    hf = load_hf_tokenizer(DEFAULT_EMBED_MODEL)
    hf_encode = lambda text: hf.encode(text, add_special_tokens=False)  # noqa: E731
    size, overlap = args.chunk_size, args.chunk_overlap
    parsers = {
        "SentenceSplitter (tiktoken)": SentenceSplitter(chunk_size=size, chunk_overlap=overlap),
        "SentenceSplitter (MiniLM tokenizer)": SentenceSplitter(chunk_size=size, chunk_overlap=overlap, tokenizer=hf_encode),
        "SectionWindowNodeParser (MiniLM tokenizer)": SectionWindowNodeParser(chunk_size=size, chunk_overlap=overlap),
        "HierarchicalNodeParser (tiktoken)": HierarchicalNodeParser.from_defaults(chunk_sizes=[1024, 128]),
        "SectionHierarchyNodeParser (MiniLM tokenizer)": SectionHierarchyNodeParser(parent_chunk_size=1024, child_chunk_size=128),
    }
    corpora = {"samples x20": sample_documents(20)}
    if (args.dataset / "corpus.jsonl.gz").exists():
        corpora[args.dataset.name] = load_beir_documents(args.dataset, args.limit)
    else:
        print(f"note: {args.dataset} not found; benchmarking the samples only", file=sys.stderr)

    rows = []
    for corpus_name, docs in corpora.items():
        mb = sum(len(d.text.encode("utf-8")) for d in docs) / 1e6
        for p in parsers.values():  # warm up tokenizers and caches
            p.get_nodes_from_documents(docs[:5])
        base_time = None
        for name, parser in parsers.items():
            seconds, chunks = time_parser(parser.get_nodes_from_documents, docs, args.repeats)
            if name.startswith("SentenceSplitter (MiniLM"):
                base_time = seconds
            rows.append(
                {
                    "corpus": corpus_name,
                    "parser": name,
                    "docs": len(docs),
                    "MB": round(mb, 3),
                    "chunks": chunks,
                    "seconds": round(seconds, 3),
                    "chunks_per_s": round(chunks / seconds, 1),
                    "MB_per_s": round(mb / seconds, 3),
                }
            )
        for row in rows:
            if row["corpus"] == corpus_name:
                row["speed_vs_SentenceSplitter_same_tokenizer"] = round(base_time / row["seconds"], 2) if base_time else None

    keys = list(rows[0])
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    print("  ".join(k.ljust(widths[k]) for k in keys))
    for r in rows:
        print("  ".join(str(r[k]).ljust(widths[k]) for k in keys))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
