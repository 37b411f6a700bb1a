"""What the user set on LlamaIndex's global ``Settings``, read without building its defaults.

``Settings.llm`` / ``Settings.embed_model`` build OpenAI models (and ``Settings.node_parser`` a
``SentenceSplitter``) on first access when nothing was
set, and LlamaIndex has no public "was it set?" query; so this module, and only this one, reads
the two slots behind those properties. This package never falls back to a paid API.
"""

from __future__ import annotations

from typing import Any, Optional


def settings_embed_model() -> Optional[Any]:
    """``Settings.embed_model`` when the user set one (a ``BaseEmbedding``), else None."""
    from llama_index.core import Settings
    from llama_index.core.base.embeddings.base import BaseEmbedding

    model = getattr(Settings, "_embed_model", None)
    return model if isinstance(model, BaseEmbedding) else None


def settings_llm() -> Optional[Any]:
    """``Settings.llm`` when the user set one, else None."""
    from llama_index.core import Settings

    return getattr(Settings, "_llm", None)


def settings_node_parser() -> Optional[Any]:
    """``Settings.node_parser`` when the user set one, directly or through ``Settings.chunk_size`` /
    ``Settings.chunk_overlap`` (which configure LlamaIndex's default ``SentenceSplitter``), else None.

    Reading ``Settings.node_parser`` (which LlamaIndex itself does, e.g. when a ``VectorStoreIndex``
    is built) stores a ``SentenceSplitter()`` with LlamaIndex's defaults in that slot; a parser
    equal to that default is therefore not taken as the user's choice (a user who wants exactly it
    passes ``node_parser=SentenceSplitter()``)."""
    from llama_index.core import Settings
    from llama_index.core.node_parser import NodeParser, SentenceSplitter

    parser = getattr(Settings, "_node_parser", None)
    if not isinstance(parser, NodeParser):
        return None
    if type(parser) is SentenceSplitter and parser.to_dict() == SentenceSplitter().to_dict():
        return None  # LlamaIndex's lazily built default, not a setting
    return parser


def engine_kwargs_for(llm: Optional[Any], engine_kwargs: dict) -> dict:
    """``RetrieverQueryEngine.from_args`` keywords that answer with ``llm`` in every response mode.

    LlamaIndex's ``get_response_synthesizer`` builds ``NoText`` (``response_mode="no_text"``)
    without the ``llm`` it was given, so that synthesizer falls back to ``Settings.llm``: OpenAI
    when nothing was set (an ImportError, or a paid API). For that mode the synthesizer is built
    here with ``llm`` (and the engine's ``callback_manager`` and ``streaming``), unless the caller
    passed a ``response_synthesizer``. Other modes are left to LlamaIndex. ``engine_kwargs`` is
    not changed."""
    mode = engine_kwargs.get("response_mode")
    if llm is None or engine_kwargs.get("response_synthesizer") is not None or str(getattr(mode, "value", mode)) != "no_text":
        return dict(engine_kwargs)
    from llama_index.core.response_synthesizers.no_text import NoText

    kwargs = dict(engine_kwargs)
    kwargs["response_synthesizer"] = NoText(
        llm=llm, callback_manager=kwargs.get("callback_manager"), streaming=bool(kwargs.get("streaming", False))
    )
    return kwargs
