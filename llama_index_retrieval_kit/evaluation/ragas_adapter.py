"""RAGAS glue: retriever / query-engine runs as a RAGAS ``EvaluationDataset``, scored offline or by any LLM.

This is the one module that touches the RAGAS API (pinned to ragas 0.4.x, checked against 0.4.3);
RAGAS renames things often, so every RAGAS name this package uses is listed in
:data:`RAGAS_METRICS` and in the ``_ragas_*`` helpers below. RAGAS is imported lazily, inside
functions: importing this package stays fast and keeps working even when RAGAS cannot be
imported. RAGAS comes with the ``eval`` extra (``pip install 'llama-index-retrieval-kit[eval]'``);
without it, building samples works and scoring says which extra to install.

Two kinds of metrics (our stable names, mapped to RAGAS classes in :data:`RAGAS_METRICS`):

* **LLM-free** (no key, no network): ``id_context_precision`` / ``id_context_recall`` (retrieved
  context ids against reference ids) and ``nonllm_context_precision`` /
  ``nonllm_context_recall`` (retrieved text against reference passages by string similarity,
  rapidfuzz, RAGAS' threshold 0.5). RAGAS' default similarity (Levenshtein over the whole
  strings) rarely credits a chunk much longer than the passage it holds; pass
  ``string_similarity="containment"`` to :func:`run_ragas` to credit such chunks.
* **LLM-judged**, with the LlamaIndex LLM (and embedding model) you pass: ``faithfulness``,
  ``answer_relevancy`` (also needs ``embed_model``), ``llm_context_precision``,
  ``llm_context_recall``, ``context_entity_recall``.

Nothing here ever falls back to OpenAI: asking for an LLM metric without ``llm=`` raises a
ValueError naming the metric, and every metric gets its LLM / embeddings set explicitly, so
``ragas.evaluate`` never builds its OpenAI defaults. RAGAS usage telemetry is switched off
(``RAGAS_DO_NOT_TRACK=true``) unless you set that variable yourself.

Offline, on a retriever::

    from llama_index_retrieval_kit.evaluation import load_jsonl, run_retriever_for_ragas, run_ragas

    dataset = load_jsonl("questions.jsonl")
    ragas_ds = run_retriever_for_ragas(index.as_retriever("hybrid", similarity_top_k=5), dataset,
                                       context_id_key="doc_id")
    report = run_ragas(ragas_ds)            # the four LLM-free metrics
    print(report.means)                     # {"id_context_precision": 0.61, ...}
    report.to_pandas()                      # one row per question

With a real judge (any LlamaIndex LLM; install the integration you want, e.g.
``llama-index-llms-openai`` or ``llama-index-llms-ollama``)::

    from llama_index.llms.openai import OpenAI              # or: from llama_index.llms.ollama import Ollama
    from llama_index_retrieval_kit.models import default_embed_model

    judge = OpenAI(model="gpt-4o-mini", temperature=0)      # or: Ollama(model="llama3.1", request_timeout=120)
    ragas_ds = run_retriever_for_ragas(index.as_query_engine(llm=judge), dataset)
    report = run_ragas(
        ragas_ds,
        metrics=("faithfulness", "answer_relevancy", "llm_context_precision", "llm_context_recall"),
        llm=judge,
        embed_model=default_embed_model(),                  # offline MiniLM is fine for answer_relevancy
    )

Ids: ``retrieved_context_ids`` come from each node's metadata under ``context_id_key``
(``"chunk_id"`` by default; ``"doc_id"`` gives the document). The reference ids are the
dataset's relevant doc ids (``qrels``), so the ID-based metrics compare like with like with
``context_id_key="doc_id"`` (or pass ``reference_context_ids=`` with ids of your own).
RAGAS' ID metrics work on *sets* of ids: with ``doc_id`` five chunks of the right document
count once, so ``id_context_precision`` is document-level precision.

Contexts: each retrieved node's own text (no metadata; ContextAssembler's citation hint
removed), best score first (``order_by_score=True``, stable; the given order when a score is
missing), because RAGAS' context precision is rank-aware while a query engine's ``source_nodes``
may be in presentation order (ContextAssembler's default "bookends", LongContextReorder).

Questions without the field a metric needs (no-answer questions have no reference contexts,
ids or answer; samples without a generated response; for the ID metrics, samples with texts but
no ids) are skipped for that metric, with an INFO log line; their score is ``None``, they are
listed in ``RagasReport.skipped`` and do not enter the mean. An abstention (the no-answer gate's
response, LlamaIndex's "Empty Response" without nodes) is no response. A question for which
nothing was retrieved (no texts, no ids) scores 0.0 on the context metrics (RAGAS itself would
crash or return NaN). A sample RAGAS fails on (an exception, unparseable judge output: NaN) is
``None`` too, listed in ``RagasReport.failed``; the other samples keep their scores.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Dict, Iterable, Mapping, Sequence

from .datasets import RetrievalDataset

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd
    from ragas import EvaluationDataset

logger = logging.getLogger(__name__)

#: RAGAS versions this adapter was written against (the public names below exist in 0.4.3).
SUPPORTED_RAGAS = ">=0.4.3,<0.5"

_TRACKING_ENV = "RAGAS_DO_NOT_TRACK"


@dataclass(frozen=True)
class RagasMetricSpec:
    """How one of our stable metric names maps onto RAGAS (0.4.3).

    * ``ragas_class``: the class name, as exported by ``ragas.metrics`` (a deprecated alias in
      0.4.x) and defined in ``ragas_module``;
    * ``needs``: sample fields that must be non-empty, else the sample is skipped for it;
    * ``zero_if_nothing_retrieved``: a sample with no retrieved context (neither texts nor ids)
      scores 0.0 without calling RAGAS (context metrics: nothing retrieved = nothing relevant
      retrieved);
    * ``retrieved_field``: the retrieved field the metric reads (``retrieved_context_ids`` for the
      ID metrics); a sample that retrieved something but lacks this field is skipped, not scored 0.
    """

    ragas_class: str
    ragas_module: str
    needs: tuple[str, ...]
    needs_llm: bool = False
    needs_embeddings: bool = False
    zero_if_nothing_retrieved: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: constructor argument taking the string-similarity metric (non-LLM string metrics only)
    similarity_kwarg: str | None = None
    retrieved_field: str = "retrieved_contexts"


#: Our stable metric names -> RAGAS classes. The one table to update when RAGAS renames things.
RAGAS_METRICS: Mapping[str, RagasMetricSpec] = {
    # LLM-free
    "id_context_precision": RagasMetricSpec(
        "IDBasedContextPrecision", "ragas.metrics._context_precision", ("reference_context_ids",),
        zero_if_nothing_retrieved=True, retrieved_field="retrieved_context_ids",
    ),
    "id_context_recall": RagasMetricSpec(
        "IDBasedContextRecall", "ragas.metrics._context_recall", ("reference_context_ids",),
        zero_if_nothing_retrieved=True, retrieved_field="retrieved_context_ids",
    ),
    # RAGAS names the similarity argument differently in the two classes (0.4.3).
    "nonllm_context_precision": RagasMetricSpec(
        "NonLLMContextPrecisionWithReference", "ragas.metrics._context_precision", ("reference_contexts",),
        zero_if_nothing_retrieved=True, similarity_kwarg="distance_measure",
    ),
    "nonllm_context_recall": RagasMetricSpec(
        "NonLLMContextRecall", "ragas.metrics._context_recall", ("reference_contexts",),
        zero_if_nothing_retrieved=True, similarity_kwarg="_distance_measure",
    ),
    # LLM-judged
    "faithfulness": RagasMetricSpec("Faithfulness", "ragas.metrics._faithfulness", ("response",), needs_llm=True),
    # LlamaIndex LLMs give one completion per call (RAGAS' LlamaIndexLLMWrapper ignores n), so
    # strictness=1 says what really happens instead of RAGAS warning "1 generation instead of 3".
    "answer_relevancy": RagasMetricSpec(
        "ResponseRelevancy", "ragas.metrics._answer_relevance", ("response",),
        needs_llm=True, needs_embeddings=True, kwargs={"strictness": 1},
    ),
    "llm_context_precision": RagasMetricSpec(
        "LLMContextPrecisionWithReference", "ragas.metrics._context_precision", ("reference",),
        needs_llm=True, zero_if_nothing_retrieved=True,
    ),
    "llm_context_recall": RagasMetricSpec(
        "LLMContextRecall", "ragas.metrics._context_recall", ("reference",),
        needs_llm=True, zero_if_nothing_retrieved=True,
    ),
    "context_entity_recall": RagasMetricSpec(
        "ContextEntityRecall", "ragas.metrics._context_entities_recall", ("reference",),
        needs_llm=True, zero_if_nothing_retrieved=True,
    ),
}

LLM_FREE_METRICS: tuple[str, ...] = tuple(name for name, spec in RAGAS_METRICS.items() if not spec.needs_llm)
LLM_METRICS: tuple[str, ...] = tuple(name for name, spec in RAGAS_METRICS.items() if spec.needs_llm)
DEFAULT_RAGAS_METRICS: tuple[str, ...] = (
    "id_context_precision",
    "id_context_recall",
    "nonllm_context_precision",
    "nonllm_context_recall",
)

#: ``string_similarity`` choices for the non-LLM string metrics: RAGAS' own measures (1 - normalised
#: rapidfuzz distance between the whole retrieved chunk and the whole reference passage) and
#: ``"containment"`` (1.0 when the chunk holds the passage, see :func:`.relevance.text_match`).
STRING_SIMILARITIES: tuple[str, ...] = ("levenshtein", "hamming", "jaro", "jaro_winkler", "containment")

_ID_FALLBACKS = {"chunk_id": "node_id", "node_id": "node_id", "id": "node_id", "doc_id": "ref_doc_id"}


# --------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------


_LIST_FIELDS = ("retrieved_contexts", "retrieved_context_ids", "reference_contexts", "reference_context_ids")


@dataclass(frozen=True)
class RagasSample:
    """One question as RAGAS sees it (``SingleTurnSample`` fields), plus our ``query_id``.

    Empty lists / ``None`` mean "not known" (e.g. a no-answer question has no reference).
    """

    query_id: str
    user_input: str
    retrieved_contexts: list[str] = field(default_factory=list)
    retrieved_context_ids: list[str] = field(default_factory=list)
    reference: str | None = None
    reference_contexts: list[str] = field(default_factory=list)
    reference_context_ids: list[str] = field(default_factory=list)
    response: str | None = None

    def __post_init__(self) -> None:
        """Refuse what RAGAS would misread: a bare string as a list field (its characters would
        become contexts), non-string texts."""
        if not isinstance(self.query_id, str) or not isinstance(self.user_input, str):
            raise ValueError(
                f"query_id and user_input must be strings, got {self.query_id!r} / {self.user_input!r}"
            )
        for name in _LIST_FIELDS:
            value = getattr(self, name)
            if value is None:
                value = []
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                raise ValueError(
                    f"sample {self.query_id!r}: {name} must be a list of strings, got {type(value).__name__} "
                    f"{value!r:.80}"
                )
            is_ids = name.endswith("_ids")
            items = [str(item) if is_ids and isinstance(item, numbers.Integral) else item for item in value]
            bad = [item for item in items if not isinstance(item, str)]
            if bad:
                raise ValueError(f"sample {self.query_id!r}: {name} must hold strings, got {bad[0]!r:.80}")
            object.__setattr__(self, name, items)
        for name in ("reference", "response"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(
                    f"sample {self.query_id!r}: {name} must be a string or None, got {type(value).__name__}"
                )

    def to_ragas_dict(self) -> dict[str, Any]:
        """The ``SingleTurnSample`` fields (no ``query_id``), lists copied."""
        return {
            "user_input": self.user_input,
            "retrieved_contexts": list(self.retrieved_contexts),
            "retrieved_context_ids": list(self.retrieved_context_ids),
            "reference": self.reference,
            "reference_contexts": list(self.reference_contexts),
            "reference_context_ids": list(self.reference_context_ids),
            "response": self.response,
        }

    def has(self, name: str) -> bool:
        """True when field ``name`` is set and not empty."""
        value = getattr(self, name)
        return value is not None and value != "" and value != []


_SAMPLE_FIELDS = tuple(f.name for f in fields(RagasSample))


def _sample_from_mapping(row: Mapping[str, Any], position: int, query_id: str | None = None) -> RagasSample:
    """A :class:`RagasSample` from a dict row (our fields, ``SingleTurnSample`` names)."""
    unknown = sorted(set(row) - set(_SAMPLE_FIELDS))
    if unknown:
        raise ValueError(f"sample {position}: unknown fields {unknown}; allowed: {list(_SAMPLE_FIELDS)}")
    values = {name: row.get(name) for name in _SAMPLE_FIELDS if row.get(name) is not None}
    if not isinstance(values.get("user_input"), str):
        raise ValueError(f"sample {position}: user_input must be a string, got {row.get('user_input')!r}")
    values["query_id"] = str(values.get("query_id", query_id if query_id is not None else position))
    return RagasSample(**values)


#: Id keys that name a chunk: an assembled context node (ContextAssembler) stands for the chunks it was
#: built from (its metadata's ``source_node_ids``), not for its own generated id.
_CHUNK_ID_KEYS = tuple(key for key, fallback in _ID_FALLBACKS.items() if fallback == "node_id")


def _node_ids(node: Any, key: str) -> list[str]:
    """The ids a retrieved node stands for: :func:`_node_id`, or for a ContextAssembler node asked for a
    chunk id its source chunks' ids (``metadata["source_node_ids"]``; its own id is a uuid5 of the span,
    which no reference id can match; ``chunk_id``: each source's own, recorded in ``source_details``)."""
    metadata = getattr(node, "metadata", None) or {}
    sources = metadata.get("source_node_ids")
    if key in _CHUNK_ID_KEYS and key not in metadata and isinstance(sources, (list, tuple)) and sources:
        details = metadata.get("source_details")
        details = details if isinstance(details, dict) else {}
        if key != "chunk_id":
            return [str(s) for s in sources]
        return [str((details.get(s) or {}).get("chunk_id", s)) for s in sources]
    return [_node_id(node, key)]


def _node_id(node: Any, key: str) -> str:
    """The id of a retrieved node: ``metadata[key]``, else the node's own id for the usual keys."""
    metadata = getattr(node, "metadata", None) or {}
    value = metadata.get(key)
    if value is None and key in _ID_FALLBACKS:
        value = getattr(node, _ID_FALLBACKS[key], None)
    if value is None:
        raise ValueError(
            f"retrieved node {getattr(node, 'node_id', '?')!r} has no {key!r} in its metadata "
            f"(keys: {sorted(metadata)}); pass context_id_key= one of them"
        )
    return str(value)


#: LlamaIndex's synthesizers answer this when they got no nodes (no LLM call was made).
_LLAMA_INDEX_EMPTY_RESPONSE = "Empty Response"


def _is_response(value: Any) -> bool:
    return hasattr(value, "source_nodes") and not isinstance(value, (list, tuple, str))


def _response_text(value: Any) -> str | None:
    """The answer text of a query-engine Response, or None when nothing was generated: no text, or
    an abstention (``metadata["no_answer"]`` set by :class:`NoAnswerPostprocessor`, or LlamaIndex's
    bare "Empty Response" with no source nodes) - there is no answer to judge."""
    if getattr(value, "response", "") is None:
        return None
    if (getattr(value, "metadata", None) or {}).get("no_answer") is True:
        return None
    text = str(value)
    if text == _LLAMA_INDEX_EMPTY_RESPONSE and not (value.source_nodes or []):
        return None
    return text


def _nodes_and_response(value: Any, query_id: str) -> tuple[list[Any], str | None]:
    """(retrieved nodes, response text or None) from a retriever's list or a query-engine Response."""
    if _is_response(value):
        # Response / StreamingResponse: str() is the answer text (it drains a stream)
        text = _response_text(value)
        return list(value.source_nodes or []), text
    if isinstance(value, (list, tuple)):
        return list(value), None
    raise ValueError(
        f"results[{query_id!r}] must be a list of NodeWithScore (a retriever's output) or a query-engine "
        f"Response (with .source_nodes), got {type(value).__name__}"
    )


def _unwrap_node(item: Any, query_id: str, position: int) -> Any:
    node = getattr(item, "node", item)  # NodeWithScore -> node; a bare node stays
    if not hasattr(node, "get_content"):
        raise ValueError(f"results[{query_id!r}][{position}] is not a node or NodeWithScore: {type(item).__name__}")
    return node


def _by_score(items: Sequence[Any]) -> list[Any]:
    """``items`` best score first (stable: ties keep their order); unchanged when a score is missing.

    RAGAS' context precision is rank-aware (average precision over the contexts' order), and a
    query engine's ``source_nodes`` may be in presentation order, not rank order (ContextAssembler's
    default "bookends", LlamaIndex's LongContextReorder).
    """
    scores = [getattr(item, "score", None) for item in items]
    if not items or any(not isinstance(score, numbers.Real) or math.isnan(score) for score in scores):
        return list(items)
    return [item for _, item in sorted(zip(scores, items), key=lambda pair: -pair[0])]


def _context_text(node: Any) -> str:
    """The node's own text (no metadata), without the citation hint ContextAssembler puts first.

    An assembled node's text is ``citation + "\n" + span`` with ``metadata["citation"]``
    (:func:`..postprocessor.context.node_text`); the hint is built from metadata (file, section,
    pages), so it is not retrieved text and would differ between otherwise equal contexts.
    """
    from llama_index.core.schema import MetadataMode

    try:
        text = node.get_content(metadata_mode=MetadataMode.NONE)
    except TypeError:  # a node type whose get_content takes no metadata_mode
        text = node.get_content()
    citation = (getattr(node, "metadata", None) or {}).get("citation")
    if isinstance(citation, str) and citation and text.startswith(citation + "\n"):
        return text[len(citation) + 1:]
    return text


def _check_response(value: Any, query_id: str) -> str | None:
    """A generated answer from ``responses``: a string or a query-engine Response."""
    if value is None or isinstance(value, str):
        return value
    if _is_response(value):
        return _response_text(value)
    raise ValueError(
        f"responses[{query_id!r}] must be a string (or a query-engine Response), got {type(value).__name__}"
    )


def to_ragas_samples(
    dataset: RetrievalDataset,
    results: Mapping[str, Any],
    responses: Mapping[str, str] | None = None,
    context_id_key: str = "chunk_id",
    *,
    reference_context_ids: Mapping[str, Sequence[str]] | None = None,
    order_by_score: bool = True,
) -> list[RagasSample]:
    """One :class:`RagasSample` per query in ``results``, in dataset order.

    ``results`` maps query id -> a retriever's ``list[NodeWithScore]`` or a query-engine
    ``Response`` (its ``source_nodes`` are the contexts, ``str(response)`` the response).
    ``responses`` (query id -> generated answer) overrides / supplies responses; an abstention
    (the no-answer gate's text, LlamaIndex's "Empty Response" without nodes) is no response.
    Contexts are the nodes' own text (no metadata, no ContextAssembler citation hint), best score
    first (``order_by_score``, stable; kept as given when a score is missing): RAGAS' context
    precision is rank-aware and a query engine's ``source_nodes`` may be in presentation order.
    Their ids are ``metadata[context_id_key]`` (falling back to the node id for ``"chunk_id"``
    and to ``ref_doc_id`` for ``"doc_id"``; a ContextAssembler node gives the ids of the chunks it
    was built from for ``"chunk_id"``). Reference ids are the dataset's relevant doc ids
    (qrels > 0) unless ``reference_context_ids`` gives them per query id.
    """
    if not isinstance(dataset, RetrievalDataset):
        raise ValueError(f"dataset must be a RetrievalDataset, got {type(dataset).__name__}")
    if not isinstance(results, Mapping):
        raise ValueError(
            f"results must be a dict query id -> retrieved nodes or Response, got {type(results).__name__}"
        )
    if not isinstance(context_id_key, str) or not context_id_key:
        raise ValueError(
            f"context_id_key must be a metadata key such as 'chunk_id' or 'doc_id', got {context_id_key!r}"
        )
    if not isinstance(order_by_score, bool):
        raise ValueError(f"order_by_score must be True or False, got {order_by_score!r}")
    responses = dict(responses or {})
    given = (("results", results), ("responses", responses), ("reference_context_ids", reference_context_ids or {}))
    for label, mapping in given:
        unknown = [query_id for query_id in mapping if query_id not in dataset.queries]
        if unknown:
            raise ValueError(
                f"{label} has query ids that are not in the dataset: {unknown[:5]!r} ({len(unknown)} in all)"
            )
    missing = [query_id for query_id in dataset.queries if query_id not in results]
    if missing:
        logger.warning(
            "%d of %d dataset questions have no results and are left out: %s", len(missing), len(dataset), missing[:5]
        )
    for label, mapping in (("responses", responses), ("reference_context_ids", reference_context_ids or {})):
        unused = [query_id for query_id in mapping if query_id not in results]
        if unused:
            logger.warning("%s for %d questions without results are not used: %s", label, len(unused), unused[:5])

    samples: list[RagasSample] = []
    for query_id, question in dataset.queries.items():
        if query_id not in results:
            continue
        raw_nodes, response = _nodes_and_response(results[query_id], query_id)
        if order_by_score:
            raw_nodes = _by_score(raw_nodes)
        nodes = [_unwrap_node(item, query_id, position) for position, item in enumerate(raw_nodes)]
        if query_id in responses:
            response = _check_response(responses[query_id], query_id)
        if reference_context_ids is not None and query_id in reference_context_ids:
            ref_ids = [str(doc_id) for doc_id in reference_context_ids[query_id]]
        else:
            ref_ids = [doc_id for doc_id, grade in dataset.qrels.get(query_id, {}).items() if grade > 0]
        samples.append(
            RagasSample(
                query_id=query_id,
                user_input=question,
                retrieved_contexts=[_context_text(node) for node in nodes],
                retrieved_context_ids=[i for node in nodes for i in _node_ids(node, context_id_key)],
                reference=dataset.reference_answers.get(query_id) or None,
                reference_contexts=list(dataset.reference_contexts.get(query_id, [])),
                reference_context_ids=ref_ids,
                response=response if response else None,
            )
        )
    _warn_on_disjoint_ids(samples, context_id_key, reference_context_ids is not None)
    return samples


def _warn_on_disjoint_ids(samples: Sequence[RagasSample], key: str, explicit: bool) -> None:
    reference = {i for s in samples for i in s.reference_context_ids}
    retrieved = {i for s in samples for i in s.retrieved_context_ids}
    if reference and retrieved and not reference & retrieved:
        hint = (
            ""
            if explicit
            else " (the dataset's relevant doc ids); pass context_id_key='doc_id' or reference_context_ids="
        )
        logger.warning(
            "no retrieved %r value is among the reference ids%s: id_context_precision / id_context_recall "
            "will be 0 for every question",
            key,
            hint,
        )


def to_ragas_dataset(
    dataset: RetrievalDataset,
    results: Mapping[str, Any],
    responses: Mapping[str, str] | None = None,
    context_id_key: str = "chunk_id",
    *,
    reference_context_ids: Mapping[str, Sequence[str]] | None = None,
    order_by_score: bool = True,
) -> "EvaluationDataset":
    """A RAGAS ``EvaluationDataset`` from retrieval results; see :func:`to_ragas_samples`.

    Columns: user_input, retrieved_contexts, retrieved_context_ids, reference,
    reference_contexts, reference_context_ids, response. The query ids are remembered on the
    returned object for :func:`run_ragas` (``query_ids`` attribute).
    """
    samples = to_ragas_samples(
        dataset, results, responses, context_id_key,
        reference_context_ids=reference_context_ids, order_by_score=order_by_score,
    )
    return _samples_to_dataset(samples, name=dataset.name)


def _samples_to_dataset(samples: Sequence[RagasSample], name: str = "") -> "EvaluationDataset":
    if not samples:
        raise ValueError("no samples: results holds none of the dataset's questions")
    ragas = _import_ragas()
    rows = [{k: v for k, v in s.to_ragas_dict().items() if v is not None} for s in samples]
    ragas_dataset = ragas.EvaluationDataset.from_list(rows, name=name or None)
    ragas_dataset.query_ids = [s.query_id for s in samples]  # read back by run_ragas
    return ragas_dataset


def run_retriever_for_ragas(
    retriever_or_query_engine: Any,
    dataset: RetrievalDataset,
    *,
    context_id_key: str = "chunk_id",
    query_ids: Iterable[str] | None = None,
    reference_context_ids: Mapping[str, Sequence[str]] | None = None,
    show_progress: bool = False,
    order_by_score: bool = True,
) -> "EvaluationDataset":
    """Run a LlamaIndex retriever (``.retrieve``) or query engine (``.query``) on every question
    (or on ``query_ids``) and return the RAGAS ``EvaluationDataset`` (see :func:`to_ragas_dataset`).

    A query engine also gives each sample its ``response`` (for the LLM-judged answer metrics).
    ``order_by_score``: see :func:`to_ragas_samples`.
    """
    run = _runner(retriever_or_query_engine)
    ids = list(dataset.queries) if query_ids is None else list(query_ids)
    unknown = [query_id for query_id in ids if query_id not in dataset.queries]
    if unknown:
        raise ValueError(f"query_ids not in the dataset: {unknown[:5]!r}")
    iterable: Iterable[str] = ids
    if show_progress:
        from tqdm.auto import tqdm

        iterable = tqdm(ids, desc="Retrieving")
    results: Dict[str, Any] = {}
    failures: Dict[str, BaseException] = {}
    for query_id in iterable:  # one failing query (a server timeout) never loses the others' results
        try:
            results[query_id] = run(dataset.queries[query_id])
        except Exception as exc:
            failures[query_id] = exc
    if failures:
        ids = [query_id for query_id in ids if query_id in results]
    if query_ids is not None or failures:  # a chosen subset (no "questions left out" warning), or the answered ones
        chosen = set(ids)
        dataset = RetrievalDataset(
            queries={q: text for q, text in dataset.queries.items() if q in chosen},
            qrels={q: judged for q, judged in dataset.qrels.items() if q in chosen},
            corpus=dataset.corpus,
            reference_contexts={q: c for q, c in dataset.reference_contexts.items() if q in chosen},
            reference_answers={q: a for q, a in dataset.reference_answers.items() if q in chosen},
            name=dataset.name,
        )
    built = to_ragas_dataset(
        dataset, results, context_id_key=context_id_key, reference_context_ids=reference_context_ids,
        order_by_score=order_by_score,
    )
    if failures:
        raise RagasRetrievalError(failures, built)
    return built


class RagasRetrievalError(RuntimeError):
    """Some questions failed to retrieve in :func:`run_retriever_for_ragas`: ``failures`` maps their
    query ids to the exceptions, ``dataset`` is the RAGAS dataset of the questions that did run
    (nothing already retrieved is lost; score it, or fix the cause and run the failed ids again
    with ``query_ids=``)."""

    def __init__(self, failures: Mapping[str, BaseException], dataset: "EvaluationDataset") -> None:
        self.failures = dict(failures)
        self.dataset = dataset
        shown = "; ".join(f"{query_id}: {type(exc).__name__}: {exc}" for query_id, exc in list(self.failures.items())[:3])
        super().__init__(
            f"{len(self.failures)} question(s) failed to retrieve ({shown}{'; ...' if len(self.failures) > 3 else ''}); "
            "the dataset of the others is in this error's .dataset; run the failed ones again with "
            f"query_ids={sorted(self.failures)[:5]!r}{'...' if len(self.failures) > 5 else ''}"
        )


def _runner(obj: Any) -> Any:
    from llama_index.core.base.base_query_engine import BaseQueryEngine
    from llama_index.core.base.base_retriever import BaseRetriever

    if isinstance(obj, BaseQueryEngine):
        return obj.query
    if isinstance(obj, BaseRetriever):
        return obj.retrieve
    if callable(getattr(obj, "query", None)):
        return obj.query
    if callable(getattr(obj, "retrieve", None)):
        return obj.retrieve
    raise TypeError(f"expected a LlamaIndex retriever (.retrieve) or query engine (.query), got {type(obj).__name__}")


# --------------------------------------------------------------------------------------------
# Running RAGAS
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RagasReport:
    """Scores of one :func:`run_ragas` call.

    * ``metrics``: our metric names, in the order asked;
    * ``rows``: one dict per sample: ``query_id``, ``user_input`` and a score per metric
      (float in [0, 1], or ``None`` when skipped or when RAGAS gave no score);
    * ``means``: metric -> mean over the scored samples (``None`` when none was scored);
    * ``counts``: metric -> number of scored samples;
    * ``skipped``: metric -> query ids left out (the sample lacks a field the metric needs);
    * ``failed``: metric -> query ids RAGAS returned NaN for (e.g. unparseable LLM output);
    * ``ragas_names``: metric -> the RAGAS metric's own name (e.g. ``id_based_context_recall``);
    * ``ragas_results``: the raw ``ragas.EvaluationResult`` objects (one per RAGAS call).
    """

    metrics: tuple[str, ...]
    rows: list[dict[str, Any]]
    means: dict[str, float | None]
    counts: dict[str, int]
    skipped: dict[str, list[str]]
    failed: dict[str, list[str]]
    ragas_names: dict[str, str]
    ragas_results: list[Any] = field(default_factory=list, repr=False)

    def scores(self, metric: str) -> dict[str, float | None]:
        """query id -> score for one metric."""
        if metric not in self.metrics:
            raise ValueError(f"{metric!r} was not computed; this report has {list(self.metrics)}")
        return {row["query_id"]: row[metric] for row in self.rows}

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): metrics, means, counts, skipped, failed, rows."""
        return {
            "metrics": list(self.metrics),
            "means": dict(self.means),
            "counts": dict(self.counts),
            "skipped": {k: list(v) for k, v in self.skipped.items()},
            "failed": {k: list(v) for k, v in self.failed.items()},
            "rows": [dict(row) for row in self.rows],
        }

    def to_pandas(self) -> "pd.DataFrame":
        """One row per sample: query_id, user_input and the metric columns (NaN = no score)."""
        import pandas as pd

        frame = pd.DataFrame(self.rows, columns=["query_id", "user_input", *self.metrics])
        return frame.astype({name: float for name in self.metrics})


def run_ragas(
    ragas_dataset: "EvaluationDataset | Sequence[RagasSample | Mapping[str, Any]]",
    metrics: str | Sequence[str] = DEFAULT_RAGAS_METRICS,
    llm: Any = None,
    embed_model: Any = None,
    show_progress: bool = False,
    *,
    string_similarity: str = "levenshtein",
    query_ids: Sequence[str] | None = None,
    run_config: Any = None,
    raise_exceptions: bool = False,
) -> RagasReport:
    """Score ``ragas_dataset`` with RAGAS metrics named by our stable names (see :data:`RAGAS_METRICS`).

    ``ragas_dataset``: a RAGAS ``EvaluationDataset`` (e.g. from :func:`to_ragas_dataset`) or a
    list of :class:`RagasSample` / dicts with the ``SingleTurnSample`` fields (and ``query_id``).
    ``llm``: any LlamaIndex LLM (or an already wrapped RAGAS LLM), needed by the LLM metrics;
    ``embed_model``: any LlamaIndex embedding model, needed by ``answer_relevancy``.
    ``string_similarity`` (non-LLM string metrics; one of :data:`STRING_SIMILARITIES`): RAGAS'
    default ``"levenshtein"`` compares whole strings, so a chunk much longer than the reference
    passage scores below RAGAS' 0.5 threshold even when it holds the passage word for word;
    ``"containment"`` credits a chunk that holds the passage (small differences tolerated) and
    suits chunked retrieval better. Keep the default to compare with published RAGAS numbers.
    ``query_ids`` names the samples of a plain ``EvaluationDataset`` (default: the ids remembered
    by :func:`to_ragas_dataset`, else the positions "0", "1", ...). ``run_config``: a
    ``ragas.RunConfig`` (timeouts, retries, workers). ``raise_exceptions=True`` stops at the first
    failing sample instead of recording NaN (``failed``).

    Raises ValueError for unknown metric names (listing the allowed ones), and for LLM metrics
    without ``llm`` / ``answer_relevancy`` without ``embed_model`` - before anything runs.
    """
    names = _check_metrics(metrics)
    _check_models(names, llm, embed_model)
    if string_similarity not in STRING_SIMILARITIES:
        raise ValueError(f"unknown string_similarity {string_similarity!r}; choose one of {list(STRING_SIMILARITIES)}")
    samples = _coerce_samples(ragas_dataset, query_ids)

    ragas = _import_ragas()
    ragas_llm = _wrap_llm(llm, run_config) if any(RAGAS_METRICS[n].needs_llm for n in names) else None
    ragas_embeddings = (
        _wrap_embeddings(embed_model, run_config) if any(RAGAS_METRICS[n].needs_embeddings for n in names) else None
    )

    scores: dict[str, list[float | None]] = {name: [None] * len(samples) for name in names}
    skipped: dict[str, list[str]] = {}
    failed: dict[str, list[str]] = {name: [] for name in names}
    ragas_names: dict[str, str] = {}
    groups: dict[tuple[int, ...], list[str]] = {}
    for name in names:
        spec = RAGAS_METRICS[name]
        eligible, left_out = [], []
        for index, sample in enumerate(samples):
            nothing_retrieved = not sample.retrieved_contexts and not sample.retrieved_context_ids
            if not all(sample.has(need) for need in spec.needs):
                left_out.append(sample.query_id)
            elif spec.zero_if_nothing_retrieved and nothing_retrieved:
                scores[name][index] = 0.0
            elif spec.zero_if_nothing_retrieved and not sample.has(spec.retrieved_field):
                left_out.append(sample.query_id)  # e.g. texts without ids: unknown, not 0
            else:
                eligible.append(index)
        skipped[name] = left_out
        if left_out:
            logger.info(
                "%s: skipped %d of %d samples without %s (e.g. no-answer questions): %s",
                name, len(left_out), len(samples), " / ".join(_required_fields(spec)), left_out[:10],
            )
        zeros = len(samples) - len(left_out) - len(eligible)
        if zeros:
            logger.info("%s: %d samples retrieved nothing and score 0.0", name, zeros)
        if eligible:
            groups.setdefault(tuple(eligible), []).append(name)
        else:
            ragas_names[name] = _build_metric(ragas, name, None, None, string_similarity).name

    raw_results = []
    for indices, group_names in groups.items():
        instances = [_build_metric(ragas, name, ragas_llm, ragas_embeddings, string_similarity) for name in group_names]
        for name, instance in zip(group_names, instances):
            ragas_names[name] = instance.name
        subset = ragas.EvaluationDataset.from_list(
            [{k: v for k, v in samples[i].to_ragas_dict().items() if v is not None} for i in indices]
        )
        result = _evaluate(
            ragas, subset, instances, ragas_llm, ragas_embeddings, show_progress, run_config, raise_exceptions
        )
        raw_results.append(result)
        for position, index in enumerate(indices):
            for name, instance in zip(group_names, instances):
                value = result.scores[position].get(instance.name)
                if not isinstance(value, numbers.Real) or math.isnan(float(value)):
                    failed[name].append(samples[index].query_id)
                else:
                    scores[name][index] = float(value)
    for name, ids in failed.items():
        if ids:
            logger.warning("%s: RAGAS gave no score for %d samples (see its log above): %s", name, len(ids), ids[:10])

    rows = [
        {"query_id": s.query_id, "user_input": s.user_input, **{name: scores[name][i] for name in names}}
        for i, s in enumerate(samples)
    ]
    means: dict[str, float | None] = {}
    counts: dict[str, int] = {}
    for name in names:
        values = [value for value in scores[name] if value is not None]
        counts[name] = len(values)
        means[name] = sum(values) / len(values) if values else None
    return RagasReport(
        metrics=tuple(names),
        rows=rows,
        means=means,
        counts=counts,
        skipped=skipped,
        failed=failed,
        ragas_names=ragas_names,
        ragas_results=raw_results,
    )


def _required_fields(spec: RagasMetricSpec) -> tuple[str, ...]:
    """The sample fields a metric needs to be scored (for the skip log line)."""
    return (*spec.needs, spec.retrieved_field) if spec.zero_if_nothing_retrieved else spec.needs


def _check_metrics(metrics: str | Sequence[str]) -> list[str]:
    if isinstance(metrics, str):
        metrics = [metrics]
    names: list[str] = []
    for name in metrics:
        if name not in RAGAS_METRICS:
            raise ValueError(
                f"unknown RAGAS metric {name!r}; allowed: LLM-free {list(LLM_FREE_METRICS)}, "
                f"LLM-judged (need llm=) {list(LLM_METRICS)}"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"no metrics given; allowed: {list(RAGAS_METRICS)}")
    return names


def _check_models(names: Sequence[str], llm: Any, embed_model: Any) -> None:
    need_llm = [name for name in names if RAGAS_METRICS[name].needs_llm]
    if need_llm and llm is None:
        raise ValueError(
            f"metric(s) {', '.join(repr(n) for n in need_llm)} are judged by an LLM: pass llm=... (any LlamaIndex "
            "LLM, e.g. llama_index.llms.openai.OpenAI(model='gpt-4o-mini') or llama_index.llms.ollama.Ollama(...)). "
            f"This package never falls back to a default OpenAI judge. LLM-free metrics: {list(LLM_FREE_METRICS)}"
        )
    need_embeddings = [name for name in names if RAGAS_METRICS[name].needs_embeddings]
    if need_embeddings and embed_model is None:
        raise ValueError(
            f"metric(s) {', '.join(repr(n) for n in need_embeddings)} also need an embedding model: pass "
            "embed_model=... (any LlamaIndex embedding model, e.g. "
            "llama_index_retrieval_kit.models.default_embed_model())"
        )


def _coerce_samples(data: Any, query_ids: Sequence[str] | None) -> list[RagasSample]:
    if isinstance(data, RetrievalDataset):
        raise ValueError("run_ragas takes RAGAS samples: build them with to_ragas_dataset(dataset, results) first")
    raw = getattr(data, "samples", None)
    if raw is not None:  # a RAGAS EvaluationDataset
        remembered = getattr(data, "query_ids", None)
        ids = list(query_ids) if query_ids is not None else remembered
        if ids is not None and len(ids) != len(raw):
            if query_ids is not None:
                raise ValueError(f"query_ids has {len(ids)} ids for {len(raw)} samples")
            ids = None
        samples = []
        for position, sample in enumerate(raw):
            if not hasattr(sample, "retrieved_contexts"):
                raise ValueError(
                    f"sample {position} is a {type(sample).__name__}; only single-turn samples are supported"
                )
            dumped = {k: v for k, v in sample.model_dump().items() if k in _SAMPLE_FIELDS and v is not None}
            samples.append(_sample_from_mapping(dumped, position, ids[position] if ids is not None else None))
    elif isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        if query_ids is not None and len(query_ids) != len(data):
            raise ValueError(f"query_ids has {len(query_ids)} ids for {len(data)} samples")
        samples = []
        for position, item in enumerate(data):
            given = query_ids[position] if query_ids is not None else None
            if isinstance(item, RagasSample):
                renamed = item if given is None else _sample_from_mapping({**item.__dict__, "query_id": given}, position)
                samples.append(renamed)
            elif isinstance(item, Mapping):
                row = dict(item) if given is None else {**item, "query_id": given}
                samples.append(_sample_from_mapping(row, position))
            else:
                raise ValueError(f"sample {position}: expected a RagasSample or a dict, got {type(item).__name__}")
    else:
        raise ValueError(f"expected a RAGAS EvaluationDataset or a list of samples, got {type(data).__name__}")
    if not samples:
        raise ValueError("no samples to evaluate")
    duplicates = sorted({s.query_id for s in samples if [t.query_id for t in samples].count(s.query_id) > 1})
    if duplicates:
        raise ValueError(f"duplicate query ids: {duplicates[:5]}")
    return samples


# --------------------------------------------------------------------------------------------
# The RAGAS API surface (0.4.3): everything version-specific lives below.
# --------------------------------------------------------------------------------------------


def _import_ragas() -> Any:
    """``import ragas`` with telemetry off by default (a user's own RAGAS_DO_NOT_TRACK wins)."""
    from .._extras import require_extra

    require_extra("eval", "ragas", "RAGAS evaluation (run_ragas, to_ragas_dataset)")
    os.environ.setdefault(_TRACKING_ENV, "true")
    try:
        import ragas
    except Exception as exc:  # ragas or one of its dependencies is broken / missing
        raise ImportError(
            f"RAGAS could not be imported ({type(exc).__name__}: {exc}); this adapter needs ragas{SUPPORTED_RAGAS} "
            "(and rapidfuzz for the non-LLM string metrics)"
        ) from exc
    return ragas


def _build_metric(ragas: Any, name: str, llm: Any, embeddings: Any, string_similarity: str = "levenshtein") -> Any:
    """A fresh RAGAS metric object for our ``name``, with its LLM / embeddings set explicitly."""
    import importlib

    spec = RAGAS_METRICS[name]
    try:
        module = importlib.import_module(spec.ragas_module)
        cls = getattr(module, spec.ragas_class)
    except (ImportError, AttributeError):
        with warnings.catch_warnings():  # ragas.metrics.<Class> is a deprecated alias in 0.4.x
            warnings.simplefilter("ignore", DeprecationWarning)
            metrics_module = importlib.import_module("ragas.metrics")
            cls = getattr(metrics_module, spec.ragas_class, None)
        if cls is None:
            raise ImportError(
                f"ragas {getattr(ragas, '__version__', '?')} has no {spec.ragas_class} (needed for {name!r}); "
                f"this adapter supports ragas{SUPPORTED_RAGAS}"
            ) from None
    kwargs = dict(spec.kwargs)
    if spec.needs_llm:
        kwargs["llm"] = llm
    if spec.needs_embeddings:
        kwargs["embeddings"] = embeddings
    if spec.similarity_kwarg is not None:
        kwargs[spec.similarity_kwarg] = _string_similarity_metric(string_similarity)
    return cls(**kwargs)


def _string_similarity_metric(kind: str) -> Any:
    """The RAGAS string-similarity metric the non-LLM context metrics compare texts with."""
    if kind == "containment":
        return _containment_similarity_class()()
    from ragas.metrics._string import DistanceMeasure, NonLLMStringSimilarity

    return NonLLMStringSimilarity(distance_measure=DistanceMeasure(kind))


@functools.lru_cache(maxsize=1)
def _containment_similarity_class() -> Any:
    """A RAGAS ``SingleTurnMetric``: 1.0 when the retrieved chunk holds the reference passage.

    RAGAS' non-LLM context metrics call their similarity metric with
    ``SingleTurnSample(reference=<retrieved chunk>, response=<reference passage>)``.
    """
    from ragas.metrics.base import MetricType, SingleTurnMetric

    from .relevance import text_match

    @dataclass
    class ContainmentSimilarity(SingleTurnMetric):
        name: str = "containment_similarity"
        _required_columns: dict = field(default_factory=lambda: {MetricType.SINGLE_TURN: {"reference", "response"}})

        def init(self, run_config: Any) -> None:
            pass

        async def _single_turn_ascore(self, sample: Any, callbacks: Any) -> float:
            chunk, passage = sample.reference or "", sample.response or ""
            if not chunk.strip() or not passage.strip():
                return 0.0
            return 1.0 if text_match(passage, chunk) else 0.0

        async def _ascore(self, row: dict, callbacks: Any) -> float:  # legacy entry point
            from ragas.dataset_schema import SingleTurnSample

            return await self._single_turn_ascore(SingleTurnSample(**row), callbacks)

    return ContainmentSimilarity


def _wrap_llm(llm: Any, run_config: Any) -> Any:
    """A RAGAS LLM for ``llm``: LlamaIndex LLMs go through ragas.llms.base.LlamaIndexLLMWrapper."""
    from ragas.llms.base import BaseRagasLLM, InstructorBaseRagasLLM, LlamaIndexLLMWrapper

    if isinstance(llm, (BaseRagasLLM, InstructorBaseRagasLLM)):
        return llm
    from llama_index.core.base.llms.base import BaseLLM

    if not isinstance(llm, BaseLLM):
        raise TypeError(f"llm must be a LlamaIndex LLM (or a RAGAS LLM), got {type(llm).__name__}")
    with warnings.catch_warnings():  # deprecated in 0.4.x in favour of llm_factory (OpenAI-style clients)
        warnings.simplefilter("ignore", DeprecationWarning)
        return LlamaIndexLLMWrapper(llm, run_config=run_config)


def _wrap_embeddings(embed_model: Any, run_config: Any) -> Any:
    """RAGAS embeddings for ``embed_model``: LlamaIndex models go through LlamaIndexEmbeddingsWrapper."""
    from ragas.embeddings.base import BaseRagasEmbedding, BaseRagasEmbeddings, LlamaIndexEmbeddingsWrapper

    if isinstance(embed_model, (BaseRagasEmbeddings, BaseRagasEmbedding)):
        return embed_model
    from llama_index.core.base.embeddings.base import BaseEmbedding

    if not isinstance(embed_model, BaseEmbedding):
        raise TypeError(
            f"embed_model must be a LlamaIndex embedding model (or RAGAS embeddings), got {type(embed_model).__name__}"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return LlamaIndexEmbeddingsWrapper(embed_model, run_config=run_config)


def _evaluate(
    ragas: Any,
    subset: Any,
    instances: Sequence[Any],
    llm: Any,
    embeddings: Any,
    show_progress: bool,
    run_config: Any,
    raise_exceptions: bool,
) -> Any:
    """``ragas.evaluate`` on ready metric objects; refuses to let it pick default (OpenAI) models."""
    from ragas.metrics.base import MetricWithEmbeddings, MetricWithLLM

    for instance in instances:
        if isinstance(instance, MetricWithLLM) and instance.llm is None:
            raise RuntimeError(f"internal error: RAGAS metric {instance.name!r} has no LLM; refusing a default judge")
        if isinstance(instance, MetricWithEmbeddings) and instance.embeddings is None:
            raise RuntimeError(f"internal error: RAGAS metric {instance.name!r} has no embeddings; refusing a default")
    with warnings.catch_warnings():  # evaluate() is deprecated in 0.4.x in favour of @experiment
        warnings.simplefilter("ignore", DeprecationWarning)
        return ragas.evaluate(
            subset,
            metrics=list(instances),
            llm=llm,
            embeddings=embeddings,
            run_config=run_config,
            show_progress=show_progress,
            raise_exceptions=raise_exceptions,
        )
