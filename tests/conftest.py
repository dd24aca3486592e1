"""Shared fixtures: tiny random models built from a config (fast, offline)."""
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def tiny_encoder_dir(tmp_path_factory):
    """A 2-layer random BERT with the embedded encoder's WordPiece tokenizer, saved as a folder."""
    from transformers import BertConfig, BertModel

    import retriever

    src = retriever.default_encoder_path()
    path = tmp_path_factory.mktemp("encoders") / "tiny-bert"
    path.mkdir()
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), path / name)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=256)
    BertModel(config).save_pretrained(path)
    return str(path)
