"""Train a MemSearcher agent end to end with multi-context GRPO.

    accelerate launch train.py                                  # embedded default, toy data, any machine
    accelerate launch train.py --model Qwen/Qwen2.5-3B-Instruct --train_data nq_hotpotqa_train.parquet \\
        --retriever_url http://host:8000                        # the paper's settings (preset `paper`)
    torchrun --nproc_per_node 2 train.py --max_steps 2          # two CPU processes (gloo)

1. configuration: every hyperparameter, with the toy and the paper preset's value
2. the training loop, `main`: rollout -> rewards -> group advantages -> propagate ->
   old/reference log-probs -> PPO updates -> metrics and checkpoints
3. the parts of a step: set-up, what flows (Batch), the log-prob passes, the optimizer update, metrics
4. speedup (exact): the update's shared prefixes
The policy and its frozen copies come from tools/models.py; infrastructure (precision, checkpoints
and resume, the log files, memory) is tools/runs.py.

The toy preset's small-budget recipe (toy/recipe.py: the warm start, the oracle in unsolved groups,
evidence credit, tied groups skipped) enters the loop through one `recipe.*` call per step part;
each is a no-op in the paper preset.
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from accelerate.utils import DistributedType, set_seed
from torch.distributed.fsdp import FSDPModule
from tqdm import tqdm

import agent
import grpo
import retriever
from data.questions import load_questions
from toy import recipe
from tools import models, runs

# ---------------------------------------------------------------------------------------------
# 1. Configuration: (flag, toy preset, paper preset, help). Explicit flags override the preset.
# ---------------------------------------------------------------------------------------------
TOY_TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "toy", "train.jsonl")
LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
HYPERPARAMETERS = [
    ("model", "default", "Qwen/Qwen2.5-3B-Instruct", "policy: `default` (embedded SmolLM2-135M) or an HF name/path; paper: Qwen2.5-3B/7B-Instruct"),
    ("train_data", TOY_TRAIN, None, "FlashRAG jsonl or Search-R1 parquet; paper: NQ + HotpotQA train"),
    ("agent", "memsearcher", "memsearcher", "memsearcher, or react (the baseline, one growing conversation)"),
    ("max_steps", 8, 660, "optimizer steps (each: one batch of questions); paper: 1 epoch = ~660 (toy: docs/learning.md)"),
    ("batch_size", 4, 256, "questions per step, over all ranks; paper: 256"),
    ("group_size", 4, 5, "G, trajectories per question; paper: 5"),
    ("mini_batch_size", 4, 128, "optimizer updates see mini_batch_size x G conversations each, in rollout order; paper: 128 (x 5 = 640)"),
    ("micro_batch_size", 1, 4, "conversations per forward/backward: memory, not math (docs/performance.md)"),
    ("ppo_epochs", 1, 1, "passes over a step's conversations; paper: 1"),
    ("lr", 1e-5, 1e-6, "AdamW learning rate, constant; paper: 1e-6"),
    ("weight_decay", 0.01, 0.01, "AdamW weight decay; paper: 0.01"),
    ("grad_clip", 1.0, 1.0, "max global gradient norm; paper: 1.0"),
    ("clip_eps", 0.2, 0.2, "PPO ratio clip epsilon; paper: 0.2"),
    ("clip_ratio_c", 3.0, 3.0, "dual-clip bound c for negative advantages; paper: 3"),
    ("old_logprobs", "recorded", "recompute", "recorded while sampling (float32 without autocast only) or recompute (a forward pass, as released)"),
    ("kl_coef", 0.0, 0.001, "k3 KL-to-reference coefficient (0: no reference model; toy: 0, as David-GRPO's first stage); paper: 0.001"),
    ("entropy_coef", 0.0, 0.001, "entropy bonus coefficient; paper: 0.001 (toy: 0: with no reward signal it only raises entropy)"),
    ("mixed_precision", "auto", "auto", "no, bf16, or auto (runs.resolve_precision); trained weights float32, frozen copies in this precision"),
    # Memory (docs/memory_plan.md: which settings fit which GPUs): none of these changes the math
    ("rollout_batch_size", 0, 64, "R, rows per generate call: a rank rolls out R // G questions at a time (0: all at once)"),
    ("reference_on_cpu", False, False, "keep the KL reference on the CPU but for its log-prob pass (the release offloads it so too)"),
    ("gradient_checkpointing", True, True, "recompute activations in the update to save memory (docs/performance.md)"),
    ("lora_rank", 0, 0, "r > 0: train LoRA adapters of rank r (needs peft); the reference is the base, the checkpoints the adapter"),
    ("lora_alpha", 64, 64, "LoRA scale alpha (the update is alpha / r * B A x)"),
    ("lora_target_modules", LORA_TARGETS, LORA_TARGETS, "the linear layers that get adapters"),
    # The rollout (agent.RolloutSettings)
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
    # The search tool
    ("retriever_url", None, None, "a retrieval server shared by all ranks: .../retrieve (Search-R1 API) or .../search (the release's); else a local index"),
    ("retriever_timeout", 300.0, 300.0, "seconds a request to --retriever_url may take before it is tried again"),
    ("retriever_retries", 5, 5, "tries after the first for a failed request (timeouts, 5xx), with waits of 1, 2, 4, ... s"),
    ("corpus", None, None, "local corpus jsonl (default: data/toy/corpus.jsonl); paper: wiki-18.jsonl"),
    ("index", None, None, "local FAISS index (default: built beside the corpus); paper: e5_Flat.index"),
    ("encoder", None, None, "retrieval encoder (default: embedded MiniLM); paper: intfloat/e5-base-v2"),
    # The run
    ("output_dir", "runs/memsearcher", "runs/memsearcher", "checkpoints, metrics.jsonl, samples.jsonl"),
    ("save_every", 2, 20, "checkpoint every N steps (and at the end)"),
    ("keep_checkpoints", 2, 3, "how many newest checkpoints to keep"),
    ("resume", False, False, "continue from the newest checkpoint in output_dir"),
    ("shared_prefix", True, True, "encode the prefixes conversations share once per pass, not once per row (exact; docs/performance.md)"),
    ("sample_groups", 1, 1, "groups per step written whole to samples.jsonl (tools/report.py renders them)"),
    ("report_to", None, None, "accelerate trackers: tensorboard, wandb, ... (comma-separated)"),
    ("timeout_minutes", 60, 60, "how long a rank waits at a collective before the run fails (e.g. while rank 0 builds the index)"),
    ("seed", 0, 0, "data order, sampling (offset per rank and step), initialisation"),
] + recipe.HYPERPARAMETERS  # the toy preset's small-budget recipe (toy/recipe.py): every part off in the paper preset


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
    state = os.path.join(str(args.model), "trainer_state.json")  # a train.py checkpoint continues with its own preset
    trained_with = json.load(open(state))["args"].get("preset") if os.path.isfile(state) else None
    preset = args.preset or trained_with or ("toy" if args.model in (None, "default") else "paper")
    args.source = {}  # where each value came from, for configuration errors
    for name, toy, paper, _ in HYPERPARAMETERS:
        args.source[name] = "flag"
        if getattr(args, name) is None:
            value = toy if preset == "toy" or (name == "train_data" and paper is None) else paper
            setattr(args, name, value)
            args.source[name] = f"{preset} preset"
    args.preset = preset
    return args


def check_config(args, world_size, distributed_type=None, fsdp=None):
    """Fail fast, before loading anything large. Each problem names the flag, its value and where
    the value came from (a flag or a preset)."""
    flag = lambda name: f"--{name} {getattr(args, name)} ({args.source.get(name, 'flag')})"  # noqa: E731
    problems = []
    if distributed_type == DistributedType.DEEPSPEED:
        problems.append("DeepSpeed is not supported (its engine steps after a fixed count of micro-batches; a GRPO step's varies): use FSDP")
    if args.group_size < 2:
        problems.append(f"--group_size must be >= 2 (GRPO compares trajectories within a group), got {args.group_size}")
    if args.batch_size % world_size:
        problems.append(f"{flag('batch_size')} must be divisible by the {world_size} processes (groups never split across ranks)")
    if args.batch_size % args.mini_batch_size:
        problems.append(f"{flag('batch_size')} must be a multiple of {flag('mini_batch_size')}")
    if args.doc_format not in retriever.DOC_FORMATS:
        problems.append(f"--doc_format must be one of {', '.join(retriever.DOC_FORMATS)}, got {args.doc_format!r}")
    if distributed_type == DistributedType.FSDP and getattr(fsdp, "fsdp_version", 2) == 1:
        problems.append("FSDP1 is not supported (the rollout copy is refilled from FSDP2's DTensors): --fsdp_version 2")
    if args.lora_rank and distributed_type == DistributedType.FSDP:
        problems.append("--lora_rank trains under DDP or on one GPU, not FSDP (the frozen base is held whole on each rank, in bf16)")
    if args.lora_rank > 0:
        try:
            models.peft_module()
        except ImportError as e:
            problems.append(str(e))
    if args.lora_rank < 0:
        problems.append(f"{flag('lora_rank')} must be >= 0")
    if args.rollout_batch_size < 0:
        problems.append(f"{flag('rollout_batch_size')} must be >= 0 (0: all rows at once)")
    if not os.path.isfile(args.train_data):
        problems.append(f"--train_data not found: {args.train_data}")
    problems += recipe.check_config(args, flag)
    if problems:
        raise SystemExit("train.py: bad configuration:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------
# 2. The training loop: rollout -> rewards -> group advantages -> propagate -> old/ref log-probs
#    -> PPO updates -> log (each step's parts are the functions of section 3)
# ---------------------------------------------------------------------------------------------
def start(args):
    """Everything before the first step but the resume: the Accelerator, the questions, the
    search tool, the models and the warm start (toy preset). Returns what the loop works with."""
    multi_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1  # torchrun on CPUs: gloo
    precision = runs.resolve_precision(args.mixed_precision)
    accelerator = runs.make_accelerator(multi_cpu, mixed_precision=precision, project_dir=args.output_dir,  # trackers log there
                                        log_with=args.report_to.split(",") if args.report_to else None,
                                        kwargs_handlers=runs.accelerator_settings(args))
    check_config(args, accelerator.num_processes, accelerator.distributed_type, getattr(accelerator.state, "fsdp_plugin", None))
    runs.check_shared_folder(accelerator, args.output_dir)  # on two machines: a shared file system
    accelerator.print(f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value}; precision: float32 "
                      f"trained weights, {'no autocast' if precision == 'no' else precision + ' autocast'} "
                      f"(--mixed_precision {args.mixed_precision})")
    questions = load_questions(args.train_data)
    if len(questions) < args.batch_size:
        raise SystemExit(f"train.py: {args.train_data} has {len(questions)} questions, fewer than --batch_size {args.batch_size}")
    set_seed(args.seed)
    with accelerator.local_main_process_first():  # each machine's first process builds a missing index cache first
        search = retriever.open_retriever(args.corpus, args.index, args.encoder, url=args.retriever_url, check=True,
                                          doc_format=args.doc_format, timeout=args.retriever_timeout,
                                          retries=args.retriever_retries,
                                          device=accelerator.device if accelerator.device.type == "cuda" else "cpu")
    model, optimizer, tokenizer, reference, rollout_model = load_models(args, accelerator)
    sharded = rollout_model is not None  # FSDP: each rank rolls out with a full copy of the policy
    if args.shared_prefix and (accelerator.distributed_type == DistributedType.FSDP or accelerator.scaler is not None):
        accelerator.print("train.py: the shared prefix is off in the update under FSDP and with an fp16 loss scaler "
                          "(encode_shared_prefixes); the log-prob passes keep it")
    settings = rollout_settings(args)
    os.makedirs(args.output_dir, exist_ok=True)
    accelerator.init_trackers("memsearcher", config={k: v for k, v in vars(args).items() if v is not None and k != "source"})
    log = runs.logger(accelerator, args.output_dir)
    recipe.warm_start(  # toy preset: supervised steps on oracle demonstrations first (toy/recipe.py); paper: no-op
        accelerator, model, optimizer, tokenizer, search, args, settings, log, update=optimizer_update, trim_logs=runs.trim_logs,
        save=lambda step, name: runs.save_checkpoint(accelerator, model, tokenizer, args, step, name),
        reset_reference=lambda: models.copy_policy_into(model, reference, sharded, accelerator))
    return accelerator, questions, search, (model, optimizer, tokenizer, reference, rollout_model), settings, log


def main(argv=None, generate_fn=None):
    args = parse_args(argv)
    accelerator, questions, search, (model, optimizer, tokenizer, reference, rollout_model), settings, log = start(args)
    rank, world, start_step = accelerator.process_index, accelerator.num_processes, runs.resume(accelerator, args)
    sharded = rollout_model is not None  # FSDP: each rank rolls out with a full copy of the policy
    policy = rollout_model if sharded else accelerator.unwrap_model(model)  # generates, and gives old log-probs
    bar = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps,
               disable=not accelerator.is_main_process, desc="steps")
    for step in bar:
        # --- rollout: this rank's share of the step's questions, G trajectories each ----------
        t0, counter = time.time(), Counter()
        share = args.batch_size // world
        mine = step_questions(questions, step, args.batch_size, args.seed)[rank * share:(rank + 1) * share]
        if sharded:
            models.copy_policy_into(model, rollout_model, sharded, accelerator)
        seed = args.seed * 100003 + step * world + rank  # sampling seeded per rank and step (and chunk)
        with accelerator.autocast():  # generate in the update's precision (bf16 on GPU with --mixed_precision bf16)
            samples = rollout_in_chunks(policy, tokenizer, mine, search, settings, args.group_size, args.rollout_batch_size,
                                        seed, generate_fn)
        runs.release_freed_memory()
        experts = recipe.oracle_trajectories(args, mine, samples, search, tokenizer, seed, settings)  # paper: []
        t_rollout = time.time() - t0

        # --- rewards -> group advantages A_i -> one advantage per conversation, A_ij = A_i ----
        batch = Batch(mine, samples, experts)
        batch.rewards, batch.evidence = recipe.shaped_rewards(args, batch.trajectories, mine)  # paper: the released reward
        batch.advantages = grpo.group_advantages(batch.rewards, [t.qid for t in batch.trajectories])
        batch.tied, batch.kept = recipe.skip_tied_groups(args, batch.trajectories, batch.advantages)  # paper: all kept
        owner = [i for i in batch.kept for _ in batch.trajectories[i].conversations]
        batch.conversations = [c for i in batch.kept for c in batch.trajectories[i].conversations]
        for c, a in zip(batch.conversations, grpo.propagate_advantages(batch.advantages, owner).tolist()):
            c.advantage = a

        # --- old log-probs (the policy before any update) and reference log-probs ------------
        t0 = time.time()
        from_policy = [batch.sampled(batch.trajectories[i]) for i in owner]  # the oracle's have no recorded log-probs
        with accelerator.autocast():  # the same precision as the update's forward passes
            logprob_gap = old_and_reference_logprobs(args, accelerator, policy, reference, batch.conversations, from_policy,
                                                     tokenizer.pad_token_id, counter)
        t_reference = time.time() - t0

        # --- PPO epochs of mini-batches, one optimizer update each -----------------------------
        t0, peak_before = time.time(), runs.peak_gb(reset=True)  # the rollout's and log-prob passes' peak
        stand_in = batch.conversations[:1] or [weightless(batch.trajectories[0].conversations[0])]  # nothing to train
        sums, grad_norms = ppo_updates(accelerator, model, optimizer, batch.conversations, stand_in, args.kl_coef > 0,
                                       tokenizer.pad_token_id, args, counter)
        t_update, peak_update = time.time() - t0, runs.peak_gb(reset=True)

        # --- metrics over all ranks, samples, checkpoint ---------------------------------------
        timing = dict(lr=optimizer.param_groups[0]["lr"], seconds_rollout=t_rollout, seconds_reference=t_reference,
                      seconds_update=t_update, peak_memory_gb=max(peak_before, peak_update), peak_update_gb=peak_update)
        row = step_metrics(accelerator, step + 1, batch, sums, grad_norms, logprob_gap, timing, counter["encoded_tokens"])
        log(row)
        if accelerator.is_main_process:
            runs.write_samples(args.output_dir, step + 1, batch, tokenizer, args.sample_groups)
            bar.set_postfix(reward=f"{row['reward']:.3f}", turns=f"{row['turns']:.2f}", kl=f"{row['kl']:.4f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.max_steps:
            runs.save_checkpoint(accelerator, model, tokenizer, args, step + 1)
    accelerator.end_training()
    return model


# ---------------------------------------------------------------------------------------------
# 3. The parts of a step: set-up, what flows, old/reference log-probs, PPO updates, metrics
# ---------------------------------------------------------------------------------------------
def load_models(args, accelerator):
    """The policy and its optimizer, prepared for DDP/FSDP, plus the frozen copies it needs:

    - full fine-tuning: float32 trained weights; the KL reference (only with --kl_coef > 0; under
      FSDP sharded as the policy is) and, under FSDP, a whole rollout copy, both in the run's
      precision (bfloat16 in a bf16 run), each an empty model filled from the policy tensor by tensor;
    - LoRA (--lora_rank r): the base frozen in the run's precision, float32 adapters; no copy,
      since the reference is the policy with its adapter disabled (`reference_pass`).
    Under FSDP no rank loads the whole model: each reads its shards from the checkpoint (models.load_shards).
    Returns (model, optimizer, tokenizer, reference or None, rollout copy or None)."""
    frozen_dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
    sharded = accelerator.distributed_type == DistributedType.FSDP  # then roll out with a full copy
    files = models.safetensors_files(args.model) if sharded else None  # then each rank fills its shards after prepare
    empty = files is not None or (sharded and accelerator.state.fsdp_plugin.cpu_ram_efficient_loading
                                  and not accelerator.is_main_process)  # (else the first rank's weights, in prepare)
    model, tokenizer = models.load(args.model, dtype=frozen_dtype if args.lora_rank else torch.float32, empty=empty)
    if args.gradient_checkpointing:  # active in train mode only: rollouts keep the KV cache
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_rank:
        model = models.add_adapter(model, args.lora_rank, args.lora_alpha, args.lora_target_modules)
        runs.adapter_only_state(accelerator, model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    # accelerate wraps the forward in autocast with float32 outputs: a float32 copy of every logits
    # tensor (4 x 3k x 152k x 4 bytes = 7 GB a micro-batch at the paper's shape). Every pass here
    # runs inside accelerator.autocast() anyway, so the plain forward is put back: logits stay bf16.
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    if files:
        models.load_shards(model, files)
    with_reference, on_cpu = args.kl_coef > 0 and not args.lora_rank, args.reference_on_cpu
    reference = models.frozen_copy(model, accelerator, frozen_dtype, "cpu" if on_cpu else accelerator.device, sharded,
                                   shard=sharded and not on_cpu) if with_reference else None
    rollout_model = models.frozen_copy(model, accelerator, frozen_dtype, accelerator.device, sharded) if sharded else None
    return model, optimizer, tokenizer, reference, rollout_model


def rollout_settings(args) -> agent.RolloutSettings:
    """GRPO's sampling settings (the oracle's rollouts take the same; it ignores the sampling)."""
    return agent.RolloutSettings(
        agent=args.agent, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
        max_memory_tokens=args.max_memory_tokens, max_response_tokens=args.max_response_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, default_top_n=args.default_top_n,
        **agent.read_prompts(args.agent, args.system_prompt, args.memory_instruction))


def step_questions(questions, step, batch_size, seed):
    """The step's batch: consecutive slices of a seeded shuffle, reshuffled every epoch."""
    per_epoch = len(questions) // batch_size
    epoch, k = divmod(step, per_epoch)
    order = list(range(len(questions)))
    random.Random(seed + epoch).shuffle(order)
    return [questions[i] for i in order[k * batch_size:(k + 1) * batch_size]]


def rollout_in_chunks(policy, tokenizer, questions, search, settings, group_size, rollout_batch_size, seed, generate_fn=None):
    """agent.rollout over the rank's questions in chunks of R // G questions (R = --rollout_batch_size
    rows per generate call; 0: one chunk), so the KV cache of only R rows is in memory at once.
    Chunk c samples with torch seed `seed + 1000003 * c` (chunk 0 with `seed`, as one chunk does):
    greedy results do not depend on R; sampled ones are another draw for each R."""
    G, R = group_size, rollout_batch_size
    per = max(1, R // G) if R else max(1, len(questions))
    trajectories = []
    for c, start in enumerate(range(0, len(questions), per)):
        torch.manual_seed(seed + 1000003 * c)
        trajectories += agent.rollout(policy, tokenizer, questions[start:start + per], search, settings, group_size=G,
                                      generate_fn=generate_fn)
    return trajectories


@dataclass
class Batch:
    """One step's trajectories on this rank, and what the step derives from them."""
    questions: list[dict]  # this rank's share of the step's questions
    samples: list[agent.Trajectory]  # the policy's: G per question
    experts: list[agent.Trajectory]  # the oracle's, joining their questions' groups (toy recipe; else [])
    rewards: list[float] = field(default_factory=list)  # per trajectory: what its advantage is computed from
    evidence: list[float] = field(default_factory=list)  # per trajectory: share of supporting passages retrieved
    advantages: torch.Tensor | None = None  # per trajectory: A_i, its group's normalised reward
    tied: set[str] = field(default_factory=set)  # question ids of the groups whose rewards are all equal (A = 0)
    kept: list[int] = field(default_factory=list)  # indices into `trajectories` of those trained on
    conversations: list[agent.Conversation] = field(default_factory=list)  # the kept trajectories' conversations

    def __post_init__(self):
        position = {str(q["id"]): k for k, q in enumerate(self.questions)}
        self.trajectories = sorted(self.samples + self.experts, key=lambda t: position[t.qid])  # all, group by group
        self._experts = {id(t) for t in self.experts}

    def sampled(self, trajectory) -> bool:
        """Sampled by the policy (not the oracle's)."""
        return id(trajectory) not in self._experts


def old_and_reference_logprobs(args, accelerator, policy, reference, conversations, from_policy, pad_id, counter=None):
    """Fill each conversation's `old_logprobs` (pi_old, the policy that sampled) and `ref_logprobs`
    (the KL reference; pi_old's when there is none). Those recorded while sampling equal a
    recomputation in float32 without autocast (tests/test_agent.py: parity 1e-4), so
    --old_logprobs recorded skips that forward pass there; the oracle's are always recomputed.
    Returns the largest |recorded - used| over sampled trained tokens (0 when they are the same)."""
    use_recorded = args.old_logprobs == "recorded" and accelerator.mixed_precision == "no"
    recorded = [use_recorded and s for s in from_policy]
    recompute = [c for c, r in zip(conversations, recorded) if not r]
    passes = (pad_id, accelerator.device, args.micro_batch_size, args.temperature, args.shared_prefix, counter)
    fresh = iter(grpo.response_logprobs(policy, recompute, *passes) if recompute else [])
    old = [torch.tensor(c.logprobs) if r else next(fresh) for c, r in zip(conversations, recorded)]
    gap = max((float((torch.tensor(c.logprobs) - o).abs().mul(torch.tensor(c.loss_mask)).max())
               for c, o, s in zip(conversations, old, from_policy) if s and c.loss_mask), default=0.0)
    ref = None
    if args.kl_coef > 0:
        with reference_pass(args, policy, reference, accelerator.device) as model:
            in_step = isinstance(model, FSDPModule)  # sharded (FSDP): passes are collective
            with runs.passes_in_step(accelerator, model, -(-len(conversations) // args.micro_batch_size) if in_step else None, pad_id):
                ref = grpo.response_logprobs(model, conversations, *passes[:4], passes[4] and not in_step, counter)
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
            runs.release_freed_memory()


def weightless(conversation):
    """`conversation` with zero log-probs and advantage: the weight-0 pass of a rank with nothing to train."""
    zeros = [0.0] * len(conversation.response_ids)
    return dataclasses.replace(conversation, old_logprobs=zeros, ref_logprobs=zeros, advantage=0.0)


def ppo_updates(accelerator, model, optimizer, conversations, stand_in, with_reference, pad_id, args, counter=None):
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

    def grpo_loss(logprobs, entropy, fields, num_tokens):
        return grpo.policy_loss(logprobs, fields["old_logprobs"], fields["advantage"], fields["loss_mask"],
                                fields["ref_logprobs"] if with_reference else None, clip_eps=args.clip_eps,
                                clip_ratio_c=args.clip_ratio_c, kl_coef=args.kl_coef,
                                entropy=entropy if args.entropy_coef else entropy.detach(),  # logged; no backward
                                entropy_coef=args.entropy_coef, num_tokens=num_tokens)

    for epoch in range(args.ppo_epochs):
        for m in range(n_mini):
            mini = sorted(conversations[bounds[m]:bounds[m + 1]], key=len)  # similar lengths per micro-batch
            grad_norm, loss, metrics, _ = optimizer_update(
                accelerator, model, optimizer, mini, stand_in, pad_id, args, ("old_logprobs", "ref_logprobs", "advantage"),
                grpo_loss, temperature=args.temperature, counter=counter)
            sums["loss"] += loss
            for key in ("kl", "clip_frac", "entropy", "ratio"):
                sums[key] += metrics[key]
            grad_norms.append(grad_norm)
    return sums, grad_norms


def optimizer_update(accelerator, model, optimizer, mini, stand_in, pad_id, args, fields, loss_fn,
                     temperature=1.0, return_entropy=True, autocast=True, counter=None):
    """One optimizer update over `mini` (this rank's conversations), accumulated over micro-batches:

        for micro in micro-batches of --micro_batch_size conversations:
            logprobs = token_logprobs(micro)                         (grpo.micro_logprobs)
            backward(loss_fn(logprobs, ..., num_tokens))             a sum over tokens / num_tokens
        clip the gradient norm; optimizer.step()

    Every trained token weighs the same wherever it lands: num_tokens = (trained tokens on all
    ranks) / world, since DDP averages gradients over ranks; and every rank runs the same number of
    passes, since each rank's last backward joins DDP's all-reduce: a rank with fewer adds passes
    of weight 0 over `stand_in` (`agree_across_ranks`). With --shared_prefix the prefixes the
    conversations share are encoded once for the update (`encode_shared_prefixes`, section 4).
    `args` needs micro_batch_size, shared_prefix and grad_clip.
    Returns (grad norm, summed loss, metrics summed weighted by tokens, tokens on this rank)."""
    precision = accelerator.autocast if autocast else contextlib.nullcontext
    size = args.micro_batch_size
    micro_batches = [mini[i:i + size] for i in range(0, len(mini), size)]
    p, prefixes = encode_shared_prefixes(accelerator, model, micro_batches or [stand_in], mini + stand_in, args, precision,
                                         counter)
    global_tokens, n_micro, all_share = agree_across_ranks(accelerator, mini, micro_batches, prefixes)
    prefixes = prefixes if all_share else {}
    num_tokens = max(global_tokens, 1.0) / accelerator.num_processes
    total_loss, sums, tokens = 0.0, {}, 0.0
    for u, micro in enumerate((micro_batches + [stand_in] * n_micro)[:n_micro]):
        weight = 1.0 if u < len(micro_batches) else 0.0
        synced = u == n_micro - 1 and not prefixes  # DDP all-reduces on this backward (else on the prefixes')
        with contextlib.nullcontext() if synced else accelerator.no_sync(model), precision():
            out, padded = grpo.micro_logprobs(model, micro, pad_id, accelerator.device, ("loss_mask",) + fields, temperature,
                                              return_entropy, prefixes=prefixes, counter=counter)
            padded["loss_mask"] = padded["loss_mask"] * weight
            logprobs, entropy = out if return_entropy else (out, None)
            loss, metrics = loss_fn(logprobs, entropy, padded, num_tokens)
            accelerator.backward(loss)
        n_here = float(padded["loss_mask"].sum())
        total_loss, tokens = total_loss + loss.item(), tokens + n_here
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value * n_here
    if prefixes and n_micro:
        backward_shared_prefixes(accelerator, model, micro_batches or [stand_in], p, prefixes, precision)
    grad_norm = step_optimizer(accelerator, model, optimizer, args.grad_clip)
    runs.release_freed_memory()
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


def agree_across_ranks(accelerator, mini, micro_batches, prefixes):
    """What every rank must know before its micro-batches: the trained tokens on all ranks (the
    token-mean's denominator), the most micro-batches any rank has (every rank runs that many),
    and whether every rank has shared prefixes (their last pass is collective: all or none)."""
    stats = torch.tensor([sum(sum(c.loss_mask) for c in mini), len(micro_batches), not prefixes], device=accelerator.device,
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


def step_metrics(accelerator, step, batch, sums, grad_norms, logprob_gap, timing, encoded_tokens):
    """The step's metrics.jsonl row: sums over all ranks, by name, then the means
    (docs/training.md lists every key)."""
    from_policy = [k for k, t in enumerate(batch.trajectories) if batch.sampled(t)]
    samples = batch.samples
    contexts = [n for t in samples for n in t.context_tokens] or [0]
    total = reduce_by_name(accelerator, dict(
        groups=len(batch.questions), tied_groups=len(batch.tied), skipped_trajectories=len(batch.trajectories) - len(batch.kept),
        oracle_trajectories=len(batch.experts), oracle_reward=sum(t.reward for t in batch.experts),
        evidence=sum(batch.evidence[k] for k in from_policy), reward_trained=sum(batch.rewards[k] for k in from_policy),
        n=len(samples), reward=sum(t.reward for t in samples),
        em=sum(agent.exact_match(t.prediction, t.golden_answers) for t in samples),
        f1=sum(agent.f1_score(t.prediction, t.golden_answers) for t in samples), format_valid=sum(t.reward > 0 for t in samples),
        turns=sum(t.num_turns for t in samples), searches=sum(t.num_searches for t in samples),
        conversations=len(batch.conversations), context=sum(contexts), context_count=len(contexts),
        trained_tokens=sum(sum(c.loss_mask) for c in batch.conversations), encoded_tokens=encoded_tokens, **sums))
    top = reduce_by_name(accelerator, dict(context_tokens_max=max(contexts), old_logprob_gap=logprob_gap), "max")
    n, tokens, updates = total["n"], max(total["trained_tokens"], 1), max(len(grad_norms), 1)
    return {"phase": "grpo", "step": step, **{k: total[k] / n for k in ("reward", "em", "f1", "format_valid", "turns", "searches")},
            "conversations_per_trajectory": total["conversations"] / n,
            "context_tokens_mean": total["context"] / max(total["context_count"], 1),
            "context_tokens_max": top["context_tokens_max"], "trained_tokens": total["trained_tokens"],
            "loss": total["loss"] / accelerator.num_processes / updates,
            **{k: total[k] / tokens for k in ("kl", "clip_frac", "entropy", "ratio")}, "grad_norm": sum(grad_norms) / updates,
            "updates": len(grad_norms), "skipped_updates": sum(not math.isfinite(g) for g in grad_norms),
            "evidence": total["evidence"] / n, "reward_trained": total["reward_trained"] / n,
            "oracle_trajectories": total["oracle_trajectories"],
            "oracle_reward": total["oracle_reward"] / max(total["oracle_trajectories"], 1),
            "equal_reward_groups": total["tied_groups"] / total["groups"], "skipped_trajectories": total["skipped_trajectories"],
            "old_logprob_gap": top["old_logprob_gap"], **timing, "encoded_tokens": total["encoded_tokens"]}


# ---------------------------------------------------------------------------------------------
# 4. Speedup (exact): the update's shared prefixes, encoded once instead of once per row
# ---------------------------------------------------------------------------------------------
def encode_shared_prefixes(accelerator, model, micro_batches, conversations, args, precision, counter=None):
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
    if not (args.shared_prefix and accelerator.distributed_type != DistributedType.FSDP and accelerator.scaler is None):
        return None, {}
    p = grpo.common_prefix([c.prompt_ids for c in conversations])
    with precision(), torch.no_grad():
        prefixes, _ = grpo.encode_prefixes(accelerator.unwrap_model(model, keep_fp32_wrapper=True), micro_batches, p,
                                           counter=counter)
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
                                             first_model=model)
        pairs = [(s, s0.grad) for k in prefixes for kv, kv0 in zip(again[k][1], prefixes[k][1])
                 for s, s0 in zip(kv, kv0) if s0.grad is not None]
        accelerator.backward(0.0 * logits + sum((s * g).sum() for s, g in pairs))


if __name__ == "__main__":
    main()
