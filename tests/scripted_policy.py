"""Run train.py with a scripted policy (used by tests/test_train.py under torchrun).

Rank r's trajectories search r * 2 times before answering, so ranks hold different numbers of
conversations; answers are right or wrong at random (torch RNG, seeded per rank and step by
train.py), so advantages are non-zero. At the end each rank saves its parameters.
"""
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import agent  # noqa: E402
import train  # noqa: E402

RANK = int(os.environ.get("RANK", 0))
CALL = '</think>\n<tool_call>{"name": "wikipedia_search", "arguments": {"query": "%s"}}</tool_call>'


def scripted_generate(model, tokenizer, prompts, **sampling):
    outs = []
    for p in prompts:
        text = tokenizer.decode(p)
        question = re.search(r"<question> (.*?) </question>", text, re.S).group(1)
        searched = int((re.findall(r"<memory> searched (\d+) </memory>", text) or ["0"])[-1])
        if not text.endswith("<think>\n"):  # memory update
            out = f"<memory>searched {searched + 1}</memory>"
        elif searched < 2 * RANK:
            out = CALL % question[:40]
        else:
            out = "</think>\n\\boxed{%s}" % ("yes" if torch.rand(()) < 0.5 else "no")
        ids = agent.encode(tokenizer, out) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        outs.append(agent.Generation(ids=ids, logprobs=[0.0] * len(ids), finished=True))
    return outs


if __name__ == "__main__":
    model = train.main(sys.argv[1:], generate_fn=scripted_generate)
    params = [p.detach().cpu().clone() for p in model.parameters()]
    out_dir = sys.argv[sys.argv.index("--output_dir") + 1]
    torch.save(params, os.path.join(out_dir, f"params_rank{RANK}.pt"))
