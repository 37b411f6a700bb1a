"""``HybridIndex.as_chat_engine``: LlamaIndex's own chat engines over the index's retrievers.

As LlamaIndex's ``BaseIndex.as_chat_engine``: ``condense_plus_context`` (the default; LlamaIndex's
``best`` maps to it) and ``context`` get :meth:`HybridIndex.as_retriever`, ``condense_question``
gets :meth:`HybridIndex.as_query_engine`. Unlike LlamaIndex's, every keyword goes where it is used
(the retriever, the query engine, the chat engine's ``from_defaults``) and one that nothing takes
is refused: LlamaIndex's ``from_defaults(**kwargs)`` would drop it silently.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Tuple

from .._enums import ChatEngineMode
from .._settings import settings_llm

#: LlamaIndex chat modes that never read the index, and what to use instead.
NOT_INDEX_CHAT_MODES: Dict[str, str] = {
    "simple": (
        "chat_mode='simple' chats with the LLM alone and never reads the index: build it with "
        "llama_index.core.chat_engine.SimpleChatEngine.from_defaults(llm=...)"
    ),
    "react": (
        "chat_mode='react' was removed from LlamaIndex: build an agent (llama_index.core.agent.workflow.ReActAgent) "
        "with index.as_query_engine(llm=...) as a QueryEngineTool"
    ),
    "openai": (
        "chat_mode='openai' was removed from LlamaIndex: build an agent (llama_index.core.agent.workflow.FunctionAgent) "
        "with index.as_query_engine(llm=...) as a QueryEngineTool"
    ),
}

#: LlamaIndex's names for a mode of ours.
CHAT_MODE_ALIASES: Dict[str, ChatEngineMode] = {"best": ChatEngineMode.CONDENSE_PLUS_CONTEXT}


def check_chat_mode(chat_mode: Any) -> ChatEngineMode:
    """The :class:`ChatEngineMode` of ``chat_mode`` (ours, LlamaIndex's ``ChatMode``, or its string);
    a ValueError naming what to use for the modes that never read the index."""
    value = getattr(chat_mode, "value", chat_mode)
    if isinstance(value, str):
        if value in CHAT_MODE_ALIASES:
            return CHAT_MODE_ALIASES[value]
        if value in NOT_INDEX_CHAT_MODES:
            raise ValueError(NOT_INDEX_CHAT_MODES[value])
    return ChatEngineMode.from_str(value)


def chat_engine_class(chat_mode: ChatEngineMode) -> type:
    """LlamaIndex's chat engine class of ``chat_mode``."""
    from llama_index.core.chat_engine import CondensePlusContextChatEngine, CondenseQuestionChatEngine, ContextChatEngine

    return {
        ChatEngineMode.CONDENSE_PLUS_CONTEXT: CondensePlusContextChatEngine,
        ChatEngineMode.CONTEXT: ContextChatEngine,
        ChatEngineMode.CONDENSE_QUESTION: CondenseQuestionChatEngine,
    }[chat_mode]


def chat_engine_options(chat_mode: ChatEngineMode) -> Tuple[str, ...]:
    """The keywords the chat engine's ``from_defaults`` really uses (its ``**kwargs`` are dropped)."""
    params = inspect.signature(chat_engine_class(chat_mode).from_defaults).parameters
    return tuple(
        name for name, p in params.items()
        if name not in ("retriever", "query_engine", "llm", "self", "cls") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    )


def split_chat_engine_kwargs(mode: str, chat_mode: ChatEngineMode, kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Split ``as_chat_engine`` keywords into (the retriever's, or with ``condense_question`` the query
    engine's, keywords; the chat engine's). A keyword both take (``verbose``) goes to both; one that
    none takes raises a TypeError listing what each takes."""
    from .hybrid_index import check_node_postprocessors, query_engine_options, retriever_taker, route_keywords, split_query_engine_kwargs

    takers = [retriever_taker(mode)]
    if chat_mode is ChatEngineMode.CONDENSE_QUESTION:  # the chat engine wraps as_query_engine: its options too
        engine_names = query_engine_options()
        takers.append(("RetrieverQueryEngine.from_args", engine_names, engine_names))
    chat_names = chat_engine_options(chat_mode)
    *routed, chat = route_keywords(
        "as_chat_engine", kwargs, [*takers, (f"{chat_engine_class(chat_mode).__name__}.from_defaults", chat_names, chat_names)]
    )
    below = {name: value for part in routed for name, value in part.items()}
    split_query_engine_kwargs(mode, below)  # the retriever options this mode refuses, the query engine's checks
    check_node_postprocessors(chat.get("node_postprocessors"))
    return below, chat


def build_chat_engine(index: Any, chat_mode: Any, llm: Any, mode: str, similarity_top_k: int, kwargs: Dict[str, Any]) -> Any:
    """The chat engine of :meth:`HybridIndex.as_chat_engine` (see this module's docstring)."""
    chat = check_chat_mode(chat_mode)
    below, chat_kwargs = split_chat_engine_kwargs(mode, chat, kwargs)
    if llm is None and settings_llm() is None:
        raise ValueError(
            "as_chat_engine needs an LLM: pass llm=... (any LlamaIndex LLM) or set "
            "llama_index.core.Settings.llm; this package never falls back to a paid API"
        )
    engine_class = chat_engine_class(chat)
    if chat is ChatEngineMode.CONDENSE_QUESTION:
        query_engine = index.as_query_engine(llm=llm, mode=mode, similarity_top_k=similarity_top_k, **below)
        return engine_class.from_defaults(query_engine=query_engine, llm=llm, **chat_kwargs)
    retriever = index.as_retriever(mode=mode, similarity_top_k=similarity_top_k, **below)
    return engine_class.from_defaults(retriever=retriever, llm=llm, **chat_kwargs)
