"""SectionHierarchyNodeParser: parents contain children; works with AutoMergingRetriever."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.node_parser import get_leaf_nodes, get_root_nodes
from llama_index.core.retrievers import AutoMergingRetriever
from llama_index.core.schema import NodeRelationship

from llama_index_retrieval_kit import SectionHierarchyNodeParser
from llama_index_retrieval_kit.models import default_embed_model
from llama_index_retrieval_kit.samples import sample_files

from .test_section_window import documents


@settings(max_examples=60, deadline=None)
@given(text=documents(), child=st.integers(6, 30), parent_factor=st.integers(1, 5))
def test_parents_contain_their_children(text: str, child: int, parent_factor: int) -> None:
    parser = SectionHierarchyNodeParser(
        child_chunk_size=child, child_chunk_overlap=child // 4, parent_chunk_size=child * parent_factor, min_chunk_tokens=3
    )
    nodes = parser.get_nodes_from_documents([Document(text=text, id_="d")])
    by_id = {n.node_id: n for n in nodes}
    parents, leaves = get_root_nodes(nodes), get_leaf_nodes(nodes)
    assert {n.metadata["node_kind"] for n in parents} <= {"parent"}
    assert {n.metadata["node_kind"] for n in leaves} <= {"chunk", "parent"}
    for leaf in leaves:
        if leaf.metadata["node_kind"] == "parent":
            continue
        parent = by_id[leaf.relationships[NodeRelationship.PARENT].node_id]
        pm, cm = parent.metadata, leaf.metadata
        assert pm["char_start"] <= cm["char_start"] and cm["char_end"] <= pm["char_end"]
        assert leaf.text in parent.text and cm["parent_text"] == parent.text
        assert cm["parent_id"] == parent.node_id and cm["section_path"] == pm["section_path"]
        assert leaf.node_id in {c.node_id for c in parent.child_nodes}
        assert parser.count_tokens(leaf.text) <= child
        assert text[cm["char_start"] : cm["char_end"]] == leaf.text
    for parent in parents:
        assert parser.count_tokens(parent.text) <= child * parent_factor
        assert text[parent.metadata["char_start"] : parent.metadata["char_end"]] == parent.text
    # Every non-space character is in some parent and some child.
    for kind in ("parent", "chunk"):
        covered = set()
        for n in nodes:
            if n.metadata["node_kind"] == kind:
                covered.update(range(n.metadata["char_start"], n.metadata["char_end"]))
        assert all(k in covered for k, c in enumerate(text) if not c.isspace())


def test_auto_merging_retriever_merges_children_into_sections() -> None:
    doc = Document(text=sample_files()[2].read_text(), id_="policy", metadata={"doc_id": "policy"})
    parser = SectionHierarchyNodeParser(child_chunk_size=48, child_chunk_overlap=0, parent_chunk_size=1024)
    nodes = parser.get_nodes_from_documents([doc])
    leaves = get_leaf_nodes(nodes)
    storage = StorageContext.from_defaults()
    storage.docstore.add_documents(nodes)
    index = VectorStoreIndex(leaves, storage_context=storage, embed_model=default_embed_model())
    retriever = AutoMergingRetriever(index.as_retriever(similarity_top_k=12), storage, simple_ratio_thresh=0.3)
    results = retriever.retrieve("How long is account data kept after I ask for deletion?")
    kinds = {r.node.metadata["node_kind"] for r in results}
    assert "parent" in kinds, "AutoMergingRetriever should have merged children into a parent section"
    merged = next(r.node for r in results if r.node.metadata["node_kind"] == "parent")
    assert merged.metadata["section_title"].startswith("Section")


def test_bad_sizes_are_named() -> None:
    with pytest.raises(ValueError, match=r"child_chunk_size \(512\) must not exceed parent_chunk_size \(256\)"):
        SectionHierarchyNodeParser(child_chunk_size=512, parent_chunk_size=256)


def test_round_trip() -> None:
    parser = SectionHierarchyNodeParser(child_chunk_size=64, parent_chunk_size=512)
    loaded = SectionHierarchyNodeParser.from_dict(parser.to_dict())
    assert (loaded.child_chunk_size, loaded.parent_chunk_size) == (64, 512)
