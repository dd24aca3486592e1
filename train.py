"""Train a MemSearcher agent end to end with multi-context GRPO.

    accelerate launch train.py                                  # embedded default, toy data, any machine
    accelerate launch train.py --model Qwen/Qwen2.5-3B-Instruct --train_data nq_hotpotqa_train.parquet \\
        --retriever_url http://host:8000                        # the paper's settings (preset `paper`)
    torchrun --nproc_per_node 2 train.py --max_steps 2          # two CPU processes (gloo)

1. configuration (every hyperparameter, with the toy and the paper preset's value)
2. the training loop, `main`: set-up, then per step rollout -> rewards -> group advantages ->
   broadcast -> old/reference log-probs -> PPO updates -> metrics and checkpoints
3. the parts of a step (set-up, what flows, log-prob passes, the optimizer update, metrics)
4. the small-budget recipe of the toy preset (oracle in groups, evidence credit, tied groups
   skipped, the warm start), each off in the paper preset
5. speedup (exact): the update's shared prefixes     6. infrastructure (checkpoints, memory, logs)
"""
import argparse
import contextlib
import copy
import ctypes
import dataclasses
import glob
import json
import math
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from tqdm import tqdm

import agent
import grpo
import retriever
from toy.oracle import evidence_share
from data.questions import load_questions

# ---------------------------------------------------------------------------------------------
# 1. Configuration: (flag, toy preset, paper preset, help). Explicit flags override the preset.
# ---------------------------------------------------------------------------------------------
HYPERPARAMETERS = [
    ("model", "default", "Qwen/Qwen2.5-3B-Instruct", "policy: `default` (embedded SmolLM2-135M) or an HF name/path; paper: Qwen2.5-3B/7B-Instruct"),
    ("train_data", os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "toy", "train.jsonl"), None,
     "FlashRAG jsonl or Search-R1 parquet; paper: NQ + HotpotQA train"),
    ("agent", "memsearcher", "memsearcher", "memsearcher, or react (the baseline, one growing conversation)"),
    ("max_steps", 8, 660, "optimizer steps (each: one batch of questions); toy: validation F1 rises to step 6 and holds "
     "through 16 (docs/learning.md); paper: 1 epoch = ~660"),
    ("batch_size", 4, 256, "questions per step, over all ranks; paper: 256"),
    ("group_size", 4, 5, "G, trajectories per question; paper: 5"),
    ("mini_batch_size", 4, 128, "optimizer updates see mini_batch_size x G conversations each, in rollout order; paper: 128 (x 5 = 640)"),
    ("micro_batch_size", 1, 4, "conversations per forward/backward (memory knob, not math; toy: 1, with checkpointing "
     "a step peaks at 5-6.6 GB, docs/performance.md)"),
    ("ppo_epochs", 1, 1, "passes over a step's conversations; paper: 1"),
    ("warm_start_steps", 30, 0, "supervised steps on oracle demonstrations before GRPO (docs/design.md; toy: ~half an epoch, ~10 min); paper: 0"),
    ("warm_start_questions", 100, 0, "train questions the oracle acts out for the warm start (toy: ~250 conversations, 30 steps see half)"),
    ("warm_start_mix", "1:1:1", "1:1:1", "shares of single-hop:bridge:comparison among those questions, first ones of each type in file order"),
    ("warm_start_batch", 4, 4, "demonstration conversations per warm-start step, over all ranks"),
    ("warm_start_lr", 1e-4, 1e-5, "AdamW learning rate of the warm start, constant"),
    ("warm_start_save_every", 10, 10, "save the warm start's state every N steps, so --resume continues an interrupted one"),
    ("lr", 1e-5, 1e-6, "AdamW learning rate, constant; paper: 1e-6"),
    ("weight_decay", 0.01, 0.01, "AdamW weight decay; paper: 0.01"),
    ("grad_clip", 1.0, 1.0, "max global gradient norm; paper: 1.0"),
    ("clip_eps", 0.2, 0.2, "PPO ratio clip epsilon; paper: 0.2"),
    ("clip_ratio_c", 3.0, 3.0, "dual-clip bound c for negative advantages; paper: 3"),
    ("old_logprobs", "recorded", "recompute", "recorded (from sampling; used only in float32 without autocast, where "
     "they equal the recomputation) or recompute (a forward pass before the update, as released)"),
    ("kl_coef", 0.0, 0.001, "k3 KL-to-reference coefficient (0 skips the reference model; toy: 0, as David-GRPO's "
     "first stage); paper: 0.001"),
    ("entropy_coef", 0.0, 0.001, "entropy bonus coefficient; paper: 0.001 (toy: 0: with no reward signal it only raises entropy)"),
    # The small-budget recipe (section 4; docs/design.md): every option off in the paper preset.
    ("oracle_per_group", 1, 0, "K oracle trajectories (toy/oracle.py) join each group whose question has a reasoning chain "
     "(expert bootstrapping: David-GRPO, LUFFY); paper: 0"),
    ("oracle_when_unsolved", True, False, "add the oracle only to groups where no sampled trajectory earned reward 1"),
    ("evidence_weight", 0.3, 0.0, "lambda: reward = (1 - lambda) released reward + lambda share of the question's supporting "
     "passages retrieved (David-GRPO's evidence credit), for rows with supporting ids; paper: 0"),
    ("reroll_turn", 0, 0, "K > 0: G more continuations per question from one sampled trajectory's memory after turn K, a group "
     "of their own (qid@K) whose advantages compare members that faced the same state (Memory-R2, Tree-GRPO); 0: off"),
    ("skip_equal_groups", True, False, "groups whose rewards are all equal (advantage 0) skip the log-prob passes and the update "
     "(DAPO, MemAgent); the token-mean is then over the kept tokens"),
    ("mixed_precision", "auto", "auto", "no, bf16, or auto: the launcher's bf16/fp16 if set, else bf16 autocast on a GPU that "
     "supports it or a CPU with AMX, else none; the trained weights stay float32, frozen copies follow the run's precision"),
    # Memory (docs/memory_plan.md: which settings fit which GPUs): none of these changes the math
    ("rollout_batch_size", 0, 64, "rows (trajectories) per generate call: a rank's trajectories roll out in chunks of "
     "R // G questions (0: all at once); paper preset: 64 (the plan, docs/memory_plan.md: a 3B model on 80 GB cards, "
     "DDP or FSDP; 32 for LoRA on a 24 GB card)"),
    ("reference_on_cpu", False, False, "keep the frozen KL reference on the CPU, moved to the GPU for its log-prob pass only "
     "(the release offloads it the same way)"),
    ("lora_rank", 0, 0, "r > 0: train LoRA adapters of rank r instead of every weight (needs peft); the KL reference is "
     "the base model, the adapter disabled; checkpoints hold the adapter"),
    ("lora_alpha", 64, 64, "LoRA scale alpha (the update is alpha / r * B A x)"),
    ("lora_target_modules", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
     "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "the linear layers that get adapters"),
    ("max_turns", 3, 5, "turns per trajectory in training; paper: 5"),
    ("max_new_tokens", 128, 512, "tokens per generation; paper: 512"),
    ("max_memory_tokens", 1024, 1024, "memory cap in tokens; paper: 1024"),
    ("max_response_tokens", 4096, 8192, "a conversation's response part is cut here and the trajectory ends"),
    ("default_top_n", 5, 10, "passages for a call that gives no top_n; paper: 10 (the release's server)"),
    ("doc_format", "release", "release", "how results are shown: release (raw contents) or search-r1 (Doc k(Title: ...))"),
    ("system_prompt", None, None, "a file with the system prompt (default: ours; the release's wording for its checkpoints)"),
    ("memory_instruction", None, None, "a file with the memory-update instruction (default: ours)"),
    ("temperature", 1.0, 1.0, "sampling temperature; paper: 1.0"),
    ("top_p", 0.99, 0.99, "nucleus sampling; paper: 0.99"),
    ("top_k", 10000, 10000, "top-k sampling; paper: 10000"),
    ("retriever_url", None, None, "a retrieval server shared by all ranks: .../retrieve (Search-R1 API) or .../search (the release's); else a local index"),
    ("retriever_timeout", 300.0, 300.0, "seconds a request to --retriever_url may take before it is tried again"),
    ("retriever_retries", 5, 5, "tries after the first for a failed request (timeouts, 5xx), with waits of 1, 2, 4, ... s"),
    ("corpus", None, None, "local corpus jsonl (default: data/toy/corpus.jsonl); paper: wiki-18.jsonl"),
    ("index", None, None, "local FAISS index (default: built beside the corpus); paper: e5_Flat.index"),
    ("encoder", None, None, "retrieval encoder (default: embedded MiniLM); paper: intfloat/e5-base-v2"),
    ("output_dir", "runs/memsearcher", "runs/memsearcher", "checkpoints, metrics.jsonl, samples.jsonl"),
    ("save_every", 2, 20, "checkpoint every N steps (and at the end)"),
    ("keep_checkpoints", 2, 3, "how many newest checkpoints to keep"),
    ("resume", False, False, "continue from the newest checkpoint in output_dir"),
    ("shared_prefix", True, True, "encode the token prefixes the conversations share (the system prompt; a group's turn-1 prompt) once per "
     "log-prob pass and per update, not once per conversation (exact; docs/performance.md)"),
    ("gradient_checkpointing", True, True, "recompute activations in the update to save memory (toy: peak 6.6 -> 5.0 GB, "
     "update +8%, docs/performance.md)"),
    ("sample_groups", 1, 1, "groups per step written whole to samples.jsonl (each trajectory's reward, advantage, "
     "oracle flag, and per conversation its tokens, loss mask and log-probs; tools/report.py renders them)"),
    ("report_to", None, None, "accelerate trackers: tensorboard, wandb, ... (comma-separated)"),
    ("timeout_minutes", 60, 60, "how long a rank waits for the others at a collective before the run fails (e.g. while "
     "rank 0 builds the index; the default of torch's NCCL watchdog is 10)"),
    ("seed", 0, 0, "data order, sampling (offset per rank and step), initialisation"),
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["toy", "paper"], default=None,
                    help="defaults to use: toy (embedded model, CPU-sized) unless --model names another model")
    for name, toy, paper, help_ in HYPERPARAMETERS:
        kind = {bool: "flag", int: int, float: float}.get(type(toy), str)
        help_ = help_.replace("%", "%%")  # argparse formats help strings with %
        if kind == "flag":
            ap.add_argument(f"--{name}", action="store_true", default=None, help=f"{help_} (toy: {toy}; paper: {paper})")
            ap.add_argument(f"--no_{name}", dest=name, action="store_false", help=argparse.SUPPRESS)
        else:
            ap.add_argument(f"--{name}", type=kind, default=None, help=f"{help_} (toy: {toy}; paper: {paper})")
    args = ap.parse_args(argv)
    preset = args.preset or checkpoint_preset(args.model) or ("toy" if args.model in (None, "default") else "paper")
    args.source = {}  # where each value came from, for configuration errors
    for name, toy, paper, _ in HYPERPARAMETERS:
        args.source[name] = "flag"
        if getattr(args, name) is None:
            value = toy if preset == "toy" or (name == "train_data" and paper is None) else paper
            setattr(args, name, value)
            args.source[name] = f"{preset} preset"
    args.preset = preset
    return args


def checkpoint_preset(model):
    """A checkpoint made by train.py continues with the preset it was trained with."""
    path = os.path.join(str(model), "trainer_state.json")
    return json.load(open(path))["args"].get("preset") if os.path.isfile(path) else None


def warm_start_mix(args):
    """--warm_start_mix "1:1:1" -> {"single": 1.0, "bridge": 1.0, "comparison": 1.0}."""
    try:
        shares = [float(x) for x in args.warm_start_mix.split(":")]
    except ValueError:
        shares = []
    if len(shares) != 3 or min(shares) < 0 or sum(shares) <= 0:
        raise ValueError("give three shares >= 0, not all 0, as single:bridge:comparison (e.g. 1:1:1)")
    return dict(zip(("single", "bridge", "comparison"), shares))


def described(args, name):
    return f"--{name} {getattr(args, name)} ({args.source.get(name, 'flag')})"


def check_config(args, world_size, distributed_type=None):
    """Fail fast, before loading anything large."""
    problems = []
    if distributed_type == DistributedType.DEEPSPEED:
        problems.append("DeepSpeed is not supported: its engine steps the optimizer after a fixed number of micro-batches, "
                        "while a GRPO step's count varies with the conversations; use FSDP (accelerate config) to shard")
    if args.group_size < 2:
        problems.append(f"--group_size must be >= 2 (GRPO compares trajectories within a group), got {args.group_size}")
    if args.batch_size % world_size:
        problems.append(f"{described(args, 'batch_size')} must be divisible by the {world_size} processes (groups never split across ranks)")
    if args.batch_size % args.mini_batch_size:
        problems.append(f"{described(args, 'batch_size')} must be a multiple of {described(args, 'mini_batch_size')}")
    if args.doc_format not in retriever.DOC_FORMATS:
        problems.append(f"--doc_format must be one of {', '.join(retriever.DOC_FORMATS)}, got {args.doc_format!r}")
    if not 0.0 <= args.evidence_weight <= 1.0:
        problems.append(f"{described(args, 'evidence_weight')} must be in [0, 1]")
    if args.oracle_per_group < 0:
        problems.append(f"{described(args, 'oracle_per_group')} must be >= 0")
    if args.lora_rank and distributed_type == DistributedType.FSDP:
        problems.append("--lora_rank trains under DDP or on one GPU, not FSDP (the adapter and its optimizer state are small; "
                        "the frozen base is held whole on each rank, in bf16)")
    if args.lora_rank > 0:
        try:
            agent.peft_module()
        except ImportError as e:
            problems.append(str(e))
    if args.lora_rank < 0:
        problems.append(f"{described(args, 'lora_rank')} must be >= 0")
    if args.reroll_turn and (args.agent != "memsearcher" or not 0 < args.reroll_turn < args.max_turns):
        problems.append(f"{described(args, 'reroll_turn')} needs --agent memsearcher and 0 < K < {described(args, 'max_turns')} "
                        "(a state after turn K that the trajectory went on from)")
    if args.rollout_batch_size < 0:
        problems.append(f"{described(args, 'rollout_batch_size')} must be >= 0 (0: all rows at once)")
    if not os.path.isfile(args.train_data):
        problems.append(f"--train_data not found: {args.train_data}")
    try:
        warm_start_mix(args)
    except ValueError as e:
        problems.append(f"{described(args, 'warm_start_mix')}: {e}")
    if problems:
        raise SystemExit("train.py: bad configuration:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------
# 2. The training loop: rollout -> rewards -> group advantages -> broadcast -> old/ref log-probs
#    -> PPO updates -> log (each step's parts are the functions of section 3)
# ---------------------------------------------------------------------------------------------
def main(argv=None, generate_fn=None):
    args = parse_args(argv)
    multi_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1  # torchrun on CPUs: gloo
    precision = resolve_precision(args.mixed_precision)
    accelerator = Accelerator(cpu=multi_cpu, mixed_precision=precision, project_dir=args.output_dir,  # trackers log there
                              log_with=args.report_to.split(",") if args.report_to else None,
                              kwargs_handlers=accelerator_settings(args))
    rank, world = accelerator.process_index, accelerator.num_processes
    check_config(args, world, accelerator.distributed_type)
    accelerator.print(f"precision: float32 trained weights, {'no autocast' if precision == 'no' else precision + ' autocast'}"
                      f" (--mixed_precision {args.mixed_precision})")
    questions = load_questions(args.train_data)
    if len(questions) < args.batch_size:
        raise SystemExit(f"train.py: {args.train_data} has {len(questions)} questions, fewer than --batch_size {args.batch_size}")
    set_seed(args.seed)
    search = open_search(args, accelerator)
    model, optimizer, tokenizer, reference, rollout_model = load_models(args, accelerator)
    sharded = rollout_model is not None  # FSDP: each rank rolls out with a full copy of the policy
    policy = rollout_model if sharded else accelerator.unwrap_model(model)  # generates, and gives old log-probs
    rollout_kwargs = rollout_settings(args)
    sampling = dict(group_size=args.group_size, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, generate_fn=generate_fn,
                    **rollout_kwargs)  # GRPO's rollouts (and re-rolls)
    os.makedirs(args.output_dir, exist_ok=True)
    accelerator.init_trackers("memsearcher", config={k: v for k, v in vars(args).items() if v is not None and k != "source"})
    log = logger(accelerator, args.output_dir)
    if args.warm_start_steps > 0:  # toy preset: supervised steps on oracle demonstrations first (section 4)
        run_warm_start(accelerator, model, optimizer, tokenizer, reference, rollout_model, search, args, rollout_kwargs, log)

    start_step = 0
    if args.resume and list_checkpoints(args.output_dir):
        last = list_checkpoints(args.output_dir)[-1]
        accelerator.load_state(os.path.join(last, "state"))
        start_step = json.load(open(os.path.join(last, "trainer_state.json")))["step"]
        accelerator.print(f"resumed from {last} (step {start_step})")
    if accelerator.is_main_process and args.max_steps > start_step:
        trim_logs(args.output_dir, "grpo", start_step)
    bar = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps,
               disable=not accelerator.is_main_process, desc="steps")
    for step in bar:
        # --- rollout: this rank's share of the step's questions, G trajectories each ----------
        t0, grpo.ENCODED_TOKENS[0] = time.time(), 0
        share = args.batch_size // world
        mine = step_questions(questions, step, args.batch_size, args.seed)[rank * share:(rank + 1) * share]
        if sharded:
            gather_full_weights(model, rollout_model)
        seed = args.seed * 100003 + step * world + rank  # sampling seeded per rank and step (and chunk)
        with accelerator.autocast():  # generate in the update's precision (bf16 on GPU with --mixed_precision bf16)
            trajectories = rollout_in_chunks(policy, tokenizer, mine, search, args.rollout_batch_size, seed, **sampling)
            rows, rerolls = rerollouts(args, policy, tokenizer, mine, trajectories, search, seed + 500009, sampling)  # off: []
        release_freed_memory()
        experts = oracle_trajectories(args, mine, trajectories, search, tokenizer, seed,
                                      rollout_kwargs)  # toy recipe: the oracle joins unsolved groups (none in the paper preset)
        t_rollout = time.time() - t0

        # --- rewards -> group advantages A_i -> one advantage per conversation, A_ij = A_i ----
        batch = Batch(mine, trajectories, experts, rerolls)
        batch.rewards, batch.evidence = shaped_rewards(args, batch.group, mine + rows)  # toy recipe: + evidence credit
        batch.advantages = advantages = grpo.group_advantages(batch.rewards, [t.qid for t in batch.group])
        batch.tied, batch.kept = skip_tied_groups(args, batch.group, advantages)  # toy recipe: tied groups not trained
        owner = [i for i in batch.kept for _ in batch.group[i].conversations]
        batch.conversations = [c for i in batch.kept for c in batch.group[i].conversations]
        for c, a in zip(batch.conversations, grpo.propagate_advantages(advantages, owner).tolist()):
            c.advantage = a

        # --- old log-probs (the policy before any update) and reference log-probs ------------
        t0 = time.time()
        sampled = [batch.sampled(batch.group[i]) for i in owner]  # the oracle's have no recorded log-probs
        with accelerator.autocast():  # the same precision as the update's forward passes
            gap = old_and_reference_logprobs(args, accelerator, policy, reference, batch.conversations, sampled,
                                             tokenizer.pad_token_id)
        t_reference = time.time() - t0

        # --- PPO epochs of mini-batches, one optimizer update each -----------------------------
        t0, peak_before = time.time(), peak_memory(reset=True)  # the rollout's and log-prob passes' peak
        filler = batch.conversations[:1] or [blank(batch.group[0].conversations[0])]  # a rank with nothing to train
        sums, grad_norms = ppo_updates(accelerator, model, optimizer, batch.conversations, filler, args.kl_coef > 0,
                                       tokenizer.pad_token_id, args)
        t_update, peak_update = time.time() - t0, peak_memory(reset=True)

        # --- metrics over all ranks, samples, checkpoint ---------------------------------------
        timing = dict(lr=optimizer.param_groups[0]["lr"], seconds_rollout=t_rollout, seconds_reference=t_reference,
                      seconds_update=t_update, peak_memory_gb=max(peak_before, peak_update), peak_update_gb=peak_update)
        row = step_metrics(accelerator, step + 1, batch, sums, grad_norms, gap, timing)
        log(row)
        if accelerator.is_main_process:
            write_samples(args.output_dir, step + 1, batch, tokenizer, args.sample_groups)
            bar.set_postfix(reward=f"{row['reward']:.3f}", turns=f"{row['turns']:.2f}", kl=f"{row['kl']:.4f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.max_steps:
            save_checkpoint(accelerator, model, tokenizer, args, step + 1)
    accelerator.end_training()
    return model


# ---------------------------------------------------------------------------------------------
# 3. The parts of a step: set-up, what flows, old/reference log-probs, PPO updates, metrics
# ---------------------------------------------------------------------------------------------
def open_search(args, accelerator):
    """The search tool: a local flat index (the main process builds a missing index cache first)
    or a server shared by all ranks (checked before anything large is loaded)."""
    with accelerator.main_process_first():
        search = retriever.open_retriever(args.corpus, args.index, args.encoder, url=args.retriever_url, doc_format=args.doc_format,
                                          timeout=args.retriever_timeout, retries=args.retriever_retries,
                                          device=accelerator.device if accelerator.device.type == "cuda" else "cpu")
    if args.retriever_url:  # fail fast if the server is not there
        try:
            search.search(["ping"], 1)
        except ConnectionError as e:
            raise SystemExit(f"train.py: --retriever_url: {e}") from None
    return search


def accelerator_settings(args):
    """What the Accelerator is built with: a process-group timeout (--timeout_minutes), and DDP's
    gradient buckets as views of the gradients (no second copy of them)."""
    from datetime import timedelta

    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
    return [InitProcessGroupKwargs(timeout=timedelta(minutes=args.timeout_minutes)),
            DistributedDataParallelKwargs(gradient_as_bucket_view=True)]


def load_models(args, accelerator):
    """The policy and its optimizer, prepared for DDP/FSDP, plus the frozen copies it needs:

    - full fine-tuning: float32 trained weights; the KL reference (only with --kl_coef > 0) and,
      under FSDP, a full rollout copy, both in the run's precision (bfloat16 in a bf16 run);
    - LoRA (--lora_rank r): the base frozen in the run's precision, float32 adapters; no copy,
      since the reference is the policy with its adapter disabled (`reference_pass`).
    Returns (model, optimizer, tokenizer, reference or None, rollout copy or None)."""
    frozen_dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
    model, tokenizer = agent.load_model(args.model, dtype=frozen_dtype if args.lora_rank else torch.float32)
    frozen = lambda m: copy.deepcopy(m).to(frozen_dtype).eval().requires_grad_(False)  # noqa: E731
    reference = frozen(model) if args.kl_coef > 0 and not args.lora_rank else None
    sharded = accelerator.distributed_type == DistributedType.FSDP  # then roll out with a full copy
    rollout_model = frozen(model) if sharded else None
    if args.gradient_checkpointing:  # active in train mode only: rollouts keep the KV cache
        enable = getattr(model, "activation_checkpointing_enable", None)  # newer transformers; the old name warns
        if enable:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_rank:
        model = agent.add_adapter(model, args.lora_rank, args.lora_alpha, args.lora_target_modules)
        adapter_only_state(accelerator, model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    # accelerate wraps the forward in autocast with float32 outputs: a float32 copy of every logits
    # tensor (4 x 3k x 152k x 4 bytes = 7 GB a micro-batch at the paper's shape). Every pass here
    # runs inside accelerator.autocast() anyway, so the plain forward is put back: logits stay bf16.
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    if rollout_model is not None:
        rollout_model.to(accelerator.device)
    if reference is not None and not args.reference_on_cpu:
        reference.to(accelerator.device)
    return model, optimizer, tokenizer, reference, rollout_model


def adapter_only_state(accelerator, model):
    """With LoRA, accelerator.save_state/load_state keep only the trainable (adapter) weights: the
    frozen base is --model itself, loaded at start (a 3B base would add 6 GB to every checkpoint)."""
    from safetensors.torch import load_file

    trained = {n for n, p in model.named_parameters() if p.requires_grad}

    def save(models, weights, output_dir):
        for i, w in enumerate(weights):
            weights[i] = {k: v for k, v in w.items() if any(k.endswith(n) for n in trained)}

    def load(models, input_dir):
        m = models.pop(0)  # loaded here, not by accelerate (which expects every weight)
        tensors = load_file(os.path.join(input_dir, "model.safetensors"), device=str(next(m.parameters()).device))
        missing, unexpected = m.load_state_dict(tensors, strict=False)
        if unexpected or len(tensors) != len(trained):
            raise SystemExit(f"train.py: {input_dir} does not hold this run's LoRA adapter (--lora_rank, "
                             f"--lora_target_modules): {len(tensors)} tensors saved, {len(trained)} expected")
    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def rollout_in_chunks(policy, tokenizer, questions, search, rollout_batch_size, seed, group_size, **kwargs):
    """agent.rollout over the rank's questions in chunks of R // G questions (R = --rollout_batch_size
    rows per generate call; 0: one chunk), so the KV cache of only R rows is in memory at once.
    Chunk c samples with torch seed `seed + 1000003 * c` (chunk 0 with `seed`, as one chunk does):
    greedy results do not depend on R; sampled ones are another draw for each R."""
    per = max(1, rollout_batch_size // group_size) if rollout_batch_size else max(1, len(questions))
    trajectories = []
    for c, start in enumerate(range(0, len(questions), per)):
        torch.manual_seed(seed + 1000003 * c)
        trajectories += agent.rollout(policy, tokenizer, questions[start:start + per], search, group_size=group_size, **kwargs)
    return trajectories


def rerollouts(args, policy, tokenizer, questions, trajectories, search, seed, sampling):
    """--reroll_turn K: local re-rolls from a shared memory state (Memory-R2; Tree-GRPO shares
    prefixes the same way). A MemSearcher state is (question, memory), so for each question the
    first of its G trajectories that went on past turn K gives its memory after turn K, and G more
    trajectories continue from exactly that state: a group of its own, keyed qid@K. Its members
    faced the same context, so their advantages credit the decision taken there (search again or
    answer) rather than everything a whole trajectory did. Each keeps the earlier turns' log (the
    evidence credit sees their documents), and trains only its own conversations.
    Returns (question rows of the re-rolled groups, their trajectories); ([], []) when K = 0."""
    if not args.reroll_turn:
        return [], []
    rows = []
    for q in questions:
        parent = next((t for t in trajectories if t.qid == str(q["id"]) and t.num_turns > args.reroll_turn), None)
        if parent is not None:
            rows.append({**q, "id": f"{q['id']}@{args.reroll_turn}", "state": agent.state_after(parent, args.reroll_turn)})
    return rows, rollout_in_chunks(policy, tokenizer, rows, search, args.rollout_batch_size, seed, **sampling) if rows else []


def rollout_settings(args):
    """The agent's settings shared by GRPO's rollouts and the oracle's (prompts from files or ours)."""
    default_prompt = agent.REACT_SYSTEM_PROMPT if args.agent == "react" else agent.SYSTEM_PROMPT
    return dict(agent=args.agent, max_memory_tokens=args.max_memory_tokens, max_response_tokens=args.max_response_tokens,
                default_top_n=args.default_top_n, system_prompt=agent.read_prompt_file(args.system_prompt, default_prompt),
                memory_instruction=agent.read_prompt_file(args.memory_instruction, agent.MEMORY_INSTRUCTION))


def logger(accelerator, output_dir):
    """log(row): a line of metrics.jsonl (main process) and the trackers, keyed phase/name."""
    def log(row):
        if accelerator.is_main_process:
            with open(os.path.join(output_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
        accelerator.log({f"{row['phase']}/{k}": v for k, v in row.items() if k != "phase"})
    return log


@dataclass
class Batch:
    """One step's trajectories on this rank, and what the step derives from them."""
    questions: list[dict]  # this rank's share of the step's questions
    trajectories: list[agent.Trajectory]  # G sampled per question
    experts: list[agent.Trajectory]  # the oracle's, joining their groups (toy recipe; else [])
    rerolls: list[agent.Trajectory] = field(default_factory=list)  # --reroll_turn: groups of their own (qid@K), after the others
    rewards: list[float] = field(default_factory=list)  # per trajectory of `group`: what the advantages are computed from
    evidence: list[float] = field(default_factory=list)  # per trajectory of `group`: share of supporting passages retrieved
    advantages: torch.Tensor | None = None  # per trajectory of `group`: A_i, its group's normalised reward
    tied: set[str] = field(default_factory=set)  # question ids of the groups whose rewards are all equal (A = 0)
    kept: list[int] = field(default_factory=list)  # indices into `group` of the trajectories trained on
    conversations: list[agent.Conversation] = field(default_factory=list)  # the kept trajectories' conversations

    def __post_init__(self):
        position = {str(q["id"]): k for k, q in enumerate(self.questions)}
        self.group = sorted(self.trajectories + self.experts, key=lambda t: position[t.qid]) + self.rerolls  # samples, oracle
        self.broadcast = len(self.group) - len(self.rerolls)  # group[:broadcast]: the question's own groups (the metrics')
        self._oracle = {id(t) for t in self.experts}

    def sampled(self, trajectory) -> bool:
        """Sampled by the policy (not the oracle's)."""
        return id(trajectory) not in self._oracle


def old_and_reference_logprobs(args, accelerator, policy, reference, conversations, sampled, pad_id):
    """Fill each conversation's `old_logprobs` (pi_old, the policy that sampled) and `ref_logprobs`
    (the KL reference; pi_old's when there is none). Those recorded while sampling equal a
    recomputation in float32 without autocast (tests/test_agent.py: parity 1e-4), so
    --old_logprobs recorded skips that forward pass there; the oracle's are always recomputed.
    Returns the largest |recorded - used| over sampled trained tokens (0 when they are the same)."""
    recorded_old = args.old_logprobs == "recorded" and accelerator.mixed_precision == "no"
    recorded = [recorded_old and s for s in sampled]
    recompute = [c for c, r in zip(conversations, recorded) if not r]
    fresh = iter(grpo.response_logprobs(policy, recompute, pad_id, accelerator.device, args.micro_batch_size,
                                        args.temperature, args.shared_prefix) if recompute else [])
    old = [torch.tensor(c.logprobs) if r else next(fresh) for c, r in zip(conversations, recorded)]
    gap = max((float((torch.tensor(c.logprobs) - o).abs().mul(torch.tensor(c.loss_mask)).max())
               for c, o, s in zip(conversations, old, sampled) if s and c.loss_mask), default=0.0)
    ref = None
    if args.kl_coef > 0:
        with reference_pass(args, policy, reference, accelerator.device) as model:
            ref = grpo.response_logprobs(model, conversations, pad_id, accelerator.device, args.micro_batch_size,
                                         args.temperature, args.shared_prefix)
    for k, c in enumerate(conversations):
        c.old_logprobs = old[k].tolist()
        c.ref_logprobs = ref[k].tolist() if ref is not None else c.old_logprobs
    return gap


@contextlib.contextmanager
def reference_pass(args, policy, reference, device):
    """The KL reference for one log-prob pass: with LoRA the policy with its adapter disabled (the
    base model); else the frozen copy, which --reference_on_cpu keeps on the CPU between passes."""
    if args.lora_rank:
        with policy.disable_adapter():
            yield policy
        return
    on_cpu = next(reference.parameters()).device.type == "cpu" and torch.device(device).type != "cpu"
    try:
        yield reference.to(device) if on_cpu else reference
    finally:
        if on_cpu:
            reference.to("cpu")
            release_freed_memory()


def blank(conversation):
    """A copy of `conversation` with zero old/reference log-probs and advantage: the weight-0 pass
    of a rank with nothing to train (its backward still joins DDP's all-reduce)."""
    zeros = [0.0] * len(conversation.response_ids)
    return dataclasses.replace(conversation, old_logprobs=zeros, ref_logprobs=zeros, advantage=0.0)


def ppo_updates(accelerator, model, optimizer, conversations, filler, with_reference, pad_id, args):
    """--ppo_epochs passes over the step's conversations in mini-batches of mini_batch_size x G
    conversations (in rollout order, as released), one optimizer update each. Every rank makes
    the same number of updates (none when no rank has anything to train). Returns (metrics summed
    over updates, weighted by tokens; the updates' gradient norms)."""
    model.train()
    n_all = accelerator.reduce(torch.tensor(float(len(conversations)), device=accelerator.device), "sum").item()
    n_mini = math.ceil(n_all / (args.mini_batch_size * args.group_size))  # the same on every rank
    sums, grad_norms = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "entropy": 0.0, "ratio": 0.0}, []
    if n_mini == 0:  # no rank has anything to train (every group tied and skipped): no update, on any rank
        return sums, grad_norms
    bounds = [round(m * len(conversations) / n_mini) for m in range(n_mini + 1)]  # this rank's share of each

    def grpo_loss(logprobs, entropy, f, num_tokens):
        return grpo.policy_loss(logprobs, f["old_logprobs"], f["advantage"], f["loss_mask"],
                                f["ref_logprobs"] if with_reference else None, clip_eps=args.clip_eps,
                                clip_ratio_c=args.clip_ratio_c, kl_coef=args.kl_coef,
                                entropy=entropy if args.entropy_coef else entropy.detach(),  # logged; no backward
                                entropy_coef=args.entropy_coef, num_tokens=num_tokens)

    for epoch in range(args.ppo_epochs):
        for m in range(n_mini):
            mini = sorted(conversations[bounds[m]:bounds[m + 1]], key=len)  # similar lengths per micro-batch
            grad_norm, loss, metrics, _ = optimizer_update(
                accelerator, model, optimizer, mini, filler, pad_id, args, ("old_logprobs", "ref_logprobs", "advantage"),
                grpo_loss, temperature=args.temperature)
            sums["loss"] += loss
            for key in ("kl", "clip_frac", "entropy", "ratio"):
                sums[key] += metrics[key]
            grad_norms.append(grad_norm)
    return sums, grad_norms


def optimizer_update(accelerator, model, optimizer, mini, filler, pad_id, args, fields, loss_fn,
                     temperature=1.0, return_entropy=True, autocast=True):
    """One optimizer update over `mini` (this rank's conversations), accumulated over micro-batches:

        for micro in micro-batches of --micro_batch_size conversations:
            logprobs = token_logprobs(micro)                         (grpo.micro_logprobs)
            backward(loss_fn(logprobs, ..., num_tokens))             a sum over tokens / num_tokens
        clip the gradient norm; optimizer.step()

    Every trained token weighs the same wherever it lands: num_tokens = (trained tokens on all
    ranks) / world, since DDP averages gradients over ranks; and every rank runs the same number of
    passes, since each rank's last backward joins DDP's all-reduce: a rank with fewer adds passes
    of weight 0 over `filler` (`agree_across_ranks`). With --shared_prefix the prefixes the
    conversations share are encoded once for the update (`encode_shared_prefixes`, section 5).
    Returns (grad norm, summed loss, metrics summed weighted by tokens, tokens on this rank)."""
    precision = accelerator.autocast if autocast else contextlib.nullcontext
    m = args.micro_batch_size
    chunks = [mini[i:i + m] for i in range(0, len(mini), m)]
    p, prefixes = encode_shared_prefixes(accelerator, model, chunks or [filler], mini + filler, args, precision)
    global_tokens, n_micro, all_share = agree_across_ranks(accelerator, mini, chunks, prefixes)
    prefixes = prefixes if all_share else {}
    num_tokens = max(global_tokens, 1.0) / accelerator.num_processes
    total_loss, sums, tokens = 0.0, {}, 0.0
    for u, micro in enumerate((chunks + [filler] * n_micro)[:n_micro]):
        weight = 1.0 if u < len(chunks) else 0.0
        synced = u == n_micro - 1 and not prefixes  # DDP all-reduces on this backward (else on the prefixes')
        with contextlib.nullcontext() if synced else accelerator.no_sync(model), precision():
            out, f = grpo.micro_logprobs(model, micro, pad_id, accelerator.device, ("loss_mask",) + fields, temperature,
                                         return_entropy, prefixes=prefixes)
            f["loss_mask"] = f["loss_mask"] * weight
            logprobs, entropy = out if return_entropy else (out, None)
            loss, metrics = loss_fn(logprobs, entropy, f, num_tokens)
            accelerator.backward(loss)
        n_here = float(f["loss_mask"].sum())
        total_loss, tokens = total_loss + loss.item(), tokens + n_here
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value * n_here
    if prefixes and n_micro:
        backward_shared_prefixes(accelerator, model, chunks or [filler], p, prefixes, precision)
    grad_norm = step_optimizer(accelerator, model, optimizer, args.grad_clip)
    release_freed_memory()
    return grad_norm, total_loss, sums, tokens


def step_optimizer(accelerator, model, optimizer, grad_clip):
    """Clip the gradient norm (the same on every rank), step, zero the gradients; a non-finite norm
    skips the update on all ranks together. With an fp16 loss scaler the step always runs: the
    scaler skips a non-finite update itself and must see it to lower its scale (else every later
    step overflows too). Returns the norm."""
    grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), grad_clip))
    if math.isfinite(grad_norm) or accelerator.scaler is not None:
        optimizer.step()
    if not math.isfinite(grad_norm):
        accelerator.print("warning: non-finite gradient norm, update skipped")
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def agree_across_ranks(accelerator, mini, chunks, prefixes):
    """What every rank must know before its micro-batches: the trained tokens on all ranks (the
    token-mean's denominator), the most micro-batches any rank has (every rank runs that many),
    and whether every rank has shared prefixes (their last pass is collective: all or none)."""
    stats = torch.tensor([sum(sum(c.loss_mask) for c in mini), len(chunks), not prefixes], device=accelerator.device,
                         dtype=torch.float64)
    global_tokens = accelerator.reduce(stats[:1].clone(), "sum").item()
    n_micro, unshared = (int(x) for x in accelerator.reduce(stats[1:].clone(), "max").tolist())
    return global_tokens, n_micro, not unshared


def reduce_by_name(accelerator, values: dict, op: str = "sum") -> dict:
    """{name: number} reduced over ranks (every rank passes the same names), in float64."""
    names = sorted(values)
    total = accelerator.reduce(torch.tensor([float(values[k]) for k in names], dtype=torch.float64,
                                            device=accelerator.device), op)
    return dict(zip(names, total.tolist()))


def step_metrics(accelerator, step, batch, sums, grad_norms, gap, timing):
    """The step's metrics.jsonl row: sums over all ranks, by name, then the means."""
    sampled = [k for k, t in enumerate(batch.group[:batch.broadcast]) if batch.sampled(t)]
    ts, base = batch.trajectories, {str(q["id"]) for q in batch.questions}
    ctx = [n for t in ts for n in t.context_tokens] or [0]
    s = reduce_by_name(accelerator, dict(
        groups=len(batch.questions), tied_groups=len(batch.tied & base), skipped_trajectories=len(batch.group) - len(batch.kept),
        oracle_trajectories=len(batch.experts), oracle_reward=sum(t.reward for t in batch.experts),
        reroll_trajectories=len(batch.rerolls), reroll_reward=sum(t.reward for t in batch.rerolls),
        reroll_groups=len({t.qid for t in batch.rerolls}), reroll_tied_groups=len(batch.tied - base),
        evidence=sum(batch.evidence[k] for k in sampled), reward_trained=sum(batch.rewards[k] for k in sampled),
        n=len(ts), reward=sum(t.reward for t in ts), em=sum(agent.exact_match(t.prediction, t.golden_answers) for t in ts),
        f1=sum(agent.f1_score(t.prediction, t.golden_answers) for t in ts), format_valid=sum(t.reward > 0 for t in ts),
        turns=sum(t.num_turns for t in ts), searches=sum(t.num_searches for t in ts),
        conversations=len(batch.conversations), context=sum(ctx), context_count=len(ctx),
        trained_tokens=sum(sum(c.loss_mask) for c in batch.conversations), encoded_tokens=grpo.ENCODED_TOKENS[0], **sums))
    top = reduce_by_name(accelerator, dict(context_tokens_max=max(ctx), old_logprob_gap=gap), "max")
    n, tok, updates = s["n"], max(s["trained_tokens"], 1), max(len(grad_norms), 1)
    return {"phase": "grpo", "step": step, **{k: s[k] / n for k in ("reward", "em", "f1", "format_valid", "turns", "searches")},
            "conversations_per_trajectory": s["conversations"] / n, "context_tokens_mean": s["context"] / max(s["context_count"], 1),
            "context_tokens_max": top["context_tokens_max"], "trained_tokens": s["trained_tokens"],
            "loss": s["loss"] / accelerator.num_processes / updates,
            **{k: s[k] / tok for k in ("kl", "clip_frac", "entropy", "ratio")}, "grad_norm": sum(grad_norms) / updates,
            "updates": len(grad_norms), "skipped_updates": sum(not math.isfinite(g) for g in grad_norms),
            "evidence": s["evidence"] / n, "reward_trained": s["reward_trained"] / n,
            "oracle_trajectories": s["oracle_trajectories"], "oracle_reward": s["oracle_reward"] / max(s["oracle_trajectories"], 1),
            "reroll_trajectories": s["reroll_trajectories"], "reroll_reward": s["reroll_reward"] / max(s["reroll_trajectories"], 1),
            "reroll_groups": s["reroll_groups"], "reroll_tied_groups": s["reroll_tied_groups"],
            "equal_reward_groups": s["tied_groups"] / s["groups"], "skipped_trajectories": s["skipped_trajectories"],
            "old_logprob_gap": top["old_logprob_gap"], **timing, "encoded_tokens": s["encoded_tokens"]}


def write_samples(output_dir, step, batch, tokenizer, groups):
    """samples.jsonl: the step's first `groups` groups, every trajectory whole. Each line keeps the
    keys it always had (step, question, golden_answers, prediction, reward, end_reason, turns) and
    adds: group (the question id; qid@K for a re-rolled group), member (its place in the group),
    oracle, trained (its group was not skipped as tied), advantage, shaped_reward (what the
    advantage came from), evidence, context_tokens, and per conversation its response tokens (each decoded alone), loss mask and
    log-probs (pi_old's where computed, else those recorded while sampling; none for an oracle
    trajectory that was not trained)."""
    chosen = list(dict.fromkeys(t.qid for t in batch.group[:batch.broadcast]))[:groups]
    chosen += [t.qid for t in batch.rerolls if t.qid.rsplit("@", 1)[0] in chosen]  # and their re-rolled groups
    members = Counter()
    with open(os.path.join(output_dir, "samples.jsonl"), "a") as f:
        for i, t in enumerate(batch.group):
            if t.qid not in chosen:
                continue
            members[t.qid] += 1
            conversations = [{"prompt_tokens": len(c.prompt_ids), "tokens": [tokenizer.decode([x]) for x in c.response_ids],
                              "loss_mask": c.loss_mask, "logprobs": sample_logprobs(c, batch.sampled(t))} for c in t.conversations]
            f.write(json.dumps({"step": step, "question": t.question, "golden_answers": t.golden_answers,
                                "prediction": t.prediction, "reward": t.reward, "end_reason": t.end_reason, "turns": t.turns,
                                "group": t.qid, "member": members[t.qid] - 1, "oracle": not batch.sampled(t),
                                "trained": i in batch.kept, "advantage": float(batch.advantages[i]),
                                "shaped_reward": batch.rewards[i], "evidence": batch.evidence[i] if batch.evidence else None,
                                "context_tokens": t.context_tokens, "conversations": conversations}, ensure_ascii=False) + "\n")


def sample_logprobs(c, sampled):
    logprobs = c.old_logprobs if c.old_logprobs is not None else c.logprobs if sampled else None
    return None if logprobs is None else [round(float(x), 3) for x in logprobs]


# ---------------------------------------------------------------------------------------------
# 4. The small-budget recipe (toy preset; each part off in the paper preset): oracle trajectories
#    in unsolved groups, evidence credit, tied groups skipped, and the warm start
# ---------------------------------------------------------------------------------------------
def oracle_trajectories(args, questions, trajectories, search, tokenizer, seed, rollout_kwargs):
    """--oracle_per_group K: expert bootstrapping (David-GRPO, LUFFY). K trajectories of the oracle
    (toy/oracle.py) join the group of each question that has a reasoning chain, with
    --oracle_when_unsolved only where no sampled trajectory earned reward 1. [] when K = 0."""
    if not args.oracle_per_group:
        return []
    from toy import oracle

    solved = {t.qid for t in trajectories if t.reward >= 1.0} if args.oracle_when_unsolved else set()
    return oracle.group_experts([q for q in questions if str(q["id"]) not in solved], search, tokenizer,
                                args.oracle_per_group, max_turns=args.max_turns, seed=seed, **rollout_kwargs)


def shaped_rewards(args, group, questions):
    """--evidence_weight lambda (David-GRPO's evidence credit), for questions with supporting ids:

        R = (1 - lambda) R_released + lambda E,    E = share of supporting passages retrieved

    Returns (R per trajectory, E per trajectory); R = R_released when lambda = 0."""
    supporting = {str(q["id"]): (q.get("metadata") or {}).get("supporting_ids") for q in questions}
    evidence = [evidence_share(t, supporting[t.qid]) for t in group]
    rewards = [(1 - args.evidence_weight) * t.reward + args.evidence_weight * e
               if args.evidence_weight > 0 and supporting[t.qid] else t.reward for t, e in zip(group, evidence)]
    return rewards, evidence


def skip_tied_groups(args, group, advantages):
    """The groups whose rewards are all equal (A = 0: no signal) and, with --skip_equal_groups
    (DAPO, MemAgent), the trajectories left to train: the tied groups' skip the log-prob passes and
    the update, and the token-mean is then over the kept tokens. Returns (tied qids, kept indices)."""
    tied = {t.qid for t in group} - {t.qid for t, a in zip(group, advantages) if a != 0}
    kept = [i for i, t in enumerate(group) if not (args.skip_equal_groups and t.qid in tied)]
    return tied, kept


def run_warm_start(accelerator, model, optimizer, tokenizer, reference, rollout_model, search, args, rollout_kwargs, log):
    """--warm_start_steps supervised steps on oracle demonstrations, saved as warm_start/ (with
    --resume a finished warm start is loaded, an interrupted one continued). GRPO then starts from
    it with fresh AdamW moments at its own learning rate, and its KL reference is it."""
    warm_dir, partial = (os.path.join(args.output_dir, name) for name in ("warm_start", "warm_start_partial"))
    if args.resume and os.path.isfile(os.path.join(warm_dir, "trainer_state.json")):
        accelerator.load_state(os.path.join(warm_dir, "state"))
        accelerator.print(f"warm start already done: {warm_dir}")
    else:
        demos, stats = demonstrations(args, search, tokenizer, rollout_kwargs)
        accelerator.print(f"oracle demonstrations: {stats['kept']} of {stats['offered']} questions kept, "
                          f"{stats['conversations']} conversations, {stats['trained_tokens']} trained tokens")
        for group in optimizer.param_groups:
            group["lr"] = args.warm_start_lr
        done = 0
        if args.resume and os.path.isfile(os.path.join(partial, "trainer_state.json")):  # an interrupted warm start
            accelerator.load_state(os.path.join(partial, "state"))
            done = json.load(open(os.path.join(partial, "trainer_state.json")))["step"]
            accelerator.print(f"warm start resumed from {partial} (step {done})")
        if accelerator.is_main_process:
            trim_logs(args.output_dir, "warm_start", done)
        save = lambda step: save_checkpoint(accelerator, model, tokenizer, args, step, name="warm_start_partial")  # noqa: E731
        warm_start(accelerator, model, optimizer, demos, tokenizer.pad_token_id, args, log, start=done, save=save)
        save_checkpoint(accelerator, model, tokenizer, args, 0, name="warm_start")
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
    optimizer.optimizer.state.clear()  # GRPO starts with fresh AdamW moments, at its own learning rate
    for group in optimizer.param_groups:
        group["lr"] = args.lr
    if reference is not None:  # the KL reference is the warm-started policy: what RL starts from
        if rollout_model is not None:
            gather_full_weights(model, reference)
        else:
            reference.load_state_dict(accelerator.unwrap_model(model).state_dict())


def demonstrations(args, search, tokenizer, rollout_kwargs):
    """Oracle demonstrations of --warm_start_questions train questions, the first of each type in the
    --warm_start_mix shares (toy/oracle.py): acted out through agent.rollout, so prompts, tool turns and loss masks are exactly RL's."""
    from toy import oracle  # the toy world's oracle: needs rows with reasoning chains

    rows = oracle.load_rows(args.train_data)
    if not all((r.get("metadata") or {}).get("chain") for r in rows):
        raise SystemExit(f"train.py: --warm_start_steps needs questions with reasoning chains (toy/make_toy.py); "
                         f"{args.train_data} has none: use --warm_start_steps 0")
    try:
        rows = oracle.pick_questions(rows, args.warm_start_questions, warm_start_mix(args))
    except ValueError as e:
        raise SystemExit(f"train.py: --warm_start_mix {args.warm_start_mix}: {e}")
    trajectories, stats = oracle.make_demonstrations(rows, search, tokenizer, max_turns=args.max_turns, seed=args.seed,
                                                     **rollout_kwargs)
    return [c for t in trajectories for c in t.conversations], stats


def warm_start(accelerator, model, optimizer, demos, pad_id, args, log, start=0, save=lambda step: None):
    """--warm_start_steps supervised steps: the token-mean negative log-likelihood over exactly the
    loss mask RL trains, on --warm_start_batch demonstration conversations a step (split over ranks),
    through the same micro-batched update as GRPO, in float32 whatever --mixed_precision says (every
    warm start judged on validation was; a bf16 one is another policy). The batches are a function
    of (seed, step), so a run resumed at `start` (weights and optimizer restored) continues exactly;
    `save(step)` runs every --warm_start_save_every steps."""
    rank, world = accelerator.process_index, accelerator.num_processes
    order, epoch = [], 0
    bar = tqdm(range(start, args.warm_start_steps), initial=start, total=args.warm_start_steps,
               disable=not accelerator.is_main_process, desc="warm start")
    for step in bar:
        while len(order) < (step + 1) * args.warm_start_batch:  # a fresh seeded shuffle every epoch
            more = list(range(len(demos)))
            random.Random(args.seed * 7919 + epoch).shuffle(more)
            order, epoch = order + more, epoch + 1
        batch = [demos[i] for i in order[step * args.warm_start_batch:(step + 1) * args.warm_start_batch]]
        mine = sorted(batch[rank::world], key=len)
        t0 = time.time()
        nll = lambda logprobs, entropy, f, num_tokens: (-(logprobs * f["loss_mask"]).sum() / num_tokens, {})  # noqa: E731
        grad_norm, loss, _, tokens = optimizer_update(accelerator, model, optimizer, mine, demos[:1], pad_id, args, (),
                                                      nll, return_entropy=False, autocast=False)
        local = torch.tensor([loss, tokens, sum(len(c) for c in mine)], dtype=torch.float64, device=accelerator.device)
        loss, tokens, context = accelerator.reduce(local, "sum").tolist()
        seconds = time.time() - t0
        log({"phase": "warm_start", "step": step + 1, "loss": loss / world, "trained_tokens": tokens,
             "tokens_per_second": context / seconds, "grad_norm": grad_norm, "seconds": seconds})
        bar.set_postfix(nll=f"{loss / world:.3f}")
        if args.warm_start_save_every and (step + 1) % args.warm_start_save_every == 0 and step + 1 < args.warm_start_steps:
            save(step + 1)


# ---------------------------------------------------------------------------------------------
# 5. Speedup (exact): the update's shared prefixes, encoded once instead of once per row
# ---------------------------------------------------------------------------------------------
def encode_shared_prefixes(accelerator, model, micro_batches, conversations, args, precision):
    """Speedup of the update's plain micro-batches, which run every row's whole prompt (what
    `optimizer_update` does with `prefixes = {}`, as with --no_shared_prefix):

        grpo.micro_logprobs(model, micro, ..., prefixes={})

    The prefixes the rank's conversations share (the system prompt; a group's turn-1 prompt) are
    encoded once, without grad (`grpo.encode_prefixes`); every micro-batch attends to their
    states S, leaves whose gradient G collects the micro-batches' shares, and
    `backward_shared_prefixes` sends G through the prefix computation at the end. Proven equal to
    the plain update (parameters after one update, 1e-5): tests/test_train.py::
    test_shared_prefix_update_equals_plain, and a whole step ::test_shared_prefix_step_equals_plain.
    Returns (p, prefixes); (None, {}) when off: --no_shared_prefix, FSDP or an fp16 loss scaler."""
    if not (getattr(args, "shared_prefix", False) and accelerator.distributed_type != DistributedType.FSDP
            and accelerator.scaler is None):
        return None, {}
    p = grpo.common_prefix(conversations)
    with precision(), torch.no_grad():
        prefixes, _ = grpo.encode_prefixes(accelerator.unwrap_model(model, keep_fp32_wrapper=True), micro_batches, p)
    for _, states in prefixes.values():
        for x in (x for kv in states for x in kv):
            x.requires_grad_()
    return p, prefixes


def backward_shared_prefixes(accelerator, model, micro_batches, p, prefixes, precision):
    """The prefixes' share of the gradient: run them again with grad and backpropagate sum(S * G),
    whose gradient with respect to S is G, so the weights receive every micro-batch's share through
    the one prefix computation (what each row's own copy would have sent them). It runs after the
    micro-batches, so its activations never share memory with theirs, and it is the backward DDP
    all-reduces on: its first pass goes through the DDP module, once on every rank, and the passes'
    last logits join at weight 0 so that every weight takes part."""
    with precision():
        again, logits = grpo.encode_prefixes(accelerator.unwrap_model(model, keep_fp32_wrapper=True), micro_batches, p,
                                             first_model=model, count=False)
        pairs = [(s, s0.grad) for k in prefixes for kv, kv0 in zip(again[k][1], prefixes[k][1])
                 for s, s0 in zip(kv, kv0) if s0.grad is not None]
        accelerator.backward(0.0 * logits + sum((s * g).sum() for s, g in pairs))


# ---------------------------------------------------------------------------------------------
# 6. Infrastructure: memory, precision, checkpoints, logs, the data order
# ---------------------------------------------------------------------------------------------
def peak_memory(reset=False):
    """Peak memory in GB: the GPU's allocated peak, or (Linux) the process's resident high-water
    mark, VmHWM; with `reset` the mark restarts from here, so that one phase can be measured. The
    kernel reads that same mark at exit, so after a reset `/usr/bin/time`'s max RSS understates the
    run's peak: the largest logged `peak_memory_gb` is the peak."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return peak / 2**30
    try:
        peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
        if reset:
            open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current resident size
        return peak / 2**30
    except (OSError, IndexError):
        return 0.0


def release_freed_memory():
    """Hand freed CPU memory back to the OS (glibc `malloc_trim`). The varying shapes of conversations
    fragment glibc's heap, so its resident size only grows: in a probe of 6 updates of 8 conversations
    of 600 to 1,000 tokens (float32) it went 6.0 -> 11.5 GB between updates, 1.9 GB with a trim after
    each. No-op off glibc or on GPU."""
    if torch.cuda.is_available():
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def trim_logs(output_dir, phase, last_step):
    """On resume: drop the log rows an interrupted run wrote after its last checkpoint (rows of
    `phase` past `last_step`, and every row of a later phase), so metrics.jsonl and samples.jsonl
    hold each step once."""
    later = {"warm_start": {"warm_start", "grpo"}, "grpo": {"grpo"}}[phase]
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = os.path.join(output_dir, name)
        if not os.path.isfile(path):
            continue
        kept = []
        for line in open(path, encoding="utf-8"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the interruption
                continue
            row_phase = row.get("phase", "grpo")  # samples.jsonl rows are GRPO's
            if row_phase not in later or (row_phase == phase and row.get("step", 0) <= last_step):
                kept.append(line if line.endswith("\n") else line + "\n")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


def resolve_precision(choice, cpuinfo="/proc/cpuinfo"):
    """--mixed_precision auto: the launcher's bf16/fp16 (`accelerate launch --mixed_precision`) if it
    set one; else bf16 autocast on a GPU that supports bfloat16 (Ampere and later); on a machine
    without CUDA, bf16 if its CPU has AMX bf16 units (about 2.5x faster rollouts there,
    docs/performance.md); else none. The trained weights stay float32 whatever is chosen."""
    if choice not in ("auto", "no", "bf16", "fp16"):
        raise SystemExit(f"train.py: bad configuration: --mixed_precision must be auto, no, bf16 or fp16, not {choice!r}")
    if choice != "auto":
        return choice
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")  # accelerate launch always sets it ("no" by default)
    if launched != "no":
        return launched
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    if os.path.exists(cpuinfo):
        with open(cpuinfo) as f:
            if "amx_bf16" in f.read():
                return "bf16"
    return "no"


def save_checkpoint(accelerator, model, tokenizer, args, step, name=None):
    """checkpoint-<step>/ (or `name`/): the policy (save_pretrained + tokenizer, loadable by
    transformers and vLLM; with LoRA the adapter, merged by `agent.save_merged`) and state/
    (optimizer, RNG, step). Written as a temporary folder, then renamed."""
    final = os.path.join(args.output_dir, name or f"checkpoint-{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(os.path.join(tmp, "state"))
    if args.lora_rank:  # the adapter alone (DDP: every rank holds it); agent.load_model merges it into the base
        accelerator.unwrap_model(model).save_pretrained(tmp, is_main_process=accelerator.is_main_process)
    else:
        state_dict = accelerator.get_state_dict(model)  # gathered under FSDP / DeepSpeed ZeRO-3
        accelerator.unwrap_model(model).save_pretrained(tmp, is_main_process=accelerator.is_main_process,
                                                        save_function=accelerator.save, state_dict=state_dict)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "args": vars(args)}, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(args.output_dir)[:-args.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def gather_full_weights(model, rollout_model):
    """Under FSDP no rank holds the whole policy, and generation cannot all-gather shards in step
    (ranks generate different numbers of tokens and turns). So each rank rolls out with a plain
    full copy of the policy, refreshed here from the gathered weights before every rollout."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # FSDP1 and FSDP2
    rollout_model.load_state_dict(full)


def list_checkpoints(output_dir):
    paths = [p for p in glob.glob(os.path.join(output_dir, "checkpoint-*")) if not p.endswith(".tmp")
             and os.path.isfile(os.path.join(p, "trainer_state.json"))]
    return sorted(paths, key=lambda p: int(p.rsplit("-", 1)[1]))


def step_questions(questions, step, batch_size, seed):
    """The step's batch: consecutive slices of a seeded shuffle, reshuffled every epoch."""
    per_epoch = len(questions) // batch_size
    epoch, k = divmod(step, per_epoch)
    order = list(range(len(questions)))
    random.Random(seed + epoch).shuffle(order)
    return [questions[i] for i in order[k * batch_size:(k + 1) * batch_size]]


if __name__ == "__main__":
    main()
