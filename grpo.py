"""Multi-context GRPO: the objective MemSearcher trains with (the paper's Figure 2).

One attempt at a question is a *trajectory*; it is made of several *conversations* (one LLM
context per turn). The G trajectories of one question form a *group*. The trajectory's single
outcome reward becomes a group-normalised *advantage*, that advantage is copied to every
conversation of the trajectory, and each conversation is then an independent sample of a
per-token PPO objective with its own loss mask.

    1. group_advantages      A_i  = (R_i - mean(R_group)) / (std(R_group) + eps)
    2. propagate_advantages  A_ij = A_i
    3. token_logprobs        log pi(x_t | x_<t); conversations padded into micro-batches
                             (pad_batch, response_logprobs)
    4. policy_loss           clipped surrogate (dual clip) + kl_coef * KL(k3) - entropy bonus

    Speedups (exact; each docstring opens with the plain code it replaces and names the test that
    proves the two equal):
    5. selective_logprobs    the log-softmax of step 3, a chunk of rows at a time; one call, in
                             token_logprobs
    6. encode_prefixes       the prefixes conversations share (the system prompt; a group's
                             turn-1 prompt), encoded once per pass instead of once per row; it
                             enters step 3 as a `prefixes` argument of token_logprobs,
                             micro_logprobs and response_logprobs (None or {}: the plain path)

Pure tensor math: this file imports torch and the standard library only (and, lazily, the cache
class of transformers for the shared prefix).
"""
from __future__ import annotations

import collections
from contextlib import contextmanager

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------
# 1. Trajectory-level advantages
# ---------------------------------------------------------------------------------------------
def group_advantages(rewards, group_ids, eps: float = 1e-6) -> torch.Tensor:
    """One advantage per trajectory, normalised within its group (GRPO, Shao et al. 2024):

        A_i = (R_i - mean({R_1..R_G})) / (std({R_1..R_G}) + eps),  std unbiased (divisor G - 1)

    `rewards` [N] (tensor or list); `group_ids` [N]: the question id of each trajectory. Groups
    are keyed by id, not by position, and may come in any order. A group whose rewards are all
    equal carries no signal and gets A = 0. A group of one member is an error (GRPO needs G >= 2).
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if torch.is_tensor(group_ids):
        group_ids = group_ids.tolist()
    if len(group_ids) != len(rewards):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    members = collections.defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    advantages = torch.zeros_like(rewards)
    for g, idx in members.items():
        if len(idx) < 2:
            raise ValueError(f"group {g!r} has a single trajectory; GRPO needs G >= 2 per group")
        r = rewards[idx]
        if not bool((r == r[0]).all()):  # equal rewards: exactly 0, not round-off / eps
            advantages[idx] = (r - r.mean()) / (r.std(unbiased=True) + eps)
    return advantages


# ---------------------------------------------------------------------------------------------
# 2. Propagation: every conversation of a trajectory shares its advantage
# ---------------------------------------------------------------------------------------------
def propagate_advantages(advantages: torch.Tensor, conversation_trajectory_index) -> torch.Tensor:
    """Multi-context GRPO's propagation step:  A_ij = A_i  for every conversation j of trajectory i.

    `advantages` [N_trajectories]; `conversation_trajectory_index` [N_conversations]: for each
    conversation, the index of its trajectory in `advantages`. Returns [N_conversations] (empty
    for an empty index: a step whose groups were all skipped).
    """
    return advantages[torch.as_tensor(conversation_trajectory_index, dtype=torch.long, device=advantages.device)]


# ---------------------------------------------------------------------------------------------
# 3. Token log-probabilities, and conversations into micro-batches
# ---------------------------------------------------------------------------------------------
def token_logprobs(model, input_ids, attention_mask, temperature: float = 1.0, *,
                   response_start: int | None = None, return_entropy: bool = False, prefix=None):
    """Log-probability of each token under the policy pi at sampling temperature T:

        out[:, t] = log pi(x_t | x_<t) = log softmax(z_{t-1} / T)[x_t]      (t >= 1)

    Alignment: the output is [B, L], aligned with `input_ids`; position t scores token t itself,
    so a loss mask aligned with `input_ids` applies directly. Position 0 (no prefix) is 0, and so
    is every t < `response_start`: with `response_start=s` the model only computes logits for
    the last L - s + 1 positions (HF `logits_to_keep`), since prompts are never trained.

    Left padding: position ids are `cumsum(attention_mask) - 1` clamped at 0. Values at padded
    positions are meaningless; mask them. With `return_entropy=True` returns (logprobs, entropy),
    entropy[:, t] = H(pi(. | x_<t)) aligned the same way (0 where logprobs are 0).
    Memory: besides the model's own logits [B, L - s + 1, V] (in the model's dtype), only one
    chunk of rows is upcast at a time, forward and backward, and the backward writes the logits'
    gradient into the logits' own memory (so backward through an output once only). Outputs are
    float32 (float64 for a float64 model).

    `prefix`: the `prefix_states` of P tokens that precede every row; `input_ids` then holds only
    what follows them (left padding sits between the prefix and each row's tokens, masked), the
    positions continue at P, and the output is aligned with `input_ids` as above. A row's first
    token after the prefix is scored from padding (like a row's first token without one), so keep
    at least one prompt token in every row.
    """
    B, L = input_ids.shape
    start = 1 if response_start is None else max(1, int(response_start))
    if start >= L:
        raise ValueError(f"response_start={start} leaves no token to score in length {L}")
    keep = L - start + 1  # logits at positions start-1 .. L-1 (the last one scores nothing)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    extra = {"logits_to_keep": keep} if start > 1 else {}
    flags = {}
    if prefix is not None:
        p = prefix[0][0].shape[-2]
        attention_mask = torch.cat([attention_mask.new_ones(B, p), attention_mask], 1)
        position_ids = position_ids + p
        extra["cache"] = prefix_cache(prefix, B)
        flags = {"_can_checkpoint_with_cache": True}  # the cache is read-only: a recompute reads the same states
    with _layer_flags(model, **flags):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False, **extra).logits
    if logits.shape[1] != keep:  # a model that ignores logits_to_keep (slicing would copy grads)
        logits = logits[:, -keep:]
    targets = F.pad(input_ids[:, start:], (0, 1))  # a dummy target for the unused last position
    logp, entropy = selective_logprobs(logits.reshape(B * keep, -1), targets.reshape(-1), temperature, return_entropy)
    logp = F.pad(logp.view(B, keep)[:, :-1], (start, 0))
    if not return_entropy:
        return logp
    return logp, F.pad(entropy.view(B, keep)[:, :-1], (start, 0))


def pad_batch(conversations, pad_id, device, fields=(), skip=0):
    """Left-pad prompt+response (less its first `skip` tokens, a shared prefix); returns input_ids,
    attention_mask, response_start, and each per-response-token field (e.g. loss_mask, old logprobs)
    right-aligned to [B, L]; a per-conversation number (the advantage) fills its response span."""
    seqs = [(c.prompt_ids + c.response_ids)[skip:] for c in conversations]
    width = max(map(len, seqs))
    response_start = width - max(len(c.response_ids) for c in conversations)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    out = {name: torch.zeros((len(seqs), width), dtype=torch.float32) for name in fields}
    for i, (s, c) in enumerate(zip(seqs, conversations)):
        ids[i, width - len(s):] = torch.tensor(s)
        attn[i, width - len(s):] = 1
        for name in fields:
            out[name][i, width - len(c.response_ids):] = torch.as_tensor(getattr(c, name), dtype=torch.float32)
    return ids.to(device), attn.to(device), response_start, {k: v.to(device) for k, v in out.items()}


def micro_logprobs(model, micro, pad_id, device, fields, temperature, return_entropy=False, prefixes=None, counter=None):
    """token_logprobs of one micro-batch of conversations (`pad_batch`), and its padded `fields`.
    `prefixes` ({} or None: none) are the states `encode_prefixes` made for the pass: the rows then
    skip the longest one they all start with and attend to its states instead. `counter` (a
    collections.Counter, optional) adds the token positions run, padding included, to "encoded_tokens"."""
    p, states = prefix_for(prefixes or {}, micro)
    ids, attn, start, f = pad_batch(micro, pad_id, device, fields, skip=p)
    if counter is not None:
        counter["encoded_tokens"] += ids.numel()
    out = token_logprobs(model, ids, attn, temperature, response_start=start, return_entropy=return_entropy,
                         prefix=states if p else None)
    return out, f


@torch.no_grad()
def response_logprobs(model, conversations, pad_id, device, micro_batch_size, temperature, shared_prefix=False, counter=None):
    """Per-conversation log-probs of the response tokens (a list of 1-D CPU tensors, in the given
    order). Micro-batches go by length, so they carry little padding; with `shared_prefix`, the
    prefixes the conversations share are encoded once for the whole pass (`encode_prefixes`).
    `counter`: as in `micro_logprobs`."""
    was_training = model.training
    model.eval()
    order = sorted(range(len(conversations)), key=lambda k: len(conversations[k].prompt_ids) + len(conversations[k].response_ids))
    chunks = [[conversations[k] for k in order[s:s + micro_batch_size]] for s in range(0, len(order), micro_batch_size)]
    p = common_prefix([c.prompt_ids for c in conversations]) if shared_prefix and conversations else None
    prefixes, _ = encode_prefixes(model, chunks, p, counter=counter)
    result = [None] * len(conversations)
    for s, chunk in zip(range(0, len(order), micro_batch_size), chunks):
        lp, _ = micro_logprobs(model, chunk, pad_id, device, (), temperature, prefixes=prefixes, counter=counter)
        lp = lp.float().cpu()
        for k, (i, c) in zip(order[s:s + micro_batch_size], enumerate(chunk)):
            result[k] = lp[i, lp.shape[1] - len(c.response_ids):]
    model.train(was_training)
    return result


# ---------------------------------------------------------------------------------------------
# 4. The per-token policy loss
# ---------------------------------------------------------------------------------------------
def policy_loss(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs=None, *,
                clip_eps: float = 0.2, clip_ratio_c: float = 3.0, kl_coef: float = 0.001,
                entropy=None, entropy_coef: float = 0.0, num_tokens=None):
    """Per token t of each conversation, with r_t = pi(x_t) / pi_old(x_t) = exp(logp - old_logp):

        L_clip = -min(r_t A, clip(r_t, 1 - eps, 1 + eps) A)              (PPO, Schulman et al. 2017)
        L_pg   = min(L_clip, c * |A|)  if A < 0  else  L_clip            (dual clip, Ye et al. 2020)
        KL_t   = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]     (k3, as in GRPO)
        l_t    = L_pg + kl_coef * KL_t - entropy_coef * H_t         (kl_coef is the papers' beta)

        loss = sum_t mask_t * l_t / num_tokens

    `advantages` is [B] (one per conversation, the same on each of its tokens) or [B, T]. `num_tokens`
    defaults to mask.sum(). To get the token-mean of a whole batch split into micro-batches, pass
    every micro-batch the batch's trained-token count N and sum the losses (accumulate gradients).
    Under DDP, which *averages* gradients over W ranks, pass N_all_ranks / W instead (or pass
    N_all_ranks and scale the loss by W): both give exactly sum_tokens l_t / N_all_ranks.
    Masked tokens do not matter at all, even if their inputs are inf or NaN; NaNs on trained
    tokens propagate (the trainer detects them).
    Returns (loss, metrics): metrics are float means over this call's masked tokens.
    """
    mask = loss_mask.bool()
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.expand_as(logprobs)
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    ratio = log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    loss_pg = torch.where(advantages < 0, torch.minimum(loss_clip, -clip_ratio_c * advantages), loss_clip)
    per_token = loss_pg
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        ref_log_ratio = torch.where(mask, ref_logprobs - logprobs, 0.0)
        kl = (ref_log_ratio.exp() - ref_log_ratio - 1).clamp(-10.0, 10.0)
        per_token = per_token + kl_coef * kl
    if entropy is not None:
        per_token = per_token - entropy_coef * entropy
    denominator = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    loss = torch.where(mask, per_token, 0.0).sum() / denominator

    with torch.no_grad():
        def mean(x):
            return (x.float() * mask).sum().item() / max(int(mask.sum()), 1)
        metrics = {
            "ratio": mean(ratio),
            "clip_frac": mean(loss_clipped > loss_unclipped),
            "dual_clip_frac": mean((advantages < 0) & (loss_clip > -clip_ratio_c * advantages)),
            "kl": mean(kl),
            "entropy": mean(torch.where(mask, entropy, 0.0)) if entropy is not None else 0.0,
        }
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# 5. Speedup (exact): the log-softmax a chunk of rows at a time (selective_logprobs)
# ---------------------------------------------------------------------------------------------
def selective_logprobs(logits, targets, temperature: float = 1.0, with_entropy: bool = False):
    """Speedup of the plain

        logq = torch.log_softmax(logits.float() / temperature, -1)        # [N, V] float32
        logp = logq.gather(-1, targets[:, None]).squeeze(-1)             # log p(y_n)
        entropy = -(logq.exp() * logq).sum(-1)                           # H_n

    which holds a float32 copy of all N x V logits (and autograd keeps more): for a micro-batch of
    4 conversations of 3k tokens over Qwen2.5's 151,936 words that is 7 GB. Here the rows are taken
    a chunk at a time (CHUNK_ELEMENTS), forward and backward, and the backward writes the logits'
    gradient into the logits' own memory, so nothing of size N x V is allocated beyond the model's
    own logits. Returns (logp, entropy) [N] in float32 (float64 for float64 logits); entropy is
    zeros unless `with_entropy`. Proven equal to the plain code, values and gradients:
    tests/test_grpo.py::test_token_logprobs_equal_naive_gather and ::test_token_logprobs_chunking_is_exact.
    """
    return _ChunkedLogProbEntropy.apply(logits, targets, float(temperature), with_entropy)


CHUNK_ELEMENTS = 2**24  # rows per chunk = CHUNK_ELEMENTS // vocab: a 64 MB float32 slab at a time


class _ChunkedLogProbEntropy(torch.autograd.Function):
    """For each row n of logits z [N, V] (already in the model's dtype) and target y_n:

        log p(y_n) = z_n[y_n]/T - logsumexp(z_n/T),   H_n = -sum_v p_v log p_v

    computed and differentiated a chunk of rows at a time, in float32 (float64 stays float64).
    Saves only the logits; backward recomputes softmax per chunk and writes the gradient into the
    logits' own memory (a second backward through them would fail the version check, not corrupt):

        d log p(y) / dz = (onehot(y) - p) / T,       dH / dz = -p (log p + H) / T
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy):
        ctx.set_materialize_grads(False)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        logp = logits.new_empty(logits.shape[0], dtype=dtype)
        entropy = logits.new_zeros(logits.shape[0], dtype=dtype)
        for rows in _row_chunks(logits):
            z = _scaled(logits[rows], dtype, temperature)
            lse = z.logsumexp(-1)
            logp[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse
            if with_entropy:  # H = lse - sum_v p_v z_v
                entropy[rows] = lse - (torch.softmax(z, -1) * z).sum(-1)
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.dtype = temperature, dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets = ctx.saved_tensors
        grad_logits = logits  # written in place, chunk by chunk: the logits are not needed after
        for rows in _row_chunks(logits):
            logq = torch.log_softmax(_scaled(logits[rows], ctx.dtype, ctx.temperature), -1)
            p = logq.exp()
            g_lp = grad_logp[rows, None] if grad_logp is not None else p.new_zeros(len(p), 1)
            if grad_entropy is None:  # g = -p g_lp  (+ g_lp at the target, below)
                g = p.mul_(-g_lp)
            else:  # g = p (-g_H (log p + H) - g_lp)
                h = -(p * logq).sum(-1, keepdim=True)
                g = logq.add_(h).mul_(-grad_entropy[rows, None]).sub_(g_lp).mul_(p)
            g.scatter_add_(-1, targets[rows, None], g_lp)
            grad_logits[rows] = g.div_(ctx.temperature)
        return grad_logits, None, None, None


def _scaled(logits_chunk, dtype, temperature):
    z = logits_chunk.to(dtype)
    return z if temperature == 1.0 else z / temperature


def _row_chunks(logits: torch.Tensor):
    step = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    return (slice(i, i + step) for i in range(0, logits.shape[0], step))


# ---------------------------------------------------------------------------------------------
# 6. Speedup (exact): a shared prefix encoded once (Prefix Grouper, arXiv 2506.05433)
# ---------------------------------------------------------------------------------------------
def common_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens all `prompts` share (every MemSearcher conversation's: at least the
    system prompt), kept one short of the shortest prompt so that each row scores its first
    response token from a token of its own (and a generation starts from a token of its own)."""
    n = min(map(len, prompts)) - 1
    return next((k for k in range(n) if any(p[k] != prompts[0][k] for p in prompts)), max(n, 0))


def encode_prefixes(model, micro_batches, p, first_model=None, counter=None):
    """Speedup of encoding the prompt tokens that conversations share in every row that has them.
    Plain, every micro-batch runs its rows' whole prompts, the system prompt in each row:

        for micro in micro_batches:
            micro_logprobs(model, micro, ..., prefixes={})

    Here the prefixes a pass shares are run once (`prefix_states`) and each row attends to their
    keys and values (`micro_logprobs(..., prefixes=encode_prefixes(...)[0])`). Returns {key:
    (length, states)}: key () holds the p tokens all the conversations share (the system prompt);
    a prompt that alone fills micro-batches of two or more rows between them (a group's turn-1
    prompt: system, question, empty memory) is encoded too, less its last token, continued from
    the first, under its tuple of ids. Also returns the sum of the passes' last logits; ({}, 0.0)
    when p is None (off). `first_model`: the module the first pass goes through (default
    `model`); `counter`: as in `micro_logprobs`. Proven equal to the plain passes, values
    and gradients: tests/test_grpo.py::test_shared_prefix_equals_plain_forward and
    ::test_response_logprobs_with_shared_prefixes_equal_plain, and for a whole optimizer update
    tests/test_train.py::test_shared_prefix_update_equals_plain.
    The paper preset's micro-batches of 4, taken by length, mostly mix groups, so there the
    system prompt is the prefix that counts (what it saves: docs/performance.md).
    """
    if p is None:
        return {}, 0.0
    uses = collections.Counter()
    for micro in micro_batches:
        prompts = {tuple(c.prompt_ids) for c in micro}
        if len(prompts) == 1:
            uses[prompts.pop()] += len(micro)
    passes = ([((), micro_batches[0][0].prompt_ids[:p])] if p else []) + \
        [(k, k[p:-1]) for k, n in uses.items() if n > 1 and len(k) - 1 > p]
    prefixes, logits = {}, 0.0
    for i, (key, ids) in enumerate(passes):
        states, last = prefix_states(first_model if first_model and not i else model, ids, return_logits=True,
                                     past=prefixes[()][1] if key and p else None)
        prefixes[key], logits = (len(key) - 1 if key else p, states), logits + last.float().sum()
    if counter is not None:
        counter["encoded_tokens"] += sum(len(ids) for _, ids in passes)
    return prefixes, logits


def prefix_for(prefixes, micro):
    """(length, states) of the longest encoded prefix that every row of `micro` starts with; (0, None) for none."""
    prompts = {tuple(c.prompt_ids) for c in micro}
    key = prompts.pop() if len(prompts) == 1 and prompts <= prefixes.keys() else ()
    return prefixes.get(key, (0, None))


def prefix_states(model, prefix_ids, past=None, return_logits=False):
    """Run a token prefix shared by a batch's rows once (batch 1) and return its keys and values,
    one (keys [1, heads, P, head_dim], values) pair per layer, with their graph when grad is on
    (and, with `return_logits`, the logits of its last position, [1, 1, V]).
    With `past` (the states of a shorter prefix) the tokens continue it: they attend to it, their
    positions follow it, and the result covers both (a group's turn-1 prompt after the system's).

    Each row then attends to these instead of to its own copy (`token_logprobs(prefix=...)`).
    Why it is exact: in a causal model the prefix's keys and values depend on the prefix alone,
    so they are the same in every row; giving every row a view of one copy changes the order of
    float additions only, and in backward the view's gradients sum into the one prefix computation,
    which is what each row's copy would have received. Activation checkpointing is off for this
    short batch-1 pass (a checkpointed layer drops the cache it would write)."""
    ids = torch.as_tensor(prefix_ids, device=_device(model)).view(1, -1)
    start = past[0][0].shape[-2] if past else 0
    extra = {"cache": prefix_cache(past, 1, writable=True),
             "position_ids": torch.arange(start, start + ids.shape[1], device=ids.device)[None]} if past else {}
    with _layer_flags(model, gradient_checkpointing=False):
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **extra)
    cache = getattr(out, "cache", None) or out.past_key_values
    states = [(layer.keys, layer.values) for layer in cache.layers]
    return (states, out.logits) if return_logits else states


def prefix_cache(states, batch: int, writable: bool = False):
    """A transformers cache holding `states` expanded (a view) to `batch` rows. Read-only (the
    log-prob passes): each layer returns [prefix; new] and stores nothing, so a checkpointed layer
    may recompute against it. Writable (a rollout's generate): an ordinary DynamicCache."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class ReadOnlyLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            return torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)

    cache = DynamicCache()
    cache.layers = []
    for keys, values in states:
        layer = DynamicLayer() if writable else ReadOnlyLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1)
        cache.layers.append(layer)
    return cache


@contextmanager
def _layer_flags(model, **flags):
    """Set attributes on every submodule that has them (e.g. a decoder layer's checkpointing), then restore."""
    saved = [(m, k, getattr(m, k)) for m in model.modules() for k in flags if hasattr(m, k)]
    for m, k, _ in saved:
        setattr(m, k, flags[k])
    try:
        yield
    finally:
        for m, k, v in reversed(saved):
            setattr(m, k, v)


def _device(model):
    return next(model.parameters()).device
