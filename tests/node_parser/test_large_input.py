"""Large and pathological input: chunk length bounded in characters, tokenization in bounded
pieces, memory that does not grow with the text like the text's tokens did."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core import Document

from llama_index_retrieval_kit import SectionHierarchyNodeParser, SectionWindowNodeParser
from llama_index_retrieval_kit.models import DEFAULT_EMBED_MODEL, load_hf_tokenizer
from llama_index_retrieval_kit.node_parser.tokenization import hf_batch_token_spans, piece_bounds
from llama_index_retrieval_kit.node_parser.windows import (
    TokenSpans,
    Window,
    limit_window_chars,
    plan_windows,
    split_at_whitespace,
)

REPO = Path(__file__).resolve().parents[2]


def _check_chunks(text: str, nodes: list, max_chars: int) -> None:
    """Exact offsets, the character limit, unique ids, every non-space character covered."""
    covered = bytearray(len(text))
    for node in nodes:
        m = node.metadata
        assert text[m["char_start"] : m["char_end"]] == node.text
        assert (node.start_char_idx, node.end_char_idx) == (m["char_start"], m["char_end"])
        assert 0 < len(node.text) <= max_chars
        covered[m["char_start"] : m["char_end"]] = b"\x01" * (m["char_end"] - m["char_start"])
    assert all(covered[i] for i, c in enumerate(text) if not c.isspace())
    assert len({n.node_id for n in nodes}) == len(nodes)


def test_one_megabyte_word_is_cut_into_bounded_chunks() -> None:
    word = "abcdefghij" * 100_000
    text = "Intro sentence before the blob.\n" + word + " and some words after it."
    parser = SectionWindowNodeParser()
    nodes = parser.get_nodes_from_documents([Document(text=text, id_="blob")])
    limit = parser.chunk_char_limit(parser.chunk_size)
    assert limit == 2000
    _check_chunks(text, nodes, limit)
    # The word is cut hard (no whitespace in it), into about len/limit chunks, not repeated.
    assert sum(len(n.text) for n in nodes) < len(text) * 1.01
    assert nodes[0].text.startswith("Intro sentence") and nodes[-1].text.endswith("after it.")


def test_explicit_max_chunk_chars_and_serialisation() -> None:
    parser = SectionWindowNodeParser(max_chunk_chars=300)
    assert SectionWindowNodeParser.from_dict(parser.to_dict()).max_chunk_chars == 300
    text = ("word " * 100 + "x" * 1000 + "\n") * 3
    _check_chunks(text, parser.get_nodes_from_documents([Document(text=text, id_="d")]), 300)
    with pytest.raises(ValueError, match="max_chunk_chars"):
        SectionWindowNodeParser(max_chunk_chars=0)


def test_hierarchy_bounds_parents_and_children() -> None:
    text = "1. Data\n" + "y" * 50_000 + " tail words here.\n2. More\nShort section text."
    parser = SectionHierarchyNodeParser(parent_chunk_size=256, child_chunk_size=64, child_chunk_overlap=8)
    parents, children = parser.split_document(Document(text=text, id_="h"))
    assert max(len(p.text) for p in parents) <= 2560 and max(len(c.text) for c in children) <= 640
    for child in children:
        m = child.metadata
        assert m["parent_char_start"] <= m["char_start"] and m["char_end"] <= m["parent_char_end"]
        assert text[m["char_start"] : m["char_end"]] == child.text


RUN = st.text(alphabet="abcxyz", min_size=50, max_size=3000)
WORD = st.text(alphabet="abcdefgh.,", min_size=1, max_size=12)
GAP = st.sampled_from([" ", "\n", "  ", "\n\n", "\t", " " * 300])
PIECES = st.lists(st.one_of(RUN, WORD, WORD, GAP, st.just("1. Heading\n")), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=PIECES, max_chars=st.integers(20, 400), size=st.integers(4, 40))
def test_every_chunk_fits_max_chunk_chars(pieces: list[str], max_chars: int, size: int) -> None:
    text = "".join(pieces)
    parser = SectionWindowNodeParser(chunk_size=size, chunk_overlap=size // 4, max_chunk_chars=max_chars)
    nodes = parser.get_nodes_from_documents([Document(text=text, id_="p")])
    if text.strip():
        assert nodes
    _check_chunks(text, nodes, max_chars)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab \n\t", max_size=400), start=st.integers(0, 50), max_chars=st.integers(1, 60))
def test_split_at_whitespace_tiles_and_bounds(text: str, start: int, max_chars: int) -> None:
    start = min(start, len(text))
    pieces = split_at_whitespace(text, start, len(text), max_chars)
    assert "".join(text[a:b] for a, b in pieces) == text[start:]
    assert all(0 < b - a <= max_chars for a, b in pieces)
    for a, b in pieces[:-1]:  # a cut inside a word only where the word fills the whole piece
        if not text[b - 1].isspace():
            assert not any(c.isspace() for c in text[a:b])


def test_limit_window_chars_does_not_repeat_overlap_of_long_windows() -> None:
    text = "x" * 100
    windows = [Window(0, 80, 2), Window(40, 100, 2)]  # overlapping windows, both too long
    out = limit_window_chars(text, windows, 30, [0, 40])
    assert [(w.start, w.end) for w in out] == [(0, 30), (30, 60), (60, 80), (80, 100)]
    # A window inside the pieces of a cut one (the planner can end two windows at one token)
    # is dropped rather than repeated with the same span.
    out = limit_window_chars(text, [Window(0, 90, 4), Window(50, 90, 1), Window(90, 100, 1)], 50, [0, 50, 90])
    assert [(w.start, w.end) for w in out] == [(0, 50), (50, 90), (90, 100)]


@settings(max_examples=40, deadline=None)
@given(words=st.lists(st.text(alphabet="abcdeéz中.,!0123", min_size=1, max_size=15), min_size=1, max_size=150),
       gaps=st.lists(st.sampled_from([" ", "\n", "\n\n", " \t"]), min_size=150, max_size=150))
def test_pieces_give_the_same_tokens_as_the_whole_text(words: list[str], gaps: list[str]) -> None:
    text = "".join(w + g for w, g in zip(words, gaps))
    tokenizer = load_hf_tokenizer(DEFAULT_EMBED_MODEL)
    whole = hf_batch_token_spans(tokenizer, piece_chars=10**9)([text, text[:50]])
    pieces = hf_batch_token_spans(tokenizer, piece_chars=64, batch_chars=200)([text, text[:50]])
    assert pieces == whole


def test_piece_bounds_prefers_newlines_then_spaces_then_hard_cuts() -> None:
    text = "aaaa bbbb\ncccc dddd eeee" + "z" * 40
    bounds = list(piece_bounds(text, 16))
    assert bounds[0] == (0, 10)  # after the newline
    assert "".join(text[a:b] for a, b in bounds) == text
    assert all(b - a <= 16 for a, b in bounds)
    with pytest.raises(ValueError, match="max_chars must be >= 2, got 1"):
        list(piece_bounds(text, 1))


def test_token_spans_are_compact_and_behave_as_a_sequence() -> None:
    spans = TokenSpans.from_pairs([(0, 3), (4, 9)], 10)
    assert spans.starts.itemsize == 4 and list(spans) == [(0, 3), (4, 9)] and spans[1] == (4, 9)
    assert spans == [(0, 3), (4, 9)] and len(spans[1:]) == 1
    windows = plan_windows("abc defgh.", spans, chunk_size=1)
    assert [(w.start, w.end) for w in windows] == [(0, 4), (4, 10)]


MEMORY_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from llama_index_retrieval_kit import SectionWindowNodeParser, TextFileReader
    parser = SectionWindowNodeParser()
    parser.count_tokens("warm up")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    docs = TextFileReader().load_data(sys.argv[1])
    nodes = parser.get_nodes_from_documents(docs)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"base_kib": base, "peak_kib": peak, "chunks": len(nodes)}))
    """
)


def test_peak_memory_of_a_5_mb_file_is_bounded(tmp_path: Path) -> None:
    """Reading and chunking 5 MB took 700 MB over the baseline when the whole text was
    tokenized in one call; in bounded pieces it takes under 100 MB (bound: 300 MB)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from large_files import prose
    finally:
        sys.path.pop(0)
    path = tmp_path / "big.txt"
    path.write_text(prose(5 * 1024 * 1024), encoding="utf-8")
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, str(path)], capture_output=True, text=True, timeout=600, check=True
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    growth_mib = (report["peak_kib"] - report["base_kib"]) / 1024
    assert report["chunks"] > 5000
    assert growth_mib < 300, f"peak RSS grew {growth_mib:.0f} MiB while chunking 5 MB"


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=300))
def test_tokenizer_json_gives_the_spans_of_the_transformers_tokenizer(text: str) -> None:
    from llama_index_retrieval_kit.models import load_backend_tokenizer

    via_transformers = hf_batch_token_spans(load_hf_tokenizer(DEFAULT_EMBED_MODEL))([text, text.upper()])
    via_file = hf_batch_token_spans(load_backend_tokenizer(DEFAULT_EMBED_MODEL))([text, text.upper()])
    assert via_file == via_transformers


def test_chunking_with_the_default_tokenizer_imports_neither_torch_nor_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from llama_index.core import Document\n"
        "from llama_index_retrieval_kit.node_parser import SectionWindowNodeParser\n"
        "nodes = SectionWindowNodeParser().get_nodes_from_documents([Document(text='# A\\n\\nSome text. ' * 50)])\n"
        "assert nodes\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
