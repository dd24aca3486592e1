"""Shared fixtures: tiny random models built from a config (fast, offline).

The suite runs on CPUs whatever the machine has: CUDA devices are hidden (here and in the
processes tests start), unless MEMSEARCHER_TEST_CUDA=1, which tools/gpu_check.py sets to run the
tests marked `cuda` (`pytest -m cuda`); those skip where no GPU is visible."""
import os
import shutil
import sys

if os.environ.get("MEMSEARCHER_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    why = pytest.mark.skip(reason="needs a CUDA GPU, with MEMSEARCHER_TEST_CUDA=1 (tools/gpu_check.py runs these)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(why)


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


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded default's ChatML tokenizer (read from its GGUF file; no weights loaded)."""
    from transformers import AutoTokenizer

    import agent

    if os.environ.get("MEMSEARCHER_TEST_TOKENIZER"):  # the same tokenizer saved as a folder (tools/gpu_check.py)
        tok = AutoTokenizer.from_pretrained(os.environ["MEMSEARCHER_TEST_TOKENIZER"])
    else:
        folder, name = os.path.split(agent.default_model_file())
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="session")
def tiny_lm(tokenizer):
    """A 2-layer random Llama over the default tokenizer's vocabulary, float32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_lm_dir(tiny_lm, tokenizer, tmp_path_factory):
    """The tiny model and the default tokenizer saved as a folder, loadable by `agent.load_model`."""
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    tiny_lm.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory, tiny_encoder_dir):
    """The first 200 toy passages, with their offset table and tiny-encoder index already cached."""
    import retriever

    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(retriever.DEFAULT_CORPUS) as src:
        path.write_text("".join(next(src) for _ in range(200)))
    retriever.open_retriever(corpus=str(path), encoder=tiny_encoder_dir)
    return str(path)
