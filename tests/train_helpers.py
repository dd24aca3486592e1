"""What the tests of train.py and of the toy recipe share: a run's flags, its checkpoints, two
CPU processes under torchrun, and scripted policies' answers."""
import os
import re
import socket
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

import agent
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, out, **extra):
    args = dict(model=tiny_lm_dir, corpus=small_corpus, encoder=tiny_encoder_dir, output_dir=str(out), preset="toy",
                batch_size=2, group_size=2, mini_batch_size=1, micro_batch_size=2, max_new_tokens=12, max_turns=2,
                lr=1e-3, save_every=1, warm_start_steps=0, old_logprobs="recompute", mixed_precision="no",
                kl_coef=0.001, oracle_per_group=0, no_oracle_when_unsolved=True, evidence_weight=0.0,
                no_skip_equal_groups=True, no_gradient_checkpointing=True)  # the released recipe; tests of the small-budget one turn it on
    args.update(extra)
    argv = []
    for k, v in args.items():
        argv += [f"--{k}"] if v is True else [f"--{k}", str(v)]
    return argv


def state(path):
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


# what `accelerate launch --use_fsdp --fsdp_version 2 ...` puts in each process's environment
FSDP = dict(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
            FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer", FSDP_STATE_DICT_TYPE="SHARDED_STATE_DICT",
            FSDP_CPU_RAM_EFFICIENT_LOADING="true", FSDP_SYNC_MODULE_STATES="true")


def run_two_processes(argv, **env):
    """torchrun --nproc_per_node 2 tests/scripted_policy.py <argv>; returns each rank's saved record."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **env)
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           os.path.join(ROOT, "tests", "scripted_policy.py"), *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = argv[argv.index("--output_dir") + 1]
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in (0, 1)]


def recording_advantages(monkeypatch):
    calls = []
    original = train.grpo.group_advantages
    monkeypatch.setattr(train.grpo, "group_advantages", lambda rewards, ids: calls.append(
        (list(rewards), list(ids), original(rewards, ids))) or calls[-1][2])
    return calls


def answering(answer):
    """A policy that answers at once, `answer(question)` in \\boxed{}."""
    def generate(model, tokenizer, prompts, **sampling):
        outs = []
        for p in prompts:
            question = re.search(r"<question> (.*?) </question>", tokenizer.decode(p), re.S).group(1)
            ids = agent.encode(tokenizer, "</think>\n\\boxed{%s}" % answer(question))
            ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
            outs.append(agent.Generation(ids=ids, logprobs=[0.0] * len(ids), finished=True))
        return outs
    return generate


def run_two_machines(script, argv, folders, timeout=120):
    """`torchrun --nnodes 2 --node_rank 0|1 --nproc_per_node 1` on 127.0.0.1: two "machines", each
    launched from its own folder (its working directory); returns each one's (exit code, output)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    procs = []
    for node, folder in enumerate(folders):
        os.makedirs(folder, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node",
               "1", "--master_addr", "127.0.0.1", "--master_port", str(port), script, *argv]
        procs.append(subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outputs)]
