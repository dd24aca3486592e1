"""agent.py: prompt, parsing, reward, batched rollouts of MemSearcher and ReAct, log-prob parity."""
import json

import pytest
import torch

import agent
from agent import Generation
from tools import kv_cache

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
    if prompt.endswith("<think>"):
        if "born in Osk" in prompt.split("<memory>")[-1]:
            return " The memory says Osk.</think>\n\\boxed{Osk}"
        return " I must look this up.</think>\n" + CALL
    return "<memory>Velmora Quint was born in Osk.</memory>"


def run(tokenizer, policy, questions=(Q,), finished=True, group_size=1, **settings):
    search = FakeSearch()
    trajectories = agent.rollout(None, tokenizer, list(questions), search, agent.RolloutSettings(**settings),
                                 group_size=group_size, generate_fn=scripted(policy, finished))
    return trajectories, search


EVAL = dict(evaluation=True, max_memory_tokens=None)  # the release's evaluation loop


# --- prompt --------------------------------------------------------------------------------------
def test_prompt_is_the_chat_template_plus_think(tokenizer):
    text = agent.memsearcher_prompt("Q?", "M.")
    messages = [{"role": "system", "content": agent.SYSTEM_PROMPT},
                {"role": "user", "content": "<question> Q? </question>\n\n<memory> M. </memory>"}]
    assert text == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + "<think>"
    assert "\\boxed{" in agent.SYSTEM_PROMPT and "<tool_call>\n{" in agent.SYSTEM_PROMPT
    schema = agent.SYSTEM_PROMPT.split("```json\n")[1].split("\n```")[0]  # a JSON list, pretty-printed, in a fence
    assert schema == json.dumps(agent.TOOL_SCHEMA, indent=4) and json.loads(schema)[0]["function"]["name"] == "wikipedia_search"
    assert '\n    {\n        "type": "function"' in schema and json.loads(schema)[0]["function"]["parameters"]["required"] == ["query"]


def test_prompt_files_replace_our_wording(tokenizer, tmp_path):
    (tmp_path / "system.txt").write_text("RELEASED SYSTEM PROMPT\n")
    (tmp_path / "memory.txt").write_text("RELEASED MEMORY INSTRUCTION")
    system = agent.read_prompt_file(str(tmp_path / "system.txt"), agent.SYSTEM_PROMPT)
    instruction = agent.read_prompt_file(str(tmp_path / "memory.txt"), agent.MEMORY_INSTRUCTION)
    assert agent.read_prompt_file(None, "ours") == "ours"
    (t,), _ = run(tokenizer, search_then_answer, system_prompt=system, memory_instruction=instruction)
    first = tokenizer.decode(t.conversations[0].prompt_ids + t.conversations[0].response_ids)
    assert first.startswith("<|im_start|>system\nRELEASED SYSTEM PROMPT<|im_end|>") and agent.SYSTEM_PROMPT not in first
    assert "</tool_response>\nRELEASED MEMORY INSTRUCTION<|im_end|>" in first and t.reward == 1.0
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        agent.read_prompt_file(str(tmp_path / "empty.txt"), "x")


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
    body = '{"name": "wikipedia_search", "arguments": {"query": "Velmora Quint"}}'
    tool_turn = ("\n<|im_start|>user\n<tool_response>" + body + '\nDoc 1(Title: "Velmora Quint") SECRET-DOC about '
                 "Velmora Quint and the town of Osk.\n</tool_response>\n" + agent.MEMORY_INSTRUCTION
                 + "<|im_end|>\n<|im_start|>assistant\n")
    assert runs == [(1, " I must look this up.</think>\n" + CALL + "<|im_end|>"),
                    (0, tool_turn),
                    (1, "<memory>Velmora Quint was born in Osk.</memory><|im_end|>")]
    assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if m == 0)
    assert all(lp == -1.0 for lp, m in zip(c.logprobs, c.loss_mask) if m == 1)


def test_memory_instruction_follows_each_tool_response(tokenizer):
    two_calls = " Two.</think>\n" + CALL + CALL.replace("Velmora Quint", "Osk")
    (t,), search = run(tokenizer, lambda p: two_calls if p.endswith("<think>") else "<memory>m</memory>", max_turns=1)
    text = tokenizer.decode(t.conversations[0].response_ids)
    assert search.calls == [(["Velmora Quint", "Osk"], [5, 5])]
    assert text.count("</tool_response>\n" + agent.MEMORY_INSTRUCTION) == 2
    assert text.count(agent.MEMORY_INSTRUCTION + "<tool_response>") == 1


def test_groups_share_question_id_and_searches_are_batched(tokenizer):
    q2 = {"id": "q2", "question": "Where is Osk?", "golden_answers": ["Tamberlay"]}
    trajectories, search = run(tokenizer, search_then_answer, questions=(Q, q2), group_size=3)
    assert [t.qid for t in trajectories] == ["q1"] * 3 + ["q2"] * 3
    assert len(search.calls) == 1 and len(search.calls[0][0]) == 6  # one retriever call per turn
    assert [t.reward for t in trajectories] == [1.0] * 3 + [0.1] * 3  # q2: well-formed, wrong


def test_top_n_reaches_search_and_is_clamped(tokenizer):
    call = '<tool_call>{"name": "wikipedia_search", "arguments": {"query": "a"%s}}</tool_call>'
    for given, default, used in [(', "top_n": 3', 5, 3), (', "top_n": 50', 5, agent.MAX_TOP_N), (', "top_n": 0', 5, 1),
                                 (', "top_n": "x"', 5, 5), ("", 5, 5), ("", 10, 10)]:  # paper preset: no top_n -> 10
        _, search = run(tokenizer, lambda p, g=given: "</think>" + call % g if p.endswith("<think>") else "<memory>m</memory>",
                        max_turns=1, default_top_n=default)
        assert search.calls[0][1] == [used]


# --- every malformed output has a defined outcome, as released -----------------------------------
PARSE_ERROR, BAD_QUERY = "Error: failed to parse the tool call", "Error: invalid query."


@pytest.mark.parametrize("output,tool_response", [
    ("</think>\n<tool_call>{not json}</tool_call>", PARSE_ERROR),
    ("</think>\n<tool_call>[1, 2]</tool_call>", PARSE_ERROR),
    ('</think>\n<tool_call>{"name": "wikipedia_search"}</tool_call>', PARSE_ERROR),
    ('</think>\n<tool_call>{"name": "wikipedia_search", "arguments": "Osk"}</tool_call>', PARSE_ERROR),
    ('</think>\n<tool_call>{"name": "wikipedia_search", "arguments": {"query": "  "}}</tool_call>', BAD_QUERY),
    ('</think>\n<tool_call>{"name": "wikipedia_search", "arguments": {"query": 7}}</tool_call>', BAD_QUERY),
    ('</think>\n<tool_call>{"arguments": {}}</tool_call>', BAD_QUERY),
    ('</think>\n<tool_call>{"name": "web_browse", "arguments": {"query": "x"}}</tool_call>', "SECRET-DOC about x"),  # name unchecked
])
def test_malformed_tool_calls_still_get_a_response_and_a_memory_update(tokenizer, output, tool_response):
    (t,), search = run(tokenizer, lambda p: output if p.endswith("<think>") else "<memory>m</memory>", max_turns=2)
    assert (t.end_reason, t.num_turns, t.num_searches, t.memory) == ("max_turns", 2, 2, "m")
    assert search.calls == ([(["x"], [5])] * 2 if "SECRET" in tool_response else [])
    first = tokenizer.decode(t.conversations[0].response_ids)
    assert tool_response in first and first.endswith("<memory>m</memory><|im_end|>") and t.reward == 0.0


@pytest.mark.parametrize("output,end_reason,prediction,reward", [
    ("no tags at all", "no_answer", None, 0.0),
    ('</think>\n<tool_call>{"name": "wikipedia_search", "arguments": {"query": "x"}}', "no_answer", None, 0.0),  # unclosed
    ('</think>\n</tool_call>{"name": "w", "arguments": {"query": "x"}}<tool_call>', "no_answer", None, 0.0),  # misordered
    ('</think>\n<tool_call><tool_call>{"name": "w", "arguments": {"query": "x"}}</tool_call></tool_call>', "no_answer", None, 0.0),
    ("</think>\n\\boxed{Osk", "no_answer", None, 0.0),
    ("</think>\n\\boxed{Osk} -- and some text after the answer", "answer", "Osk", 1.0),
    ("</think>\n\\boxed{\\text{Osk}}", "answer", "\\text{Osk}", 0.1),  # normalises to "textosk"
    ("</think>\n\\boxed{Paris}", "answer", "Paris", 0.1),
    ("</think>\nso $\\boxed Osk$.", "answer", "Osk", 1.0),  # the `\boxed answer` form
    ("no closing think \\boxed{Osk}", "answer", "Osk", 0.0),
    ("</think>\n<think></think>\\boxed{Osk}", "answer", "Osk", 1.0),
    ("</think>\n</think>\\boxed{Osk}", "answer", "Osk", 0.0),
])
def test_first_generation_without_a_tool_call_ends_the_trajectory(tokenizer, output, end_reason, prediction, reward):
    (t,), search = run(tokenizer, lambda p: output)
    assert (t.end_reason, t.prediction, t.num_turns, search.calls) == (end_reason, prediction, 1, [])
    assert t.reward == pytest.approx(reward)


def test_generation_cut_at_token_limit(tokenizer):
    (t,), _ = run(tokenizer, lambda p: "</think>\n\\boxed{Osk}", finished=False)
    assert (t.end_reason, t.reward) == ("length", 0.0)
    policy = lambda p: "</think>\n" + CALL if p.endswith("<think>") else "<memory>x</memory>"  # noqa: E731
    (t,), search = run(tokenizer, policy, finished=False)
    assert (t.end_reason, t.num_searches, search.calls) == ("length", 0, [])  # training: its calls never run
    (t,), search = run(tokenizer, policy, finished=False, max_turns=2, **EVAL)
    assert (t.end_reason, t.num_searches, t.memory) == ("max_turns", 2, "x")  # evaluation: they do, and it goes on


def test_illegal_stop_at_im_start_ends_the_trajectory(tokenizer):
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start in agent.stop_token_ids(tokenizer) and im_start not in agent.end_of_turn_ids(tokenizer)

    def generate_fn(model, tok, prompts, **kw):  # answers, but stops at <|im_start|> instead of <|im_end|>
        ids = agent.encode(tok, " ok</think>\n\\boxed{Osk}") + [im_start]
        return [Generation(ids=ids, logprobs=[-1.0] * len(ids), finished=True) for _ in prompts]

    (t,) = agent.rollout(None, tokenizer, [Q], FakeSearch(), agent.RolloutSettings(), generate_fn=generate_fn)
    c = t.conversations[0]
    assert (t.end_reason, t.reward) == ("illegal_stop", 0.0)  # not ended by the end-of-turn token
    assert c.response_ids[-1] == im_start and c.loss_mask[-1] == 1  # kept, and trained
    # (evaluation does not stop there: tests/test_agent.py::test_evaluation_generates_as_the_release_calls_sglang)


@pytest.mark.parametrize("update,train_end,eval_memory", [
    ("no tags, just prose", "invalid_memory", ""),
    ("<memory>never closed", "invalid_memory", ""),
    ("<memory>outer <memory>inner</memory></memory>", "invalid_memory", ""),
    ("<memory>a</memory> and </memory>", "invalid_memory", ""),  # unbalanced anywhere
    ("</memory>x<memory>a</memory>", "invalid_memory", ""),  # misordered
    ("<memory>  </memory>", "empty_memory", ""),  # empty: ends a training trajectory
    ("<memory> Osk facts </memory> trailing words", "max_turns", "Osk facts"),
    ("<memory> first </memory> then <memory>second</memory>", "max_turns", "first"),
])
def test_memory_update_outcomes(tokenizer, update, train_end, eval_memory):
    policy = lambda p: "</think>\n" + CALL if p.endswith("<think>") else update  # noqa: E731
    (t,), _ = run(tokenizer, policy, max_turns=2)
    assert t.end_reason == train_end and t.reward == 0.0
    (t,), _ = run(tokenizer, policy, max_turns=2, **EVAL)
    assert (t.end_reason, t.memory, t.num_turns) == ("max_turns", eval_memory, 2)  # evaluation goes on
    assert f"<memory> {eval_memory} </memory>" in tokenizer.decode(t.conversations[1].prompt_ids)


def test_memory_cap_in_training_not_in_evaluation(tokenizer):
    policy = lambda p: "</think>\n" + CALL if p.endswith("<think>") else "<memory>" + "Osk " * 20 + "</memory>"  # noqa: E731
    (t,), _ = run(tokenizer, policy, max_turns=3, max_memory_tokens=10)
    assert (t.end_reason, t.num_turns, t.memory) == ("memory_overflow", 1, "")
    (t,), _ = run(tokenizer, policy, max_turns=2, **EVAL)
    assert t.memory == ("Osk " * 20).strip()  # no cap by default
    (t,), _ = run(tokenizer, policy, max_turns=2, evaluation=True, max_memory_tokens=10)
    assert t.memory == ""  # a cap set by flag resets an oversized memory


def test_evaluation_answer_ignores_boxed_inside_think(tokenizer):
    output = " maybe \\boxed{Vey}? No.</think>\n\\boxed{Osk} <think>or \\boxed{Tamberlay}</think>"
    (t,), _ = run(tokenizer, lambda p: output, **EVAL)
    assert t.prediction == "Osk"  # last boxed after removing <think>...</think>
    (t,), _ = run(tokenizer, lambda p: output)
    assert t.prediction == "Tamberlay"  # training reads the last boxed of the message as it is


def test_bad_arguments_are_errors(tokenizer):
    with pytest.raises(ValueError, match="agent"):
        run(tokenizer, search_then_answer, agent="toolformer")


# --- context: bounded for MemSearcher, growing for ReAct -----------------------------------------
def always_search(prompt):
    if prompt.endswith("<think>"):
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
    (r,), _ = run(tokenizer, lambda p: "</think>\n" + CALL, agent="react", max_turns=10, max_response_tokens=300)
    assert r.end_reason == "context_overflow" and r.reward == 0.0
    assert len(r.conversations[0].response_ids) == len(r.conversations[0].loss_mask) == 300  # truncated to the budget


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


@pytest.mark.parametrize("temperature,strength", [(1.0, 0.075), (0.7, 0.06)])
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
        if all(tok.decode(p).endswith("<think>") for p in prompts):
            return scripted(lambda p: "</think>\n" + CALL)(model, tok, prompts)
        return agent.generate(model, tok, prompts, **kw)

    trajectories = agent.rollout(tiny_lm, tokenizer, [Q], FakeSearch(),
                                 agent.RolloutSettings(max_turns=1, max_new_tokens=16, temperature=0.8), group_size=3,
                                 generate_fn=gen_fn)
    convs = [t.conversations[0] for t in trajectories]
    for c, forward in zip(convs, model_logprobs(tiny_lm, convs, 0.8)):
        gen2 = [i for i in range(len(c.loss_mask)) if c.loss_mask[i] and i > c.loss_mask.index(0)]
        assert len(gen2) > 0
        assert max(abs(c.logprobs[i] - forward[i]) for i in gen2) < 1e-4


def test_greedy_rollout_with_real_model_is_deterministic(tiny_lm, tokenizer):
    kw = dict(greedy=True, max_turns=2, max_new_tokens=8, **EVAL)
    a = agent.rollout(tiny_lm, tokenizer, [Q], FakeSearch(), agent.RolloutSettings(**kw))
    b = agent.rollout(tiny_lm, tokenizer, [Q], FakeSearch(), agent.RolloutSettings(**kw))
    assert a[0].conversations[0].response_ids == b[0].conversations[0].response_ids
    assert a[0].end_reason in ("length", "no_answer", "answer", "illegal_stop", "max_turns")


# --- prefilling nothing twice: CachedGenerate equals the stateless generate ------------------------
ON_DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])


@ON_DEVICES
def test_cached_generate_equals_generate_across_a_tool_response(tiny_lm, tokenizer, device):
    """Call 1 (rows ending at different lengths: pad slots in the middle of the cache) starts from the
    prompts' shared prefix; call 2 continues each row after tool responses of different lengths and
    prefills only those. Greedy tokens equal the stateless generate's; recorded log-probs within 1e-4."""
    model = eager_end_lm(tiny_lm, tokenizer, 0.02).to(device)  # greedy: rows end after 6 tokens and at the limit
    prompts = [agent.encode(tokenizer, agent.memsearcher_prompt(q, m)) for q, m in PARITY_PROMPTS]
    cached = agent.CachedGenerate()
    kw = dict(max_new_tokens=24, greedy=True)
    first = cached(model, tokenizer, prompts, **kw)
    system = len(agent.encode(tokenizer, agent.chatml("system", agent.SYSTEM_PROMPT)))
    assert len(cached.prefix_ids) >= system  # the shared prefix: at least the system prompt, prefilled once
    assert cached.prefilled < sum(map(len, prompts)) - system
    reference = agent.generate(model, tokenizer, prompts, **kw)
    assert len({len(o.ids) for o in first}) > 1 and {o.finished for o in first} == {True, False}
    tools = [[], ["a short result"], ["a much longer result " * 5, "and a second call"]]
    follow = [p + o.ids + agent.encode(tokenizer, agent.tool_response_turn([{"body": "{}"}] * len(t), t, agent.MEMORY_INSTRUCTION))
              for p, o, t in zip(prompts, first, tools)]
    before = cached.prefilled
    second = cached(model, tokenizer, follow[::-1], **kw)[::-1]  # rows may come back in any order
    new_tokens = [len(f) - len(p) - len(o.ids) for f, p, o in zip(follow, prompts, first)]
    widest = max(len(p) + len(o.ids) for p, o in zip(prompts, first))  # the longest row, pads squeezed out
    assert cached.cache.get_seq_length() < widest + max(new_tokens) + 24
    assert cached.prefilled - before <= len(follow) * (max(new_tokens) + 1)
    for ours, theirs in ((first, reference), (second, agent.generate(model, tokenizer, follow, **kw))):
        for a, b in zip(ours, theirs):
            assert a.ids == b.ids and a.finished == b.finished
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_a_fresh_batch_frees_the_previous_cache_first(tiny_lm, tokenizer, monkeypatch):
    """A call that continues no row of the previous one starts a fresh batch: the previous call's KV
    cache is let go before the new one is built, so two caches are never held at once."""
    cached, held, generate = agent.CachedGenerate(), [], agent._generate

    def recording(*args, **kwargs):
        held.append(cached.cache is not None)
        return generate(*args, **kwargs)
    monkeypatch.setattr(agent, "_generate", recording)
    prompts = [agent.encode(tokenizer, agent.memsearcher_prompt(q, m)) for q, m in PARITY_PROMPTS]
    first = cached(tiny_lm, tokenizer, prompts[:2], max_new_tokens=4, greedy=True)
    cached(tiny_lm, tokenizer, [p + o.ids + agent.encode(tokenizer, "\n<|im_start|>user\nmore") for p, o in zip(prompts, first)],
           max_new_tokens=4, greedy=True)  # continues both rows: their cache is kept
    cached(tiny_lm, tokenizer, prompts[2:], max_new_tokens=4, greedy=True)  # a fresh batch
    assert held == [False, True, False]


def test_the_cache_written_in_place_equals_transformers_own(tiny_lm, tokenizer, monkeypatch):
    """tools/kv_cache.room_for (keys and values written in place into room made in advance) against
    transformers' DynamicCache (a concatenation a step, `room_for` made a no-op): the same greedy
    tokens and the same recorded log-probs, exactly, statelessly and across CachedGenerate's shared
    prefix and continuation after a tool response."""
    model = eager_end_lm(tiny_lm, tokenizer, 0.02)  # rows end at different lengths
    prompts = [agent.encode(tokenizer, agent.memsearcher_prompt(q, m)) for q, m in PARITY_PROMPTS]
    kw = dict(max_new_tokens=24, greedy=True)

    def rollout_calls():
        cached = agent.CachedGenerate()
        first = cached(model, tokenizer, prompts, **kw)
        follow = [p + o.ids + agent.encode(tokenizer, agent.tool_response_turn([{"body": "{}"}], ["a result"], None))
                  for p, o in zip(prompts, first)]
        return agent.generate(model, tokenizer, prompts, **kw) + first + cached(model, tokenizer, follow, **kw), cached

    ours, cached = rollout_calls()
    assert {type(layer) for layer in cached.cache.layers} == {kv_cache.GrowingLayer}
    monkeypatch.setattr(kv_cache, "room_for", lambda cache, model, tokens: cache)  # the plain path
    theirs, plain = rollout_calls()
    assert {type(layer).__name__ for layer in plain.cache.layers} == {"DynamicLayer"}
    assert [(o.ids, o.logprobs, o.finished) for o in ours] == [(o.ids, o.logprobs, o.finished) for o in theirs]


def test_compact_cache_by_hand():
    """Two rows, five cached columns; row 0 has real tokens at 1, 3 (a left pad, a hole), row 1 at
    0, 2, 4. The cache keeps 3 columns: row 0 -> [pad, 1, 3], row 1 -> [0, 2, 4], in order."""
    from transformers import DynamicCache

    cache = DynamicCache()
    keys = torch.arange(2 * 5, dtype=torch.float32).view(2, 1, 5, 1).expand(2, 2, 5, 3).contiguous()
    cache.update(keys, -keys, 0)
    mask = torch.tensor([[0, 1, 0, 1, 0], [1, 0, 1, 0, 1]])
    keep = agent.compact_cache(cache, mask)
    assert keep[0, 1:].tolist() == [1, 3] and keep[1].tolist() == [0, 2, 4]
    assert mask.gather(1, keep).tolist() == [[0, 1, 1], [1, 1, 1]]
    layer = cache.layers[0]
    assert cache.get_seq_length() == 3 and layer.keys.shape == (2, 2, 3, 3)
    assert layer.keys[0, 1, 1:, 2].tolist() == [1.0, 3.0] and layer.keys[1, 0, :, 0].tolist() == [5.0, 7.0, 9.0]
    assert torch.equal(layer.values, -layer.keys)


def forcing_tool_call(monkeypatch, tokenizer, forced_calls):
    """Make generate calls number `forced_calls` (0-based) emit a search call in every row (a
    processor that leaves one token possible), so that a random model's next call continues after a
    real tool response."""
    script = agent.encode(tokenizer, " I must look this up.</think>\n" + CALL + "<|im_end|>")
    original, calls = agent.make_recorder, [0]

    def make_recorder(temperature):
        recorder, k, steps = original(temperature), calls[0], [0]
        calls[0] += 1
        if k not in forced_calls:
            return recorder

        def forced(input_ids, scores):
            forced_scores = torch.full_like(scores, -1e4)
            forced_scores[:, script[min(steps[0], len(script) - 1)]] = 0.0
            steps[0] += 1
            return recorder(input_ids, forced_scores)
        forced.score = recorder.score
        forced.logprobs = recorder.logprobs
        return forced
    monkeypatch.setattr(agent, "make_recorder", make_recorder)
    return calls


@ON_DEVICES
@pytest.mark.parametrize("agent_name", ["memsearcher", "react"])
def test_rollout_with_cached_generate_equals_stateless(tiny_lm, tokenizer, monkeypatch, agent_name, device):
    """A whole rollout (2 turns, a forced search in turn 1, the random model everywhere else) with the
    default CachedGenerate equals one with the stateless generate: tokens, masks, log-probs."""
    import copy
    tiny_lm = copy.deepcopy(tiny_lm).to(device) if device != "cpu" else tiny_lm
    questions = [Q, {"id": "q2", "question": "Which river flows through the town of Osk?", "golden_answers": ["x"]}]
    plain_prefill = []  # the stateless generate prefills every prompt whole, left-padded to the longest

    def plain(model, tok, prompts, **sampling):
        plain_prefill.append(len(prompts) * max(map(len, prompts)))
        return agent.generate(model, tok, prompts, **sampling)

    cached = agent.CachedGenerate()
    settings = agent.RolloutSettings(agent=agent_name, max_turns=2, max_new_tokens=64, greedy=True, **EVAL)
    runs = []
    for generate_fn in (plain, cached):
        calls = forcing_tool_call(monkeypatch, tokenizer, {0})
        runs.append(agent.rollout(tiny_lm, tokenizer, questions, FakeSearch(), settings, group_size=2, generate_fn=generate_fn))
        assert calls[0] >= 2
    prefilled = [sum(plain_prefill), cached.prefilled]
    system = len(agent.encode(tokenizer, agent.chatml("system", agent.SYSTEM_PROMPT)))
    assert prefilled[1] < prefilled[0] - 3 * system  # turn 2 continued, not re-prefilled; the prompt prefix once
    for a, b in zip(*runs):
        assert a.num_searches == b.num_searches == 1 and len(a.conversations) == len(b.conversations)
        for x, y in zip(a.conversations, b.conversations):
            assert (x.prompt_ids, x.response_ids, x.loss_mask) == (y.prompt_ids, y.response_ids, y.loss_mask)
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-4


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


# The released reward on edge cases (docs/design.md, "Reward"). Each case is a list of assistant messages after the
# prefilled "<think>" of the first; the tool turn between messages is masked text the check ignores.
GOOD_CALL = '<tool_call>{"name": "wikipedia_search", "arguments": {"query": "x"}}</tool_call>'
REWARD_CASES = [
    (["a</think>\\boxed{Osk}"], ["Osk"], 1.0),
    (["a</think>\\boxed Osk"], ["Osk"], 1.0),  # `\boxed answer`, no braces
    (["a</think>$\\boxed Osk town$ and more"], ["Osk"], 2 / 3),  # up to the `$`
    (["a</think>\\boxed Vey then \\boxed{Osk}"], ["Osk"], 0.1),  # `\boxed ` wins: "vey then boxedosk", F1 0
    (["a</think>\\boxed{a{b}c} \\boxed{Osk}"], ["Osk"], 1.0),  # the last one, braces matched
    (["a</think>\\boxed{Osk"], ["Osk"], 0.0),  # never closed: no answer
    (["a</think>\\boxed{}"], ["Osk"], 0.1),  # well-formed, F1 0
    (["a</think>\\fbox{Osk}"], ["Osk"], 0.0),  # "\fbox" does not contain "\box"
    (["a</think>\\boxedOsk"], ["Osk"], 0.0),  # contains "\box", but no boxed expression
    (["a</think>\\boxed{yes}"], ["Yes"], 1.0),
    (["a</think>\\boxed{yes sir}"], ["yes"], 0.1),  # yes/no only score when equal
    (["a</think>\\boxed{no}"], ["yes"], 0.1),
    (["a</think><think>b</think>\\boxed{Osk}"], ["Osk"], 1.0),
    (["a</think></think>\\boxed{Osk}"], ["Osk"], 0.0),  # unequal think counts
    (["a\\boxed{Osk}"], ["Osk"], 0.0),  # the prefilled <think> never closed
    (["a</think>" + GOOD_CALL, "<memory>m</memory>", " b</think>\\boxed{Osk}"], ["Osk"], 0.0),  # last message: </think> without <think>
    (["a</think>" + GOOD_CALL, "<memory>m</memory> \\boxed{Osk}"], ["Osk"], 1.0),  # last message boxes: it counts
    (["a</think>" + GOOD_CALL, "<think>m</think>\\boxed{Osk}"], ["Osk"], 1.0),
    (["a</think>" + GOOD_CALL, "<think>m\\boxed{Osk}"], ["Osk"], 0.0),  # unpaired think in a later message
    (["a</think><tool_call>{not json}</tool_call>", "\\boxed{Osk}"], ["Osk"], 0.0),  # first message: JSON checked
    (['a</think><tool_call>{"name": "w"}</tool_call>', "\\boxed{Osk}"], ["Osk"], 0.0),  # no "arguments"
    (["a</think>" + GOOD_CALL, "<tool_call>{not json}</tool_call>\\boxed{Osk}"], ["Osk"], 1.0),  # later: only paired
    (["a</think>" + GOOD_CALL, "<tool_call>{not json}\\boxed{Osk}"], ["Osk"], 0.0),  # unpaired in a later message
]


def reward_case_text(messages):
    """A ReAct-style multi-message conversation: the messages joined by masked user turns."""
    text = agent.react_prompt("Q")
    for k, m in enumerate(messages):
        text += m + "<|im_end|>"
        if k < len(messages) - 1:
            text += "\n<|im_start|>user\n<tool_response>docs</tool_response><|im_end|>\n" + agent.ASSISTANT_HEADER
    return text


@pytest.mark.parametrize("messages,golds,expected", REWARD_CASES)
def test_released_reward_on_edge_cases(messages, golds, expected):
    assert agent.compute_reward(reward_case_text(messages), True, golds) == pytest.approx(expected)


def test_extractors():
    assert agent.extract_boxed("a \\boxed{1} b \\boxed{x{y}z} c") == "x{y}z"
    assert agent.extract_boxed("\\boxed{open") is None and agent.extract_boxed("none") is None
    assert agent.extract_boxed("$\\boxed 42$") == "42" and agent.extract_boxed("\\boxed{1} \\boxed 2") == "2"
    assert agent.extract_memory("<memory> a </memory><memory>b</memory>") == "a"
    assert agent.extract_memory("<memory>a</memory></memory>") is None and agent.extract_memory("none") is None
    calls = agent.parse_tool_calls(CALL + CALL.replace("Velmora Quint", "Osk"))
    assert [c["query"] for c in calls] == ["Velmora Quint", "Osk"] and all(c["error"] is None for c in calls)
    assert agent.parse_tool_calls("</tool_call>" + CALL) == []  # misordered: no call at all


# --- evaluation as the release's client runs it (SGLang /generate, its tool calls) ------------------
def test_evaluation_generates_as_the_release_calls_sglang(tokenizer):
    """In evaluation a generation stops at the model's generation-config eos ids only (SGLang), not at
    <|im_start|>; the client writes <|im_end|> after every response: after a cut one (whose tool call
    still runs), and in place of another eos that ended one. Training stops at <|im_start|> too."""
    from types import SimpleNamespace

    im_end, im_start = (tokenizer.convert_tokens_to_ids(x) for x in ("<|im_end|>", "<|im_start|>"))
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[im_end, eos]))  # Qwen2.5's two
    stops = []

    def generate_fn(model, tok, prompts, **sampling):
        stops.append(sampling.get("stop_ids"))
        outs = []
        for p in prompts:
            if tok.decode(p).endswith("<think>"):  # turn 1: a search cut by the token limit (no end of turn)
                ids = agent.encode(tok, " look it up</think>\n" + CALL)
                outs.append(Generation(ids=ids, logprobs=[-1.0] * len(ids), finished=False))
            else:  # the memory update, ended by the other eos id
                ids = agent.encode(tok, "<memory>Velmora Quint was born in Osk.</memory>") + [eos]
                outs.append(Generation(ids=ids, logprobs=[-1.0] * len(ids), finished=True))
        return outs

    (t,) = agent.rollout(model, tokenizer, [Q], FakeSearch(), agent.RolloutSettings(max_turns=1, **EVAL),
                         generate_fn=generate_fn)
    assert stops == [[eos, im_end]] * 2 and im_start not in stops[0]
    text = tokenizer.decode(t.conversations[0].response_ids)
    assert CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>" in text  # <|im_end|> after the cut response
    assert text.endswith("born in Osk.</memory><|im_end|>") and "<|endoftext|>" not in text
    assert t.num_searches == 1 and t.end_reason == "max_turns"
    agent.rollout(model, tokenizer, [Q], FakeSearch(), agent.RolloutSettings(max_turns=1), generate_fn=generate_fn)
    assert stops[-1] is None and im_start in agent.stop_token_ids(tokenizer)  # training: the default stop set


def test_evaluation_at_the_turn_limit_after_a_search_predicts_nothing(tokenizer):
    """The release's client reads the prediction from its last text, which after a memory update is a
    fresh prompt: at the turn limit right after a search it predicts nothing, even when the memory
    update wrote a boxed answer. Training reads that update's last boxed answer as before."""
    def policy(prompt):
        if prompt.endswith("<think>"):
            return " Search.</think>\n" + CALL
        return "<memory>Osk</memory> \\boxed{Osk}"

    (evaluated,), _ = run(tokenizer, policy, max_turns=1, **EVAL)
    (trained,), _ = run(tokenizer, policy, max_turns=1)
    assert evaluated.end_reason == trained.end_reason == "max_turns"
    assert evaluated.prediction is None and trained.prediction == "Osk"


def test_top_n_default_and_cap():
    """A call without top_n gets the default (evaluation: 10, the release's server), and one asking
    for more than the cap gets the cap (training: 10); no cap (None, evaluation as released) passes it."""
    call = '<tool_call>{"name": "wikipedia_search", "arguments": {"query": "x"%s}}</tool_call>'
    assert [c["top_n"] for c in agent.parse_tool_calls(call % "", 10, None)] == [10]
    assert [c["top_n"] for c in agent.parse_tool_calls(call % ', "top_n": 20', 10, None)] == [20]
    assert [c["top_n"] for c in agent.parse_tool_calls(call % ', "top_n": 20', 5)] == [10]
    assert [c["top_n"] for c in agent.parse_tool_calls(call % ', "top_n": 0', 5)] == [1]
