"""copy_node / copy_metadata: equal copies that share nothing mutable with the index's nodes."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode

from llama_index_retrieval_kit.retrievers.node_copy import copy_metadata, copy_node

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8))
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)),
    max_leaves=20,
)
metadata_st = st.dictionaries(st.text(min_size=1, max_size=6), json_values, max_size=8)


def _containers(value: Any) -> list:
    """Every list and dict inside ``value`` (itself included)."""
    found = []
    if isinstance(value, (list, dict)):
        found.append(value)
        for item in value.values() if isinstance(value, dict) else value:
            found.extend(_containers(item))
    return found


@given(metadata=metadata_st)
def test_copy_is_equal_and_shares_no_container(metadata: dict) -> None:
    copied = copy_metadata(metadata)
    assert copied == metadata
    originals = {id(c) for c in _containers(metadata)}
    assert not originals & {id(c) for c in _containers(copied)}


@given(metadata=metadata_st)
def test_changing_a_node_copy_leaves_the_node_alone(metadata: dict) -> None:
    node = TextNode(id_="n1", text="original text", metadata=metadata)
    node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id="doc-1", metadata=metadata, hash="h")
    node.relationships[NodeRelationship.CHILD] = [RelatedNodeInfo(node_id="c-1", metadata=metadata)]
    before = node.to_dict()
    copied = copy_node(node)
    assert copied is not node and type(copied) is type(node)
    assert copied.to_dict() == before and copied.hash == node.hash
    assert "metadata" in copied.__pydantic_fields_set__
    copied.text = "changed"
    copied.metadata["added"] = 1
    source = copied.relationships[NodeRelationship.SOURCE]
    assert type(source) is RelatedNodeInfo and source.__pydantic_fields_set__ == node.relationships[NodeRelationship.SOURCE].__pydantic_fields_set__
    source.node_id, source.hash = "changed", "changed"
    source.metadata["added"] = 1
    for container in _containers(source.metadata)[1:] + _containers(copied.relationships[NodeRelationship.CHILD][0].metadata)[1:]:
        if isinstance(container, list):
            container.append("x")
        else:
            container["x"] = "x"
    copied.relationships[NodeRelationship.CHILD][0].node_id = "changed"
    copied.relationships[NodeRelationship.CHILD].append(RelatedNodeInfo(node_id="c-2"))
    copied.relationships[NodeRelationship.NEXT] = RelatedNodeInfo(node_id="n2")
    del copied.relationships[NodeRelationship.SOURCE]
    copied.excluded_embed_metadata_keys.append("added")
    copied.excluded_llm_metadata_keys.append("added")
    for container in _containers(copied.metadata)[1:]:
        if isinstance(container, list):
            container.append("x")
        else:
            container["x"] = "x"
    assert node.to_dict() == before


def test_unknown_metadata_values_are_deep_copied() -> None:
    class Box:
        def __init__(self) -> None:
            self.items = [1]

    box = Box()
    original = {"box": box, "tuple": ([1], "a")}
    copied = copy_metadata(original)
    assert copied["box"] is not box and copied["box"].items == [1] and copied["box"].items is not box.items
    assert copied["tuple"] == ([1], "a") and copied["tuple"][0] is not original["tuple"][0]
    copied["tuple"][0].append(2)
    assert original["tuple"][0] == [1]


@given(metadata=metadata_st)
def test_copy_node_builds_what_pydantics_shallow_copy_builds(metadata: dict) -> None:
    """The hand-built copy equals ``model_copy()`` in every pydantic slot (dict, fields-set, extra,
    private), for the node classes an index holds, and owns its fields-set."""
    from llama_index.core.schema import Document, IndexNode

    for node in (
        TextNode(id_="n1", text="t", metadata=metadata, start_char_idx=3, end_char_idx=9),
        Document(id_="d1", text="doc", metadata=metadata),
        IndexNode(id_="i1", text="index node", index_id="other", metadata=metadata),
    ):
        copied, reference = copy_node(node), node.model_copy()
        assert type(copied) is type(node) and copied.model_dump() == reference.model_dump() == node.model_dump()
        assert copied.__pydantic_extra__ == reference.__pydantic_extra__
        assert copied.__pydantic_private__ == reference.__pydantic_private__
        assert copied.__pydantic_fields_set__ == reference.__pydantic_fields_set__ | {"metadata"}
        assert copied.__pydantic_fields_set__ is not node.__pydantic_fields_set__
        assert copied.__dict__ is not node.__dict__ and copied.metadata is not node.metadata


def test_trusted_fused_results_equal_validated_ones() -> None:
    from llama_index_retrieval_kit.retrievers.fusion import FusedNodeWithScore

    node = TextNode(id_="n1", text="t", metadata={"page": 2})
    ranks, scores = {"bm25": 1, "dense": 4}, {"bm25": 3.5, "dense": 0.25}
    trusted = FusedNodeWithScore.trusted(node, 0.75, ranks, scores)
    checked = FusedNodeWithScore(node=node, score=0.75, leg_ranks=ranks, leg_scores=scores)
    assert trusted == checked and trusted.model_dump() == checked.model_dump() and trusted.to_dict() == checked.to_dict()
    assert trusted.__pydantic_fields_set__ == checked.__pydantic_fields_set__
    assert trusted.get_content() == "t" and trusted.node_id == "n1"


def test_a_documents_media_resources_are_copied() -> None:
    """``Document.text_resource`` (a pydantic ``MediaResource``) and the other resources: the copy
    has its own, so that editing a result's resource leaves the index's node alone."""
    from llama_index.core.schema import Document, MediaResource

    doc = Document(id_="D", text="annual fee is 95 dollars", metadata={"doc_id": "D"})
    doc.image_resource = MediaResource(url="http://example.org/a.png", embeddings={"dense": [0.1, 0.2]})
    before = doc.to_dict()
    copied = copy_node(doc)
    assert copied.to_dict() == before and copied.text == doc.text and copied.hash == doc.hash
    copied.text_resource.text = "overwritten"
    copied.image_resource.embeddings["dense"].append(0.3)
    copied.image_resource.embeddings["sparse"] = [1.0]
    assert doc.to_dict() == before and doc.text == "annual fee is 95 dollars"


def test_other_node_classes_fields_are_copied_and_references_shared() -> None:
    from llama_index.core.schema import ImageNode, IndexNode

    image = ImageNode(id_="i", text="caption", image_url="http://example.org/a.png", text_embedding=[0.5, 0.25])
    copied = copy_node(image)
    copied.text_embedding.append(1.0)
    assert image.text_embedding == [0.5, 0.25] and copied.image_url == image.image_url

    target = object()  # IndexNode.obj: a reference to another retriever or engine, never copied
    index_node = IndexNode(id_="x", text="summary", index_id="other", obj=target)
    assert copy_node(index_node).obj is target
