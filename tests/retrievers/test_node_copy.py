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
    node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id="doc-1")
    before = node.to_dict()
    copied = copy_node(node)
    assert copied is not node and type(copied) is type(node)
    assert copied.to_dict() == before and copied.hash == node.hash
    assert "metadata" in copied.__pydantic_fields_set__
    copied.text = "changed"
    copied.metadata["added"] = 1
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
