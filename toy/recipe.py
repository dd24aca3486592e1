"""The small-budget recipe of the toy preset: what lets a 135M model learn from a few GRPO steps.

The paper trains Qwen2.5-3B/7B, which emit well-formed trajectories from the start. SmolLM2-135M
never does, and GRPO with 16 trajectories a step has too little signal to find the format alone
(docs/design.md, "The warm start" and "The small-budget recipe"). So the toy preset adds four
steps around the paper's loop; train.py calls each through one function here, and each is a no-op
in the paper preset (its flags are off there):

1. warm_start            supervised steps on oracle demonstrations before GRPO
2. oracle_trajectories   expert trajectories join the groups no sample solved (David-GRPO, LUFFY)
3. shaped_rewards        evidence credit: a share of the reward for retrieving the supporting passages
4. skip_tied_groups      groups whose rewards are all equal skip the log-prob passes and the update (DAPO)

The flags are train.py's (`HYPERPARAMETERS` below joins its list); `check_config` their checks.
"""
import json
import os
import random
import shutil
import time

import torch
from tqdm import tqdm

import agent
from toy import oracle
from evaluate import evidence_share  # the evaluation's evidence recall, here a reward term

# (flag, toy preset, paper preset, help), as train.HYPERPARAMETERS
HYPERPARAMETERS = [
    ("warm_start_steps", 30, 0, "supervised steps on oracle demonstrations before GRPO (docs/design.md); paper: 0"),
    ("warm_start_questions", 100, 0, "train questions the oracle acts out for the warm start"),
    ("warm_start_mix", "1:1:1", "1:1:1", "shares of single-hop:bridge:comparison among those questions, first ones of each type in file order"),
    ("warm_start_batch", 4, 4, "demonstration conversations per warm-start step, over all ranks"),
    ("warm_start_lr", 1e-4, 1e-5, "AdamW learning rate of the warm start, constant"),
    ("warm_start_save_every", 10, 10, "save the warm start's state every N steps, so --resume continues an interrupted one"),
    ("oracle_per_group", 1, 0, "K oracle trajectories (toy/oracle.py) join each group whose question has a reasoning chain "
     "(expert bootstrapping: David-GRPO, LUFFY); paper: 0"),
    ("oracle_when_unsolved", True, False, "add the oracle only to groups where no sampled trajectory earned reward 1"),
    ("evidence_weight", 0.3, 0.0, "lambda: reward = (1 - lambda) released reward + lambda share of the question's supporting "
     "passages retrieved (David-GRPO's evidence credit), for rows with supporting ids; paper: 0"),
    ("skip_equal_groups", True, False, "groups whose rewards are all equal (advantage 0) skip the log-prob passes and the update "
     "(DAPO, MemAgent); the token-mean is then over the kept tokens"),
]


def warm_start_mix(args) -> dict:
    """--warm_start_mix "1:1:1" -> {"single": 1.0, "bridge": 1.0, "comparison": 1.0}."""
    try:
        shares = [float(x) for x in args.warm_start_mix.split(":")]
    except ValueError:
        shares = []
    if len(shares) != 3 or min(shares) < 0 or sum(shares) <= 0:
        raise ValueError("give three shares >= 0, not all 0, as single:bridge:comparison (e.g. 1:1:1)")
    return dict(zip(("single", "bridge", "comparison"), shares))


def check_config(args, flag) -> list[str]:
    """The recipe's configuration problems; `flag(name)` shows a flag with its value and source."""
    problems = []
    if not 0.0 <= args.evidence_weight <= 1.0:
        problems.append(f"{flag('evidence_weight')} must be in [0, 1]")
    if args.oracle_per_group < 0:
        problems.append(f"{flag('oracle_per_group')} must be >= 0")
    try:
        warm_start_mix(args)
    except ValueError as e:
        problems.append(f"{flag('warm_start_mix')}: {e}")
    return problems


# ---------------------------------------------------------------------------------------------
# 1. The warm start: supervised steps on oracle demonstrations, through GRPO's own update
# ---------------------------------------------------------------------------------------------
def warm_start(accelerator, model, optimizer, tokenizer, search, args, settings, log, *, update, save, trim_logs,
               reset_reference):
    """--warm_start_steps supervised steps on oracle demonstrations, saved as warm_start/ (with
    --resume a finished warm start is loaded, an interrupted one continued). GRPO then starts from
    it with fresh AdamW moments at its own learning rate, and its KL reference is it. train.py
    passes its own functions: `update` (one optimizer update, `train.optimizer_update`), `save`
    (a checkpoint), `trim_logs` and `reset_reference` (the reference := the current policy).
    No-op when --warm_start_steps is 0 (the paper preset)."""
    if args.warm_start_steps <= 0:
        return
    warm_dir, partial = (os.path.join(args.output_dir, name) for name in ("warm_start", "warm_start_partial"))
    if args.resume and os.path.isfile(os.path.join(warm_dir, "trainer_state.json")):
        accelerator.load_state(os.path.join(warm_dir, "state"))
        accelerator.print(f"warm start already done: {warm_dir}")
    else:
        demos, stats = demonstrations(args, search, tokenizer, settings)
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
        supervised_steps(accelerator, model, optimizer, demos, tokenizer.pad_token_id, args, log, update,
                         start=done, save=lambda step: save(step, "warm_start_partial"))
        save(0, "warm_start")
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
    optimizer.optimizer.state.clear()  # GRPO starts with fresh AdamW moments, at its own learning rate
    for group in optimizer.param_groups:
        group["lr"] = args.lr
    reset_reference()  # the KL reference is the warm-started policy: what RL starts from


def demonstrations(args, search, tokenizer, settings):
    """Oracle demonstrations of --warm_start_questions train questions, the first of each type in the
    --warm_start_mix shares (toy/oracle.py): acted out through agent.rollout, so prompts, tool turns
    and loss masks are exactly RL's."""
    rows = oracle.load_rows(args.train_data)
    if not all((r.get("metadata") or {}).get("chain") for r in rows):
        raise SystemExit(f"train.py: --warm_start_steps needs questions with reasoning chains (toy/make_toy.py); "
                         f"{args.train_data} has none: use --warm_start_steps 0")
    try:
        rows = oracle.pick_questions(rows, args.warm_start_questions, warm_start_mix(args))
    except ValueError as e:
        raise SystemExit(f"train.py: --warm_start_mix {args.warm_start_mix}: {e}")
    trajectories, stats = oracle.make_demonstrations(rows, search, tokenizer, settings, seed=args.seed)
    return [c for t in trajectories for c in t.conversations], stats


def supervised_steps(accelerator, model, optimizer, demos, pad_id, args, log, update, start=0, save=lambda step: None):
    """The token-mean negative log-likelihood over exactly the loss mask RL trains, on
    --warm_start_batch demonstration conversations a step (split over ranks), through the same
    micro-batched update as GRPO, in float32 whatever --mixed_precision says (every warm start
    judged on validation was; a bf16 one is another policy). The batches are a function of (seed,
    step), so a run resumed at `start` (weights and optimizer restored) continues exactly;
    `save(step)` runs every --warm_start_save_every steps."""
    rank, world = accelerator.process_index, accelerator.num_processes
    order, epoch = [], 0
    bar = tqdm(range(start, args.warm_start_steps), initial=start, total=args.warm_start_steps,
               disable=not accelerator.is_main_process, desc="warm start")
    nll = lambda logprobs, entropy, fields, num_tokens: (-(logprobs * fields["loss_mask"]).sum() / num_tokens, {})  # noqa: E731
    for step in bar:
        while len(order) < (step + 1) * args.warm_start_batch:  # a fresh seeded shuffle every epoch
            more = list(range(len(demos)))
            random.Random(args.seed * 7919 + epoch).shuffle(more)
            order, epoch = order + more, epoch + 1
        batch = [demos[i] for i in order[step * args.warm_start_batch:(step + 1) * args.warm_start_batch]]
        mine = sorted(batch[rank::world], key=len)
        t0 = time.time()
        grad_norm, loss, _, tokens = update(accelerator, model, optimizer, mine, demos[:1], pad_id, args, (),
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
# 2-4. Inside a GRPO step: the oracle in unsolved groups, evidence credit, tied groups skipped
# ---------------------------------------------------------------------------------------------
def oracle_trajectories(args, questions, samples, search, tokenizer, seed, settings) -> list[agent.Trajectory]:
    """--oracle_per_group K: expert bootstrapping (David-GRPO, LUFFY). K trajectories of the oracle
    (toy/oracle.py) join the group of each question that has a reasoning chain, with
    --oracle_when_unsolved only where no sampled trajectory earned reward 1. [] when K = 0."""
    if not args.oracle_per_group:
        return []
    solved = {t.qid for t in samples if t.reward >= 1.0} if args.oracle_when_unsolved else set()
    return oracle.group_experts([q for q in questions if str(q["id"]) not in solved], search, tokenizer,
                                args.oracle_per_group, settings, seed=seed)


def shaped_rewards(args, trajectories, questions) -> tuple[list[float], list[float]]:
    """--evidence_weight lambda (David-GRPO's evidence credit), for questions with supporting ids:

        R = (1 - lambda) R_released + lambda E,    E = share of supporting passages retrieved

    Returns (R per trajectory, E per trajectory); R = R_released when lambda = 0 (the paper)."""
    supporting = {str(q["id"]): (q.get("metadata") or {}).get("supporting_ids") for q in questions}
    evidence = [evidence_share(t, supporting[t.qid]) for t in trajectories]
    rewards = [(1 - args.evidence_weight) * t.reward + args.evidence_weight * e
               if args.evidence_weight > 0 and supporting[t.qid] else t.reward for t, e in zip(trajectories, evidence)]
    return rewards, evidence


def skip_tied_groups(args, trajectories, advantages) -> tuple[set[str], list[int]]:
    """The groups whose rewards are all equal (A = 0: no signal) and, with --skip_equal_groups
    (DAPO, MemAgent), the trajectories left to train: the tied groups' skip the log-prob passes and
    the update, and the token-mean is then over the kept tokens. Returns (tied question ids, kept
    indices); every index is kept without the flag (the paper)."""
    tied = {t.qid for t in trajectories} - {t.qid for t, a in zip(trajectories, advantages) if a != 0}
    kept = [i for i, t in enumerate(trajectories) if not (args.skip_equal_groups and t.qid in tied)]
    return tied, kept
