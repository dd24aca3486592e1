"""Run train.py with a scripted policy (used by tests/test_train.py under torchrun).

Rank r's trajectories search r * 2 times before answering, so ranks hold different numbers of
conversations; answers are right or wrong at random (torch RNG, seeded per rank and step by
train.py), so advantages are non-zero; the ranks in TEST_YES_ON_RANKS (e.g. "0" or "0,1") always
answer "yes" instead, so all their groups are tied. Every generate call also runs one forward pass of the model
it is given: ranks make different numbers of calls, which would hang if that model were sharded.
At the end each rank saves its parameters (DDP) and a checksum of the weights each rollout saw.

Under FSDP (tests/train_helpers.FSDP: the environment `accelerate launch --use_fsdp --fsdp_version 2`
sets) ranks hold shards only, and save no parameters.
"""
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import agent  # noqa: E402
import train  # noqa: E402

RANK = int(os.environ.get("RANK", 0))
ALWAYS_YES = str(RANK) in os.environ.get("TEST_YES_ON_RANKS", "").split(",")  # these ranks always answer "yes"
FSDP = os.environ.get("ACCELERATE_USE_FSDP") == "true"
CALL = '</think>\n<tool_call>{"name": "wikipedia_search", "arguments": {"query": "%s"}}</tool_call>'
CHECKSUMS = []  # the rollout weights' checksum, each time it changes
TIMEOUT = []  # the process group's timeout


def scripted_generate(model, tokenizer, prompts, **sampling):
    if torch.distributed.is_initialized() and not TIMEOUT:  # the process group train.py's Accelerator set up
        group = torch.distributed.distributed_c10d._get_default_group()
        TIMEOUT.append(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    checksum = sum(p.double().sum().item() for p in model.parameters())
    if not CHECKSUMS or CHECKSUMS[-1] != checksum:
        CHECKSUMS.append(checksum)
    model(input_ids=torch.tensor([prompts[0][-8:]], device=next(model.parameters()).device))
    outs = []
    for p in prompts:
        text = tokenizer.decode(p)
        question = re.search(r"<question> (.*?) </question>", text, re.S).group(1)
        searched = int((re.findall(r"<memory> searched (\d+) </memory>", text) or ["0"])[-1])
        if not text.endswith("<think>"):  # memory update
            out = f"<memory>searched {searched + 1}</memory>"
        elif searched < 2 * RANK:
            out = CALL % question[:40]
        else:
            out = "</think>\n\\boxed{%s}" % ("yes" if ALWAYS_YES or torch.rand(()) < 0.5 else "no")
        ids = agent.encode(tokenizer, out) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        outs.append(agent.Generation(ids=ids, logprobs=[0.0] * len(ids), finished=True))
    return outs


if __name__ == "__main__":
    model = train.main(sys.argv[1:], generate_fn=scripted_generate)
    # under DDP every rank holds the whole policy; under FSDP only shards (the checkpoint has it whole)
    params = None if FSDP else {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
    out_dir = sys.argv[sys.argv.index("--output_dir") + 1]
    settings = {"timeout": TIMEOUT[0] if TIMEOUT else None,  # (None: no rollout ran)
                "gradient_as_bucket_view": getattr(model, "gradient_as_bucket_view", None)}
    torch.save({"params": params, "checksums": CHECKSUMS, "settings": settings}, os.path.join(out_dir, f"rank{RANK}.pt"))
