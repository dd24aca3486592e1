"""Shared fixtures: tiny random models built from a config (fast, offline).

The suite runs on CPUs whatever the machine has: CUDA devices are hidden (here and in the
processes tests start), unless MEMSEARCHER_TEST_CUDA=1, which tools/gpu_check.py sets to run the
tests marked `cuda` (`pytest -m cuda`); those skip where no GPU is visible."""
import json
import os
import shutil
import sys

if os.environ.get("MEMSEARCHER_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


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

    from tools import models

    if os.environ.get("MEMSEARCHER_TEST_TOKENIZER"):  # the same tokenizer saved as a folder (tools/gpu_check.py)
        tok = AutoTokenizer.from_pretrained(os.environ["MEMSEARCHER_TEST_TOKENIZER"])
    else:
        folder, name = os.path.split(models.default_model_file())
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
    """The tiny model and the default tokenizer saved as a folder, loadable by `models.load`."""
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


@pytest.fixture(scope="session")
def yes_questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "question": f"Is fact number {i} true?", "golden_answers": ["yes"]}) + "\n"
                            for i in range(8)))
    return str(path)


@pytest.fixture(scope="session")
def demo_world(tmp_path_factory):
    """12 toy train questions with reasoning chains (8 to train on, 4 held out), and a corpus of
    their supporting passages plus 40 others; the embedded MiniLM finds each hop's entity by name."""
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "data", "toy", "train.jsonl"))][:12]
    corpus = [json.loads(line) for line in open(os.path.join(ROOT, "data", "toy", "corpus.jsonl"))]
    needed = {h["passage_id"] for r in rows for h in r["metadata"]["chain"]}
    passages = [p for p in corpus if p["id"] in needed] + [p for p in corpus[:60] if p["id"] not in needed][:40]
    folder = tmp_path_factory.mktemp("world")
    for name, items in (("train.jsonl", rows[:8]), ("heldout.jsonl", rows[8:]), ("corpus.jsonl", passages)):
        (folder / name).write_text("".join(json.dumps(x) + "\n" for x in items))
    return folder


@pytest.fixture(scope="session")
def two_process_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, yes_questions):
    from train_helpers import base_args

    common = dict(max_steps=2, train_data=yes_questions, batch_size=4, mini_batch_size=2, micro_batch_size=2, max_turns=4)
    return lambda out, **extra: base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, out, **{**common, **extra})
