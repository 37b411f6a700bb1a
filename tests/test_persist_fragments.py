"""Persisting from cached per-item JSON writes exactly the bytes of the one-shot serialisation.

* ``_json_fragments``: a list or dict joined from its items' encodings equals ``json.dumps``;
  a ``FragmentCache`` entry is served only for the object it was made from.
* ``BM25Retriever.persist``: over random inserts, replacements, deletes, roll-backs and reloads,
  nodes.json is ``json.dumps([doc_to_json(n) ...], ensure_ascii=False)`` of the indexed nodes
  (what persist wrote before the cache), and loading it gives back the same nodes.
* ``IndexDocumentStore``/``FragmentCachingKVStore``: over random writes and reads (reads whose
  results the caller then changes at every depth), the file is byte-identical to a plain
  ``SimpleDocumentStore`` given the same writes, locally and on an fsspec memory filesystem.
* A ``HybridIndex`` after upserts and deletes: its committed files re-serialise, through plain
  LlamaIndex and ``json``, to the same bytes.
"""

from __future__ import annotations

import json
import pickle
import tempfile
import uuid
from pathlib import Path
from typing import Any, Dict, List, Tuple

import fsspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode
from llama_index.core.storage.docstore import SimpleDocumentStore
from llama_index.core.storage.docstore.utils import doc_to_json

from llama_index_retrieval_kit._json_fragments import FragmentCache, dict_item_json, dict_key_json
from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.indices import storage as index_storage
from llama_index_retrieval_kit.indices.docstore import FragmentCachingKVStore, IndexDocumentStore, private_copy
from llama_index_retrieval_kit.retrievers.bm25 import BM25Retriever, persisted_node_json
from llama_index_retrieval_kit.retrievers.node_identity import ChunkIdConflictError

# Text of every kind json escapes differently with and without ensure_ascii: quotes, controls,
# DEL, Latin-1, CJK and astral characters (lone surrogates cannot be written as UTF-8 at all).
TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list('ab "\\\n\t\x00\x1f\x7f') + ["é", "ß", "中", "🙂", "\u2028"]),
        st.characters(blacklist_categories=("Cs",)),
    ),
    max_size=12,
)
SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | TEXT
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)
METADATA = st.dictionaries(TEXT, JSON_VALUES, max_size=4)
NODE_IDS = st.sampled_from(["n0", "n1", "n2", "ünï-1", "🙂"])  # few: inserts often replace
DOC_IDS = st.sampled_from(["d0", "d1", "dé", "d🙂"])


def dumps_bytes(value: Any, ensure_ascii: bool = True) -> bytes:
    return json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8")


# ----- pure helpers ----------------------------------------------------------------------------


@given(st.dictionaries(st.one_of(TEXT, st.integers(), st.booleans(), st.none(), st.floats()), JSON_VALUES, max_size=5), st.booleans())
def test_dict_from_item_texts_equals_json_dumps(mapping: Dict[Any, Any], ensure_ascii: bool) -> None:
    joined = "{" + ", ".join(dict_item_json(k, v, ensure_ascii) for k, v in mapping.items()) + "}"
    assert joined == json.dumps(mapping, ensure_ascii=ensure_ascii)
    for key, value in mapping.items():
        assert dict_key_json(key, ensure_ascii) + json.dumps(value, ensure_ascii=ensure_ascii) == dict_item_json(key, value, ensure_ascii)


@given(st.lists(JSON_VALUES, max_size=6), st.booleans())
def test_list_from_item_texts_equals_json_dumps(items: List[Any], ensure_ascii: bool) -> None:
    assert "[" + ", ".join(json.dumps(x, ensure_ascii=ensure_ascii) for x in items) + "]" == json.dumps(items, ensure_ascii=ensure_ascii)


def test_fragment_cache_serves_only_the_same_object() -> None:
    calls: List[str] = []

    def encode(key: str, item: Any) -> bytes:
        calls.append(key)
        return dumps_bytes(item)

    cache: FragmentCache[str] = FragmentCache()
    a, b = {"v": 1}, {"v": 2}
    assert cache.fragments([], encode) == [] and cache.fragments([("a", a), ("b", b)], encode) == [b'{"v": 1}', b'{"v": 2}']
    assert len(cache) == 0  # a one-shot writer keeps nothing: encodings are kept from the second call with items
    assert cache.fragments([("a", a), ("b", b)], encode) == [b'{"v": 1}', b'{"v": 2}']
    assert calls == ["a", "b", "a", "b"] and len(cache) == 2
    calls.clear()
    assert cache.fragments([("a", a), ("b", b)], encode) == [b'{"v": 1}', b'{"v": 2}']
    assert calls == []  # served from the cache
    calls.extend(["a", "b"])
    equal_but_new = {"v": 1}
    assert cache.fragments([("a", equal_but_new), ("b", b)], encode) == [b'{"v": 1}', b'{"v": 2}']
    assert calls == ["a", "b", "a"]  # a new object under the same key is encoded again
    assert cache.fragments([("b", b)], encode) == [b'{"v": 2}'] and len(cache) == 1  # "a" forgotten
    assert cache.cached_bytes() == len(b'{"v": 2}')

    def failing(key: str, item: Any) -> bytes:
        raise TypeError("not JSON")

    with pytest.raises(TypeError):
        cache.fragments([("b", b), ("c", object())], failing)
    assert len(cache) == 1 and cache.fragments([("b", b)], failing) == [b'{"v": 2}']  # left as it was


@given(JSON_VALUES)
def test_private_copy_is_equal_and_shares_no_container(value: Any) -> None:
    copied = private_copy(value)
    assert dumps_bytes(copied) == dumps_bytes(value)

    def containers(v: Any):
        if isinstance(v, (list, dict)):
            yield v
            yield from (c for item in (v.values() if isinstance(v, dict) else v) for c in containers(item))

    assert not {id(c) for c in containers(value)} & {id(c) for c in containers(copied)}


# ----- nodes -------------------------------------------------------------------------------------


@st.composite
def text_nodes(draw: Any, node_id: Any = NODE_IDS) -> TextNode:
    """A TextNode with unicode text and metadata, and maybe a source document and neighbours."""
    node = TextNode(
        id_=draw(node_id),
        text=draw(st.sampled_from(["fee rate", "annual penalty clause", ""]) | TEXT),
        metadata=draw(METADATA),
        excluded_llm_metadata_keys=draw(st.lists(TEXT, max_size=2)),
    )
    source = draw(st.none() | DOC_IDS)
    if source is not None:
        node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=source, metadata=draw(METADATA))
    if draw(st.booleans()):
        node.relationships[NodeRelationship.NEXT] = RelatedNodeInfo(node_id=draw(NODE_IDS))
    return node


def unique_by_id(nodes: List[TextNode]) -> List[TextNode]:
    return list({n.node_id: n for n in nodes}.values())


# ----- BM25Retriever.persist ---------------------------------------------------------------------

BM25_STEPS = st.one_of(
    st.tuples(st.just("insert"), st.lists(text_nodes(), min_size=1, max_size=4).map(unique_by_id)),
    st.tuples(st.just("replace"), st.tuples(st.integers(0, 9), TEXT)),
    st.tuples(st.just("delete_nodes"), st.lists(NODE_IDS, max_size=3)),
    st.tuples(st.just("delete_ref_doc"), DOC_IDS),
    st.tuples(st.just("persist"), st.just(None)),
    st.tuples(st.just("persist_from_view"), st.just(None)),
    st.tuples(st.just("roll_back"), st.integers(0, 5)),
    st.tuples(st.just("reload"), st.just(None)),
)


def plain_nodes_json(retriever: BM25Retriever) -> bytes:
    """What persist wrote before the cache: the whole list encoded at once."""
    return dumps_bytes([doc_to_json(n) for n in retriever.snapshot.nodes], ensure_ascii=False)


def check_bm25_folder(retriever: BM25Retriever, folder: Path) -> None:
    written = (folder / "nodes.json").read_bytes()
    assert written == plain_nodes_json(retriever)
    loaded = BM25Retriever.load(folder)
    assert [persisted_node_json(n) for n in loaded.snapshot.nodes] == [persisted_node_json(n) for n in retriever.snapshot.nodes]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(text_nodes(), max_size=5).map(unique_by_id), st.lists(BM25_STEPS, max_size=12))
def test_bm25_nodes_file_equals_the_one_shot_serialisation(initial: List[TextNode], steps: List[Tuple[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "bm25"
        retriever = BM25Retriever(initial)
        history = [retriever.snapshot]
        persisted = False
        for op, arg in steps:
            if op == "insert":
                try:
                    retriever.insert_nodes(arg)
                except ChunkIdConflictError:  # a node id held by another document: refused, nothing changed
                    assert retriever.snapshot is history[-1]
            elif op == "replace" and len(retriever):  # an indexed node again, same id, new text
                position, text = arg
                node = retriever.nodes[position % len(retriever)].model_copy(deep=True)
                node.set_content(node.get_content() + "|" + text)
                retriever.insert_nodes([node])
            elif op == "delete_nodes":
                retriever.delete_nodes(arg)
            elif op == "delete_ref_doc":
                retriever.delete_ref_doc(arg)
            elif op == "roll_back":  # an earlier state, as HybridIndex restores after a failed write
                retriever.restore_snapshot(history[arg % len(history)])
            elif op in ("persist", "persist_from_view"):
                (retriever if op == "persist" else retriever.with_filters(None)).persist(folder)
                check_bm25_folder(retriever, folder)
                persisted = True
            elif op == "reload" and persisted:
                retriever = BM25Retriever.load(folder)
                history = []
            history.append(retriever.snapshot)
        retriever.persist(folder)
        retriever.persist(folder)  # at least two persists with nodes: from then on the encodings are kept
        check_bm25_folder(retriever, folder)
        want = sum(len(persisted_node_json(n)) for n in retriever.snapshot.nodes)
        assert retriever.cached_json_bytes() == want


def test_bm25_persist_encodes_only_new_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_index_retrieval_kit.retrievers import bm25 as bm25_module

    nodes = [TextNode(id_=f"n{i}", text=f"fee rate clause{i} ünï 🙂", metadata={"i": i, "tags": ["a"]}) for i in range(20)]
    retriever = BM25Retriever(nodes)
    retriever.persist(tmp_path / "a")
    retriever.persist(tmp_path / "a")  # encodings are kept from the second persist on
    encoded: List[str] = []
    real = bm25_module.persisted_node_json
    monkeypatch.setattr(bm25_module, "persisted_node_json", lambda node: encoded.append(node.node_id) or real(node))
    retriever.insert_nodes([TextNode(id_="n3", text="replaced"), TextNode(id_="new", text="added")])
    retriever.delete_nodes(["n5"])
    retriever.persist(tmp_path / "b")
    assert sorted(encoded) == ["n3", "new"]
    assert (tmp_path / "b" / "nodes.json").read_bytes() == plain_nodes_json(retriever)


def test_bm25_persist_refuses_unencodable_text_like_before(tmp_path: Path) -> None:
    retriever = BM25Retriever([TextNode(id_="bad", text="lone \ud800 surrogate")])
    with pytest.raises(UnicodeEncodeError):
        retriever.persist(tmp_path / "bm25")


# ----- IndexDocumentStore --------------------------------------------------------------------------

DOCSTORE_STEPS = st.one_of(
    st.tuples(st.just("add"), st.lists(text_nodes(), min_size=1, max_size=4).map(unique_by_id)),
    st.tuples(st.just("add_document"), st.builds(lambda i, t, m: Document(id_=i, text=t, metadata=m), DOC_IDS, TEXT, METADATA)),
    st.tuples(st.just("replace"), st.tuples(st.integers(0, 9), TEXT)),
    st.tuples(st.just("delete_document"), NODE_IDS),
    st.tuples(st.just("delete_ref_doc"), DOC_IDS),
    st.tuples(st.just("set_hash"), st.tuples(NODE_IDS, TEXT)),
    st.tuples(st.just("read_and_change"), NODE_IDS),
    st.tuples(st.just("persist"), st.just(None)),
    st.tuples(st.just("reload"), st.just(None)),
)


def read_everything(store: SimpleDocumentStore, node_id: str, change: bool) -> None:
    """Read through every public path and, if ``change``, change the results at every depth: in
    a plain SimpleDocumentStore some of these changes reach the stored entries. (Reading alone
    changes a file too: a read creates the collection it reads, so both stores read.)"""
    node = store.get_node(node_id, raise_error=False)
    docs = store.docs
    infos = store.get_all_ref_doc_info() or {}
    as_dict = store.to_dict()
    if not change:
        return
    if node is not None:
        for value in node.metadata.values():
            if isinstance(value, list):
                value.append("changed")
            elif isinstance(value, dict):
                value["changed"] = True
        for info in node.relationships.values():
            if isinstance(info, RelatedNodeInfo):
                info.metadata["changed"] = True
    for doc_node in docs.values():
        doc_node.metadata["changed"] = ["x"]
    for info in infos.values():
        info.node_ids.append("changed")
        info.metadata["changed"] = [1]
    for collection in as_dict.values():
        for entry in collection.values():
            entry["changed"] = {"deep": [1]}


def apply(store: SimpleDocumentStore, op: str, arg: Any) -> None:
    if op == "add":
        store.add_documents([n.model_copy(deep=True) for n in arg], allow_update=True)
    elif op == "add_document":
        store.add_documents([arg.model_copy(deep=True)], allow_update=True)
    elif op == "delete_document":
        store.delete_document(arg, raise_error=False)
    elif op == "delete_ref_doc":
        store.delete_ref_doc(arg, raise_error=False)
    elif op == "set_hash":
        store.set_document_hash(*arg)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(DOCSTORE_STEPS, max_size=14))
def test_docstore_file_equals_a_plain_simple_docstore(steps: List[Tuple[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ours_path, theirs_path = Path(tmp) / "ours" / "docstore.json", Path(tmp) / "theirs" / "docstore.json"
        ours, theirs = IndexDocumentStore(), SimpleDocumentStore()
        persisted = False
        for op, arg in steps:
            if op == "read_and_change":
                read_everything(ours, arg, change=True)  # must neither reach the store nor go stale
                read_everything(theirs, arg, change=False)
            elif op == "persist":
                ours.persist(str(ours_path))
                theirs.persist(str(theirs_path))
                assert ours_path.read_bytes() == theirs_path.read_bytes()
                persisted = True
            elif op == "replace":  # a stored node again, same id, new text
                stored = sorted(theirs.docs.items())
                assert sorted(ours.docs) == [key for key, _ in stored]  # (both read: reads create collections)
                if stored:
                    changed = stored[arg[0] % len(stored)][1].model_copy(deep=True)
                    changed.set_content(changed.get_content() + "|" + arg[1])
                    apply(ours, "add", [changed])
                    apply(theirs, "add", [changed])
            elif op == "reload" and persisted:
                ours = IndexDocumentStore.from_persist_path(str(ours_path))
                theirs = SimpleDocumentStore.from_persist_path(str(theirs_path))
            else:
                apply(ours, op, arg)
                apply(theirs, op, arg)
        ours.persist(str(ours_path))
        theirs.persist(str(theirs_path))
        assert ours_path.read_bytes() == theirs_path.read_bytes()
        assert ours_path.read_bytes() == dumps_bytes(ours.to_dict())
        assert dumps_bytes(IndexDocumentStore.from_persist_path(str(ours_path)).to_dict()) == theirs_path.read_bytes()


def test_docstore_persist_encodes_only_changed_entries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from llama_index_retrieval_kit.indices import docstore as docstore_module

    nodes = [TextNode(id_=f"n{i}", text=f"chunk {i}", metadata={"tags": ["a"]}) for i in range(10)]
    for n in nodes:
        n.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=f"d{int(n.node_id[1:]) % 3}")
    store = IndexDocumentStore()
    store.add_documents(nodes)
    store.persist(str(tmp_path / "a.json"))
    store.persist(str(tmp_path / "a.json"))  # encodings are kept from the second persist on
    encoded: List[str] = []
    real = docstore_module._entry_json
    monkeypatch.setattr(docstore_module, "_entry_json", lambda key, entry: encoded.append(key) or real(key, entry))
    store.get_node("n1").metadata["tags"].append("read, changed, not stored")
    store.delete_ref_doc("d2")
    store.add_documents([nodes[4].model_copy(update={"text": "new text"})])
    store.persist(str(tmp_path / "b.json"))
    # n4 (its node and metadata entries) and its document's ref doc info d1 changed; d2's went.
    assert sorted(encoded) == ["d1", "n4", "n4"]
    assert (tmp_path / "b.json").read_bytes() == dumps_bytes(store.to_dict())
    assert store.get_node("n1").metadata["tags"] == ["a"]


def test_docstore_persists_on_an_fsspec_filesystem_like_simple_docstore() -> None:
    fs = fsspec.filesystem("memory")
    root = f"/persist-fragments-{uuid.uuid4().hex}"
    nodes = [TextNode(id_=f"n{i}", text=f"chunk {i} 中", metadata={"i": i}) for i in range(5)]
    ours, theirs = IndexDocumentStore(), SimpleDocumentStore()
    try:
        for store, name in ((ours, "ours"), (theirs, "theirs")):
            store.add_documents(nodes)
            store.persist(f"{root}/{name}/sub/docstore.json", fs=fs)  # folders made as SimpleKVStore makes them
        assert fs.cat(f"{root}/ours/sub/docstore.json") == fs.cat(f"{root}/theirs/sub/docstore.json")
        reread = IndexDocumentStore.from_persist_dir(f"{root}/theirs/sub", fs=fs)
        assert isinstance(reread, IndexDocumentStore) and reread.to_dict() == theirs.to_dict()
    finally:
        fs.rm(root, recursive=True)


def test_docstore_survives_pickling_and_builds_from_its_forms(tmp_path: Path) -> None:
    nodes = [TextNode(id_=f"n{i}", text=f"chunk {i}", metadata={"tags": ["t"]}) for i in range(4)]
    store = IndexDocumentStore()
    store.add_documents(nodes)
    store.persist(str(tmp_path / "a.json"))
    again = pickle.loads(pickle.dumps(store))
    again.persist(str(tmp_path / "b.json"))
    assert (tmp_path / "b.json").read_bytes() == (tmp_path / "a.json").read_bytes()
    save_dict = store.to_dict()
    from_dict = IndexDocumentStore.from_dict(save_dict)
    save_dict["docstore/data"]["n0"]["__data__"]["metadata"]["tags"].append("caller's change")
    from_dict.persist(str(tmp_path / "c.json"))
    assert (tmp_path / "c.json").read_bytes() == (tmp_path / "a.json").read_bytes()
    shared = FragmentCachingKVStore()
    assert IndexDocumentStore(shared)._kvstore is shared  # a given store is used, not copied
    with pytest.raises(ValueError, match="must be a dict"):
        FragmentCachingKVStore.adopting({"docstore/data": {"n0": "not an entry"}})


# ----- HybridIndex ---------------------------------------------------------------------------------


def test_hybrid_index_files_are_what_plain_serialisation_writes(tmp_path: Path) -> None:
    model = MockEmbedding(embed_dim=8)
    docs = [Document(id_=f"d{i}", text=f"fee rate {'penalty ' * (i % 4)} clause{i} ünï 中 🙂", metadata={"i": i, "tags": ["a", "é"]}) for i in range(12)]
    with HybridIndex.from_documents(docs[:8], tmp_path / "idx", embed_model=model) as index:
        index.upsert([docs[8]])
        index.upsert([Document(id_="d2", text="replaced text, ünï", metadata={"i": 2})])
        index.delete("d5")
        index.upsert(docs[9:])
    with HybridIndex.load(tmp_path / "idx", embed_model=model) as reopened:
        generation = reopened.manifest.generation
        assert len(reopened) == 11
    nodes_file = index_storage.bm25_dir(tmp_path / "idx", generation) / "nodes.json"
    docstore_file = index_storage.docstore_file(tmp_path / "idx", generation)
    assert nodes_file.read_bytes() == dumps_bytes(json.loads(nodes_file.read_bytes()), ensure_ascii=False)
    plain = SimpleDocumentStore.from_persist_path(str(docstore_file))
    plain.persist(str(tmp_path / "plain.json"))
    assert docstore_file.read_bytes() == (tmp_path / "plain.json").read_bytes()
