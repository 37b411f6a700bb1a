"""Reranking latency on this CPU: ms per query for the real cross-encoder shapes.

    python benchmarks/rerank_latency.py                     # minilm and base, 3 repetitions
    python benchmarks/rerank_latency.py --models all        # + bge-reranker-large (1 repetition, minutes)
    python benchmarks/rerank_latency.py --models minilm --repeats 5 --json PATH

No weights can be downloaded here, so each shape is built from its config with random weights
(the cost of a forward pass depends on the shape, not on the values) and saved to a temporary
folder that every system loads like a downloaded model:

* ``large``: XLMRobertaForSequenceClassification, bge-reranker-large's shape (hidden 1024, 24
  layers, 16 heads, intermediate 4096, vocab 250002, 560M parameters);
* ``base``: the same class at bge-reranker-base's shape (768 / 12 / 12 / 3072, 278M);
* ``minilm``: BertForSequenceClassification at ms-marco-MiniLM-L6-v2's shape (384 / 6 / 12 / 1536,
  vocab 30522, 22.7M).

All use the WordPiece tokenizer of the packaged all-MiniLM-L6-v2 (ids fit every vocabulary).
Each query reranks ``--candidates`` passages whose (query, passage) pair is exactly ``--tokens``
tokens, so every system reads the same tokens. Systems, in the same run on the same inputs:
our :class:`CrossEncoderReranker` (sentence-transformers on PyTorch, the same with ONNX Runtime,
FlagEmbedding) and LlamaIndex's ``SentenceTransformerRerank`` (the ratio baseline) and
``FlagEmbeddingReranker``. One warm-up query of 2 candidates per system, then ``--repeats``
timed queries, interleaved across systems where the shape's weights are under 1.5 GB (loaded
one system at a time above that); the table shows the median.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode  # noqa: E402

from llama_index_retrieval_kit.models import packaged_minilm_path  # noqa: E402
from llama_index_retrieval_kit.postprocessor.rerank import CrossEncoderReranker  # noqa: E402

logger = logging.getLogger("benchmarks.rerank_latency")

SHAPES: Dict[str, Dict[str, Any]] = {
    "minilm": dict(arch="bert", hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536, vocab_size=30522),
    "base": dict(arch="xlm-roberta", hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=250002),
    "large": dict(arch="xlm-roberta", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, vocab_size=250002),
}
LABELS = {"minilm": "MiniLM-L6 cross-encoder", "base": "bge-reranker-base", "large": "bge-reranker-large"}
INTERLEAVE_MAX_BYTES = 1_500_000_000
QUERY = "what is the late payment fee on the card account"
WORDS = (
    "the fee is paid on time each month by the cardholder and interest applies to the balance of the account "
    "when payment is late we charge a fee that the bank sets in the agreement for all cards"
).split()


@dataclass
class Row:
    shape: str
    system: str
    ms_per_query: float
    runs: List[float]
    ratio_to_baseline: Optional[float] = None
    same_top5_as_baseline: Optional[bool] = None
    engine: str = ""


def build_model(shape: str, folder: Path) -> Path:
    """Save a randomly initialised cross-encoder of ``shape`` with the MiniLM tokenizer to ``folder``."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, XLMRobertaConfig, XLMRobertaForSequenceClassification

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    tokenizer = AutoTokenizer.from_pretrained(str(packaged_minilm_path()))
    torch.manual_seed(0)
    if arch == "bert":
        model = BertForSequenceClassification(BertConfig(num_labels=1, max_position_embeddings=512, **spec))
    else:
        config = XLMRobertaConfig(num_labels=1, max_position_embeddings=514, type_vocab_size=1, pad_token_id=tokenizer.pad_token_id, **spec)
        model = XLMRobertaForSequenceClassification(config)
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if arch != "bert":
        # XLM-R has one token type: the tokenizer must not send segment ids (padding is [PAD] = 0 here).
        config_file = folder / "tokenizer_config.json"
        saved = json.loads(config_file.read_text())
        saved["model_input_names"] = ["input_ids", "attention_mask"]
        config_file.write_text(json.dumps(saved))
    return folder


def make_candidates(tokenizer: Any, n: int, tokens: int, seed: int = 0) -> List[NodeWithScore]:
    """``n`` passages whose pair with QUERY is exactly ``tokens`` tokens (each word is one token)."""
    rng = random.Random(seed)
    words = [w for w in WORDS if len(tokenizer(w, add_special_tokens=False)["input_ids"]) == 1]
    query_tokens = len(tokenizer(QUERY, add_special_tokens=False)["input_ids"])
    n_words = tokens - query_tokens - 3  # [CLS] query [SEP] passage [SEP]
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(n_words))
        length = len(tokenizer(QUERY, text)["input_ids"])
        assert length == tokens, f"pair has {length} tokens, expected {tokens}"
        out.append(NodeWithScore(node=TextNode(id_=f"p{i}", text=text), score=1.0 - i / n))
    return out


def systems_for(folder: str, tokens: int, top_n: int, onnx_dir: str, weight_bytes: int) -> Dict[str, Callable[[], Any]]:
    """Name -> factory of a node postprocessor, in table order (baseline first)."""
    import importlib.util

    from llama_index.core.postprocessor import SentenceTransformerRerank

    common = dict(model=folder, top_n=top_n, max_length=tokens, max_candidates=None, device="cpu", section_prefix=False)
    systems: Dict[str, Callable[[], Any]] = {
        "LlamaIndex SentenceTransformerRerank": lambda: SentenceTransformerRerank(model=folder, top_n=top_n, device="cpu"),
        "CrossEncoderReranker sentence_transformers": lambda: CrossEncoderReranker(backend="sentence_transformers", **common),
    }
    if weight_bytes < 2_000_000_000:
        systems["CrossEncoderReranker sentence_transformers onnx"] = lambda: CrossEncoderReranker(
            backend="sentence_transformers", onnx=True, onnx_cache_dir=onnx_dir, **common
        )
    if importlib.util.find_spec("FlagEmbedding") is not None:
        from llama_index.postprocessor.flag_embedding_reranker import FlagEmbeddingReranker

        systems["CrossEncoderReranker flag_embedding"] = lambda: CrossEncoderReranker(backend="flag_embedding", **common)
        systems["LlamaIndex FlagEmbeddingReranker"] = lambda: FlagEmbeddingReranker(model=folder, top_n=top_n, use_fp16=False)
    return systems


def run_query(system: Any, candidates: List[NodeWithScore]) -> tuple[float, List[str]]:
    # LlamaIndex's rerankers overwrite the scores of what they are given: hand each call fresh copies.
    fresh = [NodeWithScore(node=c.node, score=c.score) for c in candidates]
    start = time.perf_counter()
    results = system.postprocess_nodes(fresh, query_bundle=QueryBundle(QUERY))
    return (time.perf_counter() - start) * 1000, [r.node.node_id for r in results]


def load(name: str, factory: Callable[[], Any], warmup: List[NodeWithScore]) -> Any:
    started = time.perf_counter()
    system = factory()
    if isinstance(system, CrossEncoderReranker):
        system.load()
    run_query(system, warmup)
    logger.info("%s ready in %.1f s (%s)", name, time.perf_counter() - started, getattr(system, "engine", "") or "")
    return system


def bench_shape(shape: str, args: argparse.Namespace, workdir: Path) -> List[Row]:
    from transformers import AutoTokenizer

    folder = build_model(shape, workdir / shape)
    weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    candidates = make_candidates(tokenizer, args.candidates, args.tokens)
    repeats = args.large_repeats if shape == "large" else args.repeats
    factories = systems_for(str(folder), args.tokens, args.top_n, str(workdir / "onnx"), weight_bytes)
    if args.systems:
        factories = {k: v for k, v in factories.items() if any(s in k for s in args.systems)}
    runs: Dict[str, List[float]] = {name: [] for name in factories}
    tops: Dict[str, List[str]] = {}
    engines: Dict[str, str] = {}
    if weight_bytes < INTERLEAVE_MAX_BYTES:
        loaded = {name: load(name, f, candidates[:2]) for name, f in factories.items()}
        engines = {name: str(getattr(s, "engine", "") or "") for name, s in loaded.items()}
        for rep in range(repeats):
            for name, system in loaded.items():
                ms, tops[name] = run_query(system, candidates)
                runs[name].append(ms)
                logger.info("%s %s rep %d: %.0f ms", shape, name, rep + 1, ms)
        del loaded
    else:
        for name, factory in factories.items():
            system = load(name, factory, candidates[:2])
            engines[name] = str(getattr(system, "engine", "") or "")
            for rep in range(repeats):
                ms, tops[name] = run_query(system, candidates)
                runs[name].append(ms)
                logger.info("%s %s rep %d: %.0f ms", shape, name, rep + 1, ms)
            del system
            gc.collect()
    gc.collect()
    baseline_name = next(iter(factories))
    baseline = statistics.median(runs[baseline_name])
    rows = []
    for name, values in runs.items():
        median = statistics.median(values)
        rows.append(
            Row(
                shape=shape,
                system=name,
                ms_per_query=median,
                runs=[round(v, 1) for v in values],
                ratio_to_baseline=median / baseline,
                same_top5_as_baseline=tops[name][:5] == tops[baseline_name][:5],
                engine=engines.get(name, ""),
            )
        )
    shutil.rmtree(folder, ignore_errors=True)
    return rows


def print_table(rows: List[Row], args: argparse.Namespace) -> None:
    import torch

    load1, load5, _ = os.getloadavg()
    print(
        f"\n{args.candidates} candidates x {args.tokens} tokens per query, CPU, torch threads {torch.get_num_threads()}, "
        f"{os.cpu_count()} cores, load average now {load1:.1f} / 5 min {load5:.1f}; median of the runs shown"
    )
    print("| model shape | system | ms/query | runs (ms) | vs SentenceTransformerRerank | same top-5 |")
    print("|---|---|---:|---|---:|---|")
    for r in rows:
        runs = ", ".join(f"{v:.0f}" for v in r.runs)
        same = "yes" if r.same_top5_as_baseline else "no"
        print(f"| {LABELS[r.shape]} | {r.system} | {r.ms_per_query:,.0f} | {runs} | {r.ratio_to_baseline:.2f} | {same} |")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="minilm,base", help="comma-separated of minilm, base, large, or 'all' (default: minilm,base)")
    parser.add_argument("--repeats", type=int, default=3, help="timed queries per system (minilm, base)")
    parser.add_argument("--large-repeats", type=int, default=1, help="timed queries per system for large (~35 s each here)")
    parser.add_argument("--candidates", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per (query, passage) pair")
    parser.add_argument("--top-n", type=int, default=5)
    parser.add_argument("--systems", default="", help="comma-separated substrings: only systems whose name contains one")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    models = list(SHAPES) if args.models == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        parser.error(f"unknown model shape(s) {unknown}; allowed: {', '.join(SHAPES)} or all")
    for name in ("repeats", "large_repeats", "candidates", "tokens", "top_n"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("sentence_transformers", "transformers", "fusion_base", "onnx_model", "onnx_model_bert", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    rows: List[Row] = []
    with tempfile.TemporaryDirectory(prefix="rerank_latency_") as tmp:
        for shape in models:
            rows.extend(bench_shape(shape, args, Path(tmp)))
    print_table(rows, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
