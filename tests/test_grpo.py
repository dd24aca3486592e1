"""Tests for grpo.py: hand-computed advantages and losses, exactness of the memory-lean
log-probs, micro-batch gradient accumulation, and a tiny policy that learns with multi-context GRPO."""
import copy
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from grpo import group_advantages, policy_loss, propagate_advantages, token_logprobs


# ---------------------------------------------------------------------------------------------
# 1. Advantages
# ---------------------------------------------------------------------------------------------
def test_group_advantages_hand_values_shuffled_groups():
    # q2 = [1, 0.5, 1] at positions 0, 2, 4; q1 = [0, 1] at 1, 5; q3 = [0.1]*3 (all equal)
    rewards = [1.0, 0.0, 0.5, 0.1, 1.0, 1.0, 0.1, 0.1]
    ids = ["q2", "q1", "q2", "q3", "q2", "q1", "q3", "q3"]
    # q2: mean 5/6, unbiased std sqrt(((1/6)^2 * 2 + (1/3)^2) / 2) = sqrt(1/12)
    s2 = math.sqrt(1 / 12) + 1e-6
    # q1: mean 0.5, unbiased std sqrt(0.5)
    s1 = math.sqrt(0.5) + 1e-6
    expected = [(1 / 6) / s2, -0.5 / s1, (-1 / 3) / s2, 0.0, (1 / 6) / s2, 0.5 / s1, 0.0, 0.0]
    adv = group_advantages(rewards, ids)
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)
    assert adv[3] == 0 and adv[6] == 0 and adv[7] == 0  # exactly zero, not round-off / eps


def test_group_advantages_keyed_by_id_not_position():
    rewards = torch.tensor([0.0, 1.0, 0.3, 0.7, 0.2, 0.9])
    ids = torch.tensor([7, 3, 7, 3, 7, 3])
    perm = torch.tensor([4, 1, 5, 0, 3, 2])
    adv = group_advantages(rewards, ids)
    assert torch.allclose(group_advantages(rewards[perm], ids[perm]), adv[perm])
    assert abs(adv[[0, 2, 4]].sum()) < 1e-6 and abs(adv[[1, 3, 5]].sum()) < 1e-6


def test_group_of_one_is_an_error():
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages([1.0, 0.0, 1.0], ["a", "a", "b"])


def test_propagate_advantages_copies_trajectory_advantage_to_each_conversation():
    adv = torch.tensor([0.5, -1.0, 2.0])
    conv_traj = [0, 0, 1, 2, 2, 2]
    assert propagate_advantages(adv, conv_traj).tolist() == [0.5, 0.5, -1.0, 2.0, 2.0, 2.0]


# ---------------------------------------------------------------------------------------------
# 2. The policy loss, by hand
# ---------------------------------------------------------------------------------------------
def _three_conversations(garbage_logp=30.0, garbage_old=-1e4):
    """conv 0: A=+1, ratios (1.5 -> clipped to 1.2, 1.0); conv 1: A=-1, ratios (5 -> dual-clipped
    to c=3, 0.5 -> clipped to 0.8); conv 2: A=0.5, ratio 0.9, then a masked token (garbage)."""
    old = torch.tensor([[-1.0, -2.0], [-0.5, -1.5], [-3.0, garbage_old]])
    ratios = torch.tensor([[1.5, 1.0], [5.0, 0.5], [0.9, 1.0]])
    logp = (old + ratios.log()).clone()
    logp[2, 1] = garbage_logp
    advantages = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    return logp.requires_grad_(), old, advantages, mask


def test_policy_loss_hand_example():
    logp, old, adv, mask = _three_conversations()
    loss, m = policy_loss(logp, old, adv, mask, kl_coef=0.0)
    # per token: -1.2, -1.0 | +3.0 (dual clip), +0.8 | -0.45 ; 5 tokens
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 3.0 + 0.8 - 0.45) / 5, abs=1e-6)
    loss.backward()
    # only unclipped tokens carry gradient: d(-r A)/dlogp / 5 = -r A / 5
    expected_grad = torch.tensor([[0.0, -1.0 / 5], [0.0, 0.0], [-0.9 * 0.5 / 5, 0.0]])
    assert torch.allclose(logp.grad, expected_grad, atol=1e-6)
    assert m["ratio"] == pytest.approx((1.5 + 1.0 + 5.0 + 0.5 + 0.9) / 5, abs=1e-5)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["dual_clip_frac"] == pytest.approx(1 / 5)


def test_policy_loss_masked_token_value_does_not_matter():
    def loss_with(garbage_logp, garbage_old):
        logp, old, adv, mask = _three_conversations(garbage_logp, garbage_old)
        ref, entropy = old - 0.1, torch.ones_like(old)
        ref[2, 1] = entropy[2, 1] = garbage_old
        loss, m = policy_loss(logp, old, adv, mask, ref, entropy=entropy, entropy_coef=0.1)
        return logp, loss, m

    _, base, _ = loss_with(30.0, -1e4)
    for g_logp, g_old in [(-50.0, 80.0), (float("nan"), float("inf")), (0.0, float("-inf"))]:
        logp, loss, m = loss_with(g_logp, g_old)
        loss.backward()
        assert loss.item() == pytest.approx(base.item(), abs=1e-6)
        assert torch.isfinite(logp.grad).all() and logp.grad[2, 1] == 0
        assert all(math.isfinite(v) for v in m.values())


def test_policy_loss_per_token_advantages_equal_one_per_conversation():
    logp, old, adv, mask = _three_conversations()
    a, _ = policy_loss(logp, old, adv, mask)
    b, _ = policy_loss(logp, old, adv[:, None].expand(3, 2).clone(), mask)
    assert torch.allclose(a, b)


def test_kl_k3_and_entropy_terms_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -3.0, -1.0]])
    ref = logp + torch.tensor([[math.log(2.0), 0.0, 5.0, -1.0]])  # ref - logp
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    kl = [2 - math.log(2) - 1, 0.0, 10.0, math.exp(-1)]  # exp(d) - d - 1; e^5 - 6 clamped to 10
    loss, m = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 4), ref,
                          kl_coef=0.1, entropy=entropy, entropy_coef=0.01)
    assert loss.item() == pytest.approx((0.1 * sum(kl) - 0.01 * 10) / 4, abs=1e-6)
    assert m["kl"] == pytest.approx(sum(kl) / 4, abs=1e-6)
    assert m["entropy"] == pytest.approx(2.5)


def test_on_policy_ratio_one_no_clipping_and_zero_kl_to_itself():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 9, generator=g) * 5
    mask = torch.rand(6, 9, generator=g) > 0.3
    loss, m = policy_loss(logp, logp.clone(), torch.randn(6, generator=g), mask, logp.clone())
    assert m["ratio"] == pytest.approx(1.0) and m["clip_frac"] == 0 and m["dual_clip_frac"] == 0
    assert m["kl"] == 0


# ---------------------------------------------------------------------------------------------
# 3. token_logprobs on a tiny Llama: exact against the naive full log-softmax
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).float().eval()


def _batch(left_padding: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, 12), generator=g)
    attention_mask = torch.ones_like(ids)
    if left_padding:
        attention_mask[0, :4], attention_mask[1, :1] = 0, 0
    return ids, attention_mask


def _naive(model, ids, attention_mask, temperature):
    """The reference: full float32 log-softmax over [B, L, V], then gather."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logq = torch.log_softmax(logits.float() / temperature, -1)[:, :-1]
    logp = logq.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logq.exp() * logq).sum(-1)
    return F.pad(logp, (1, 0)), F.pad(entropy, (1, 0))


def _grads(model, values):
    model.zero_grad()
    g = torch.Generator().manual_seed(2)
    sum((v * torch.randn(v.shape, generator=g)).sum() for v in values).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("left_padding", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_naive_gather(tiny_llama, left_padding, temperature):
    ids, attention_mask = _batch(left_padding)
    logp, entropy = token_logprobs(tiny_llama, ids, attention_mask, temperature, return_entropy=True)
    ref_logp, ref_entropy = _naive(tiny_llama, ids, attention_mask, temperature)
    assert logp.shape == ids.shape and logp.dtype == torch.float32
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(entropy, ref_entropy, atol=1e-5)
    for which in ([0], [1], [0, 1]):  # gradients through log-probs only, entropy only, both
        ours = token_logprobs(tiny_llama, ids, attention_mask, temperature, return_entropy=True)
        naive = _naive(tiny_llama, ids, attention_mask, temperature)
        for a, b in zip(_grads(tiny_llama, [ours[i] for i in which]), _grads(tiny_llama, [naive[i] for i in which])):
            assert torch.allclose(a, b, atol=1e-5)
    # only the response: same values from position 7 on, zeros before, one logit row fewer per token
    part = token_logprobs(tiny_llama, ids, attention_mask, temperature, response_start=7)
    assert torch.allclose(part[:, 7:], ref_logp[:, 7:], atol=1e-5) and (part[:, :7] == 0).all()


def test_token_logprobs_left_padding_matches_unpadded(tiny_llama):
    ids, attention_mask = _batch(left_padding=True)
    padded = token_logprobs(tiny_llama, ids, attention_mask)
    alone = token_logprobs(tiny_llama, ids[:1, 4:], attention_mask[:1, 4:])
    assert torch.allclose(padded[0, 5:], alone[0, 1:], atol=1e-5)


def test_second_backward_through_consumed_logits_fails_loudly(tiny_llama):
    ids, attention_mask = _batch(left_padding=False)
    logp = token_logprobs(tiny_llama, ids, attention_mask)  # backward reuses the logits' memory
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        logp.sum().backward()
    tiny_llama.zero_grad()


def test_token_logprobs_chunking_is_exact(tiny_llama, monkeypatch):
    import grpo

    ids, attention_mask = _batch(left_padding=True)
    whole = token_logprobs(tiny_llama, ids, attention_mask, return_entropy=True)
    monkeypatch.setattr(grpo, "CHUNK_ELEMENTS", 64 * 5)  # 5 rows per chunk, a ragged last chunk
    chunked = token_logprobs(tiny_llama, ids, attention_mask, return_entropy=True)
    for a, b in zip(whole, chunked):
        assert torch.allclose(a, b, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# 3b. A shared prefix encoded once equals the plain forward, values and gradients
# ---------------------------------------------------------------------------------------------
def _prefixed(prefix_len, lengths, seed=5):
    """Rows = one shared prefix + a suffix of each length; returns the plain left-padded batch and
    the suffixes alone, left-padded (the layout token_logprobs takes after a prefix)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 64, (prefix_len,), generator=g)
    suffixes = [torch.randint(0, 64, (n,), generator=g) for n in lengths]
    def left_pad(rows):
        width = max(map(len, rows))
        ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
        return ids, (torch.arange(width)[None] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    return prefix, left_pad([torch.cat([prefix, s]) for s in suffixes]), left_pad(suffixes)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("lengths", [(7, 11, 5), (9, 9, 9)])  # mixed lengths (left padding after the prefix), equal
@pytest.mark.parametrize("split", [None, 5])  # the prefix in one pass, or 3 tokens continued from the first 5 (`past`)
def test_shared_prefix_equals_plain_forward(tiny_llama, checkpointing, lengths, split):
    """Scored: each row's last 4 tokens (every row keeps a token of its own before them)."""
    from grpo import prefix_states

    model = copy.deepcopy(tiny_llama).train()
    if checkpointing:  # (newer transformers call it activation checkpointing)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prefix, (ids, mask), (suffix_ids, suffix_mask) = _prefixed(8, lengths)
    g = torch.Generator().manual_seed(6)
    weights = torch.randn(3, 4, generator=g)
    plain = token_logprobs(model, ids, mask, 0.7, response_start=ids.shape[1] - 4, return_entropy=True)
    grads = _grads(model, [plain[0][:, -4:] * weights, plain[1][:, -4:]])
    states = prefix_states(model, prefix) if split is None else \
        prefix_states(model, prefix[split:], past=prefix_states(model, prefix[:split]))
    assert [tuple(k.shape) for k, _ in states] == [tuple(k.shape) for k, _ in prefix_states(model, prefix)]
    shared = token_logprobs(model, suffix_ids, suffix_mask, 0.7, response_start=suffix_ids.shape[1] - 4,
                            return_entropy=True, prefix=states)
    assert (shared[0][:, :-4] == 0).all()
    for a, b in zip(plain, shared):
        torch.testing.assert_close(b[:, -4:], a[:, -4:], rtol=0, atol=1e-5)
    for a, b in zip(grads, _grads(model, [shared[0][:, -4:] * weights, shared[1][:, -4:]])):  # summed into one prefix
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_prefix_states_under_no_grad_serve_several_batches(tiny_llama):
    """One no-grad encoding of the prefix, reused by micro-batches of different sizes, as the old and
    reference passes do."""
    from grpo import prefix_states

    prefix, (ids, mask), (suffix_ids, suffix_mask) = _prefixed(10, (6, 8, 7))
    with torch.no_grad():
        plain = token_logprobs(tiny_llama, ids, mask, response_start=ids.shape[1] - 3)
        states = prefix_states(tiny_llama, prefix)
        for rows in ([0], [1, 2], [0, 1, 2]):
            sub_ids, sub_mask = suffix_ids[rows], suffix_mask[rows]
            keep = int(sub_mask.sum(0).gt(0).nonzero()[0])  # drop columns that are padding in every row
            out = token_logprobs(tiny_llama, sub_ids[:, keep:], sub_mask[:, keep:], response_start=sub_ids.shape[1] - keep - 3,
                                 prefix=states)
            torch.testing.assert_close(out[:, -3:], plain[rows, -3:], rtol=0, atol=1e-5)


def test_common_prefix_hand_values():
    from grpo import common_prefix

    assert common_prefix([[1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9]]) == 3
    assert common_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2  # one short of the shortest prompt
    assert common_prefix([[7, 2], [1, 2]]) == 0
    assert common_prefix([[1, 2, 3, 4]]) == 3


@pytest.mark.parametrize("micro_batch_size", [1, 2, 7])
def test_response_logprobs_with_shared_prefixes_equal_plain(tiny_llama, micro_batch_size):
    """A no-grad log-prob pass (the old and reference passes) over 7 conversations: a 6-token system
    prompt, two groups' turn-1 prompts (3 and 2 rows, 3 tokens more) and two memories. At
    micro-batch 1 the tokens are hand-counted: the system prompt once, each question once (a row
    keeps its prompt's last token), the rest per row."""
    import grpo

    system, rng = [11, 12, 13, 14, 15, 16], torch.Generator().manual_seed(3)
    prompts = [system + [21] * 3] * 3 + [system + [31] * 3] * 2 + [system + [41] * 5, system + [51] * 5]
    conversations = [SimpleNamespace(prompt_ids=p, response_ids=torch.randint(2, 64, (n,), generator=rng).tolist())
                     for p, n in zip(prompts, (4, 5, 6, 7, 8, 4, 5))]
    out = {}
    for shared in (False, True):
        counter = Counter()
        out[shared] = grpo.response_logprobs(tiny_llama, conversations, 0, "cpu", micro_batch_size, 0.8, shared, counter)
        out[shared, "tokens"] = counter["encoded_tokens"]
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    if micro_batch_size == 1:  # prompts 9 x 5 + 11 x 2, responses 4+5+6+7+8+4+5 = 39
        assert out[False, "tokens"] == 45 + 22 + 39
        assert out[True, "tokens"] == 6 + 2 * 2 + 5 * 1 + 2 * 5 + 39  # system, questions, rows' own prompt tokens
    assert out[True, "tokens"] < out[False, "tokens"]


# ---------------------------------------------------------------------------------------------
# 4. Micro-batches of 1 with num_tokens = one full batch
# ---------------------------------------------------------------------------------------------
def test_micro_batch_gradients_equal_full_batch(tiny_llama):
    model = copy.deepcopy(tiny_llama)
    g = torch.Generator().manual_seed(3)
    ids, attention_mask = torch.randint(0, 64, (4, 14), generator=g), torch.ones(4, 14, dtype=torch.long)
    attention_mask[0, :5], attention_mask[2, :2] = 0, 0
    loss_mask = torch.zeros(4, 14, dtype=torch.long)
    loss_mask[:, 8:] = 1
    loss_mask[1, 11:], loss_mask[3, 9:12] = 0, 0  # ragged responses and a masked tool response
    with torch.no_grad():
        old = token_logprobs(model, ids, attention_mask, response_start=8) + 0.3 * torch.randn(4, 14, generator=g)
        ref = old + 0.2 * torch.randn(4, 14, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.8, -1.2])
    kwargs = dict(kl_coef=0.01, entropy_coef=0.01)

    def loss_of(rows, num_tokens=None):
        logp, entropy = token_logprobs(model, ids[rows], attention_mask[rows], response_start=8, return_entropy=True)
        return policy_loss(logp, old[rows], adv[rows], loss_mask[rows], ref[rows],
                           entropy=entropy, num_tokens=num_tokens, **kwargs)[0]

    model.zero_grad()
    loss_of(slice(None)).backward()
    full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    n = loss_mask.sum()
    for i in range(4):
        loss_of(slice(i, i + 1), num_tokens=n).backward()
    for a, b in zip(full, (p.grad for p in model.parameters())):
        assert torch.allclose(a, b, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# 5. Learning: a tiny policy learns a 3-turn task with multi-context GRPO
# ---------------------------------------------------------------------------------------------
class TinyPolicy(torch.nn.Module):
    """A causal LM over 6 tokens that sees (previous token, current token): 2*6*16 + 16*6+6 = 294
    parameters. Speaks the Hugging Face forward interface that token_logprobs uses."""

    def __init__(self, vocab=6, hidden=16):
        super().__init__()
        self.cur, self.prev = torch.nn.Embedding(vocab, hidden), torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, **_):
        h = torch.tanh(self.cur(input_ids) + self.prev(F.pad(input_ids[:, :-1], (1, 0))))
        return SimpleNamespace(logits=self.head(h[:, -logits_to_keep:]))


TARGET = [3, 1, 4]  # the answer needs exactly this token at turns 1, 2, 3; token 0 ends early


def _rollout(policy, n_questions, G):
    """Each trajectory is up to 3 conversations. Conversation j's context is only (memory, j):
    the memory is the previous turn's token. Its response is one sampled token."""
    n = n_questions * G
    memory, alive = torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.bool)
    actions = torch.full((n, 3), -1)
    conversations, conv_traj = [], []
    with torch.no_grad():
        for j in range(3):
            idx = alive.nonzero().squeeze(-1)
            prompts = torch.stack([memory[idx], torch.full_like(idx, j)], 1)
            logits = policy(prompts).logits[:, -1]
            token = torch.multinomial(torch.softmax(logits, -1), 1).squeeze(-1)
            conversations.append(torch.cat([prompts, token[:, None]], 1))
            conv_traj.append(idx)
            actions[idx, j], memory[idx] = token, token
            alive[idx] = token != 0
    rewards = (actions == torch.tensor(TARGET)).all(1).float()
    group_ids = torch.arange(n_questions).repeat_interleave(G).tolist()
    return torch.cat(conversations), torch.cat(conv_traj), rewards, group_ids


def test_tiny_policy_learns_with_multi_context_grpo():
    torch.manual_seed(0)
    policy = TinyPolicy()
    reference = copy.deepcopy(policy).requires_grad_(False)
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.05)
    history = []
    for step in range(60):
        ids, conv_traj, rewards, group_ids = _rollout(policy, n_questions=32, G=8)
        history.append(rewards.mean().item())
        if step >= 3 and min(history[-3:]) > 0.9:
            break
        advantages = propagate_advantages(group_advantages(rewards, group_ids), conv_traj)
        attention_mask, loss_mask = torch.ones_like(ids), torch.tensor([0, 0, 1]).expand_as(ids)
        with torch.no_grad():
            old = token_logprobs(policy, ids, attention_mask, response_start=2)
            ref = token_logprobs(reference, ids, attention_mask, response_start=2)
        for rows in torch.randperm(len(ids)).chunk(2):  # two PPO mini-batches: ratios move off 1
            logp, entropy = token_logprobs(policy, ids[rows], attention_mask[rows],
                                           response_start=2, return_entropy=True)
            loss, metrics = policy_loss(logp, old[rows], advantages[rows], loss_mask[rows], ref[rows],
                                        entropy=entropy, entropy_coef=0.001)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    chance = (1 / 6) ** 3  # ~0.005
    assert history[0] < 10 * chance, history[:5]  # before any update: near chance
    assert min(history[-3:]) > 0.9, history
