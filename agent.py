"""MemSearcher agent: its prompt, one turn, the reward, and batched multi-turn rollouts.

1. the prompt (system, user, tool response)     2. parsing model output     3. reward and metrics
4. what a rollout returns (Conversation, Trajectory) and its settings
5. batched generation with recorded log-probs     6. rollouts: MemSearcher and the ReAct baseline
7. speedup (exact): CachedGenerate, generation that prefills nothing twice within a rollout

The policy itself comes from tools/models.py (`models.load`: the embedded default, a hub name or
folder, a train.py run folder, a LoRA checkpoint); this file takes it as an argument.

`search` is any callable `search(queries, topk_list) -> list of rendered document strings`
(e.g. a `retriever.Retriever`), so this file imports no retriever. To watch one trajectory:
`python tools/trajectory.py "a question"`.
"""
from __future__ import annotations

import copy
import json
import re
import string
from collections import Counter
from dataclasses import dataclass, field

import torch

import grpo  # the common-prefix scan, shared with the log-prob passes
from tools import kv_cache  # speedup (exact): the KV cache written in place

# ---------------------------------------------------------------------------------------------
# 1. The prompt: ChatML, as Qwen2.5 and SmolLM2 render it; the structure follows the paper
# ---------------------------------------------------------------------------------------------
TOOL_NAME = "wikipedia_search"
TOOL_SCHEMA = [{"type": "function", "function": {  # shown as the release shows it: a JSON list, 4-space indent
    "name": TOOL_NAME, "description": "Search Wikipedia for a given query.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "description": "Query to search for."},
        "top_n": {"type": "integer", "description": "Number of top results to return.", "default": 5}},
        "required": ["query"]}}}]
DEFAULT_TOP_N, MAX_TOP_N = 5, 10  # passages when a call gives no top_n (the release's server: 10); our cap

SYSTEM_PROMPT = f"""You answer a complex question through iterative reasoning, tool calls and memory updates.

You may call this tool:
```json
{json.dumps(TOOL_SCHEMA, indent=4)}
```

Each turn you see the question and your memory. Reason inside <think> </think>, then do one of two things:
1. If the memory already holds the answer, give it inside \\boxed{{}} and call no tool, for example:
<think> The memory says the river is 381 kilometres long. </think>
\\boxed{{381 kilometres}}
2. Otherwise call the tool:
<tool_call>
{{"name": "{TOOL_NAME}", "arguments": {{"query": "...", "top_n": 5}}}}
</tool_call>
You will then read the results and update your memory, keeping every relevant detail of the old memory."""

MEMORY_INSTRUCTION = ("Read the tool response carefully and update the memory with the new information that helps "
                      "to answer the question, while keeping every relevant detail of the previous memory. "
                      "Return the updated memory inside <memory> </memory> tags.")

# The ReAct baseline: same tool and answer format, one growing context, no memory.
REACT_SYSTEM_PROMPT = f"""You answer a complex question through iterative reasoning and tool calls.

You may call this tool:
```json
{json.dumps(TOOL_SCHEMA, indent=4)}
```

Reason inside <think> </think>. When you know the answer, give it inside \\boxed{{}}. Otherwise call the tool:
<tool_call>
{{"name": "{TOOL_NAME}", "arguments": {{"query": "...", "top_n": 5}}}}
</tool_call>
The results will appear below and you continue from there."""

END_OF_TURN = "<|im_end|>"
START_OF_TURN = "<|im_start|>"  # sampling it is an illegal stop: the trajectory ends (tokens kept, trained)
ASSISTANT_HEADER = START_OF_TURN + "assistant\n"
THINK = "<think>"  # the generation prefix, prefilled after the assistant header (no newline, as released)


def chatml(role: str, content: str) -> str:
    return f"{START_OF_TURN}{role}\n{content}{END_OF_TURN}\n"


def read_prompt_file(path: str | None, default: str) -> str:
    """A prompt text from a file (e.g. the release's own wording, to evaluate released checkpoints)."""
    if not path:
        return default
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text:
        raise ValueError(f"{path}: the prompt file is empty")
    return text


def read_prompts(agent: str = "memsearcher", system_prompt: str | None = None,
                 memory_instruction: str | None = None) -> dict:
    """A run's prompt texts, `RolloutSettings`' fields: ours, or each read from the file named."""
    default = REACT_SYSTEM_PROMPT if agent == "react" else SYSTEM_PROMPT
    return {"system_prompt": read_prompt_file(system_prompt, default),
            "memory_instruction": read_prompt_file(memory_instruction, MEMORY_INSTRUCTION)}


def memsearcher_prompt(question: str, memory: str, system_prompt: str = SYSTEM_PROMPT) -> str:
    """Turn i's whole context: system + user(question, memory) + assistant header + `<think>`."""
    user = f"<question> {question} </question>\n\n<memory> {memory} </memory>"
    return chatml("system", system_prompt) + chatml("user", user) + ASSISTANT_HEADER + THINK


def react_prompt(question: str, system_prompt: str = REACT_SYSTEM_PROMPT) -> str:
    return chatml("system", system_prompt) + chatml("user", f"<question> {question} </question>") + ASSISTANT_HEADER + THINK


def tool_response_turn(calls: list[dict], results: list[str], instruction: str | None) -> str:
    """The untrained turn appended after a generation that called tools (its `<|im_end|>` is
    already there): per call `<tool_response>{call body}\\n{results}\\n</tool_response>\\n` and the
    memory instruction (repeated after each call, as released), then a new assistant header."""
    body = "".join(f"<tool_response>{c['body']}\n{r}\n</tool_response>\n{instruction or ''}" for c, r in zip(calls, results))
    return "\n" + chatml("user", body.rstrip("\n")) + ASSISTANT_HEADER


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


# ---------------------------------------------------------------------------------------------
# 2. Parsing model output, as released: every well-tagged call runs, whatever its content
# ---------------------------------------------------------------------------------------------
def tags_in_order(text: str, tag: str) -> bool:
    """`<tag>` and `</tag>` alternate, opening first, and every one is closed."""
    marks = re.findall(f"<(/?){tag}>", text)
    return all(m == ("/" if k % 2 else "") for k, m in enumerate(marks)) and len(marks) % 2 == 0


def parse_tool_calls(text: str, default_top_n: int = DEFAULT_TOP_N, max_top_n: int | None = MAX_TOP_N,
                     tool_error=None) -> list[dict]:
    """Every `<tool_call>...</tool_call>` body -> {"body", "query", "top_n", "error"}; [] when the
    tags are unbalanced or misordered (then there is no tool call). A body that is not a JSON
    object, or has no non-empty string query, still gets a tool response: its error text. The tool
    name is not checked (as released); top_n falls back to `default_top_n` and is clamped to
    1..max_top_n (None: no cap). `tool_error(parsed JSON) -> text or None` replaces our checks and
    texts (evaluate.py's `release_tool_error`: the release's; its queries are then not stripped)."""
    if not tags_in_order(text, "tool_call"):
        return []
    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S):
        call = {"body": body.strip(), "query": None, "top_n": default_top_n, "error": None}
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError:
            parsed = None
        args = parsed.get("arguments") if isinstance(parsed, dict) else None
        if tool_error is not None:
            call["error"] = tool_error(parsed)
        elif not isinstance(args, dict):
            call["error"] = "Error: failed to parse the tool call (a JSON object with `name` and `arguments` is expected)."
        elif not isinstance(args.get("query"), str) or not args["query"].strip():
            call["error"] = "Error: invalid query."
        if call["error"] is None:
            top_n = args.get("top_n", default_top_n)
            top_n = max(default_top_n if isinstance(top_n, bool) or not isinstance(top_n, int) else top_n, 1)
            call.update(query=args["query"] if tool_error else args["query"].strip(),
                        top_n=top_n if max_top_n is None else min(top_n, max_top_n))
        calls.append(call)
    return calls


def extract_boxed(text: str) -> str | None:
    """The last boxed expression, as the released reward finds it: the `\\boxed answer` form (the
    text after the last `\\boxed ` up to a `$`) wins wherever it occurs; else the last `\\boxed{...}`,
    braces matched. None if neither (or the braces never close)."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0].strip()
    start = text.rfind("\\boxed")
    if start < 0 or not text.startswith("\\boxed{", start):
        return None
    depth = 0
    for j in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start + len("\\boxed{"):j].strip()
    return None


def remove_think(text: str) -> str:
    return re.sub(r"<think>.*?</think>", "", text, flags=re.S)


def extract_memory(text: str) -> str | None:
    """The first `<memory>...</memory>` span, stripped; None if the tags are unbalanced or misordered anywhere."""
    if not tags_in_order(text, "memory") or "<memory>" not in text:
        return None
    return re.search(r"<memory>(.*?)</memory>", text, re.S).group(1).strip()


# ---------------------------------------------------------------------------------------------
# 3. Reward (format-gated F1, as released) and evaluation metrics (SQuAD normalisation)
# ---------------------------------------------------------------------------------------------
def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def exact_match(prediction: str | None, golds: list[str]) -> float:
    return float(prediction is not None and any(normalize_answer(prediction) == normalize_answer(g) for g in golds))


def f1_score(prediction: str | None, golds: list[str]) -> float:
    """Token F1 = 2PR/(P+R), max over gold answers; yes/no/noanswer score only when equal."""
    if prediction is None:
        return 0.0
    best, pred = 0.0, normalize_answer(prediction)
    for gold in map(normalize_answer, golds):
        if (pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer")) and pred != gold:
            continue
        common = sum((Counter(pred.split()) & Counter(gold.split())).values())
        if common:
            p, r = common / len(pred.split()), common / len(gold.split())
            best = max(best, 2 * p * r / (p + r))
    return best


def assistant_messages(text: str) -> list[str]:
    """The assistant messages of a decoded ChatML conversation (prefilled `<think>` included), stripped."""
    return [part.split(END_OF_TURN)[0].strip() for part in text.split(ASSISTANT_HEADER)[1:]]


def format_ok(messages: list[str]) -> bool:
    """As released: in every message as many <think> as </think> (the first has one) and paired
    <tool_call> tags; in the first message only, each call body contains `"name"` and `"arguments"`
    and parses as JSON; the last message contains `\\box`."""
    for k, m in enumerate(messages):
        if m.count("<think>") != m.count("</think>") or (k == 0 and "<think>" not in m):
            return False
        if m.count("<tool_call>") != m.count("</tool_call>"):
            return False
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", messages[0] if messages else "", re.S):
        if '"name"' not in body or '"arguments"' not in body:
            return False
        try:
            json.loads(body)
        except json.JSONDecodeError:
            return False
    return bool(messages) and "\\box" in messages[-1]


def compute_reward(final_conversation_text: str, ends_with_end_of_turn: bool, golds: list[str]) -> float:
    """0 unless the final conversation ends with the end-of-turn token and passes `format_ok`;
    else the F1 of the last boxed answer of the last message, with 0.1 for a well-formed F1 of 0."""
    messages = assistant_messages(final_conversation_text)
    if not ends_with_end_of_turn or not format_ok(messages):
        return 0.0
    prediction = extract_boxed(messages[-1])
    if prediction is None:
        return 0.0
    return f1_score(prediction, golds) or 0.1


# ---------------------------------------------------------------------------------------------
# 4. What a rollout returns
# ---------------------------------------------------------------------------------------------
@dataclass
class Conversation:
    """One LLM context = one training sample. `loss_mask[t]` is 1 exactly on tokens the policy
    sampled (each generation's end-of-turn token included), 0 on the tool-response turn and the
    assistant header; `logprobs[t]` is the log-prob recorded while sampling (0.0 where masked).
    The trainer fills the last three before an update: per response token, the log-probs of the
    policy that sampled (pi_old) and of the reference, and the trajectory's advantage (A_ij = A_i)."""
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    advantage: float = 0.0

    def append(self, ids: list[int], trained: bool, logprobs: list[float] | None = None):
        self.response_ids += ids
        self.loss_mask += [int(trained)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    def __len__(self) -> int:  # tokens in the LLM context
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class Trajectory:
    """One attempt at a question: several conversations (MemSearcher) or one (ReAct)."""
    qid: str  # the GRPO group key
    question: str
    golden_answers: list[str]
    conversations: list[Conversation] = field(default_factory=list)
    prediction: str | None = None
    reward: float = 0.0
    num_turns: int = 0
    num_searches: int = 0
    end_reason: str = ""  # answer | no_answer | illegal_stop | length | invalid_memory | empty_memory
    #                       | memory_overflow | context_overflow | max_turns
    context_tokens: list[int] = field(default_factory=list)  # tokens in the LLM context at each turn's end
    memory: str = ""
    turns: list[dict] = field(default_factory=list)  # readable log: generations, queries, documents, memory

    @property
    def done(self) -> bool:
        return bool(self.end_reason)


@dataclass
class RolloutSettings:
    """How `rollout` runs. The defaults are the paper's training rollout (5 turns, 512 new tokens,
    memory cap 1024, T = 1.0, top-p 0.99, top-k 10000); the release's evaluation loop is
    greedy=True, evaluation=True, max_turns=20, max_memory_tokens=None (evaluate.py's defaults)."""
    agent: str = "memsearcher"  # or "react": the baseline, one growing conversation
    max_turns: int = 5
    max_new_tokens: int = 512  # per generation
    max_memory_tokens: int | None = 1024  # a longer memory ends the trajectory (None: no cap)
    max_response_tokens: int = 8192  # a conversation's response part is cut here and the trajectory ends
    temperature: float = 1.0
    top_p: float = 0.99
    top_k: int = 10000
    greedy: bool = False
    evaluation: bool = False  # the release's evaluation loop: an unusable memory becomes empty, and so on
    default_top_n: int = DEFAULT_TOP_N  # passages for a tool call without top_n
    max_top_n: int | None = MAX_TOP_N  # the most a call may ask for (None: no cap, as released)
    tool_error: object = None  # f(parsed call) -> error text or None, replacing ours (parse_tool_calls)
    system_prompt: str | None = None  # None: ours (`read_prompts` reads the release's from files)
    memory_instruction: str | None = None


# ---------------------------------------------------------------------------------------------
# 5. Batched generation with HF `generate` (KV cache), recording each sampled token's log-prob
# ---------------------------------------------------------------------------------------------
@dataclass
class Generation:
    ids: list[int]  # sampled tokens up to and including the first stop token
    logprobs: list[float]  # log p(token) under softmax(raw logits / temperature)
    finished: bool  # ended with a stop token (False: hit max_new_tokens)


def end_of_turn_ids(tokenizer) -> list[int]:
    ids = {tokenizer.convert_tokens_to_ids(END_OF_TURN), tokenizer.eos_token_id}
    return sorted(i for i in ids if i is not None and i != tokenizer.unk_token_id)


def stop_token_ids(tokenizer) -> list[int]:
    """Generation stops at the end of turn, and also at `<|im_start|>` (an illegal stop, as released)."""
    start = tokenizer.convert_tokens_to_ids(START_OF_TURN)
    return sorted(set(end_of_turn_ids(tokenizer)) | ({start} if start not in (None, tokenizer.unk_token_id) else set()))


def eos_ids(model, tokenizer) -> list[int]:
    """Where the release's evaluation (SGLang) stops: the model's generation-config eos ids (Qwen2.5:
    `<|im_end|>`, `<|endoftext|>`) and the tokenizer's end of turn, never `<|im_start|>`."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return sorted({*([ids] if isinstance(ids, int) else ids or []), *end_of_turn_ids(tokenizer)})


def make_recorder(temperature: float):
    """A logits processor that sees the raw logits before any warper (HF applies custom processors
    before temperature/top-k/top-p) and records log p(sampled token) at temperature T. The token
    sampled at step t is only known at step t+1 (last column of input_ids), so each call scores the
    previous step, and the caller scores the last one with `score`."""
    from transformers import LogitsProcessor

    class RecordLogprobs(LogitsProcessor):
        def __init__(self):
            self.previous, self.logprobs = None, []

        def __call__(self, input_ids, scores):
            self.score(input_ids[:, -1])
            self.previous = torch.log_softmax(scores.float() / temperature, dim=-1)
            return scores

        def score(self, tokens):
            if self.previous is not None:
                self.logprobs.append(self.previous.gather(-1, tokens[:, None]).squeeze(-1))

    return RecordLogprobs()


def left_pad(rows: list[list[int]], pad: int, device):
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int = 512, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, greedy: bool = False, stop_ids=None) -> list[Generation]:
    """One left-padded `generate` call over all prompts (KV cache on, eval mode), every prompt prefilled whole."""
    if not prompts:
        return []
    ids, mask = left_pad(prompts, tokenizer.pad_token_id, model.device)
    return _generate(model, tokenizer, ids, mask, None, max_new_tokens=max_new_tokens, temperature=temperature,
                     top_p=top_p, top_k=top_k, greedy=greedy, stop_ids=stop_ids)[0]


def _generate(model, tokenizer, input_ids, attention_mask, cache, *, max_new_tokens=512, temperature=1.0, top_p=1.0, top_k=0,
              greedy=False, stop_ids=None):
    """HF `generate` from `input_ids` (the first `cache.get_seq_length()` of them already in `cache`);
    returns (generations, the full sequences [B, L + new], the cache of all but their last column)."""
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id
    width = input_ids.shape[1]
    temperature = 1.0 if greedy else temperature
    recorder = make_recorder(temperature)
    stop = stop_ids or stop_token_ids(tokenizer)
    warpers = {} if greedy else dict(temperature=temperature, top_p=top_p, top_k=top_k)
    config = GenerationConfig(  # explicit values, so no default from the model's config sneaks in
        max_new_tokens=max_new_tokens, do_sample=not greedy, repetition_penalty=1.0, num_beams=1,
        use_cache=True, eos_token_id=stop, pad_token_id=pad, return_dict_in_generate=True, **warpers)
    cache = kv_cache.room_for(cache, model, input_ids.shape[1] + max_new_tokens)  # speedup (exact): written in place
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                             logits_processor=[recorder], cache=cache)
    finally:
        model.train(was_training)
    new = out.sequences[:, width:]
    recorder.score(new[:, -1])
    logprobs = torch.stack(recorder.logprobs, dim=1).tolist() if recorder.logprobs else [[] for _ in input_ids]
    results = []
    for row, lp in zip(new.tolist(), logprobs):
        end = next((i for i, tok in enumerate(row) if tok in stop), None)
        n = len(row) if end is None else end + 1
        results.append(Generation(ids=row[:n], logprobs=lp[:n], finished=end is not None))
    return results, out.sequences, getattr(out, "cache", None) or getattr(out, "past_key_values", None)


# ---------------------------------------------------------------------------------------------
# 6. Rollouts: every active trajectory advances one phase per `generate` call
# ---------------------------------------------------------------------------------------------
def rollout(model, tokenizer, questions: list[dict], search, settings: RolloutSettings | None = None, *,
            group_size: int = 1, generate_fn=None) -> list[Trajectory]:
    """Roll out `group_size` trajectories per question ({"id", "question", "golden_answers"}).

    Training (`RolloutSettings()`) ends a trajectory on: an answer or a generation without a tool
    call, an illegal stop at `<|im_start|>`, a generation cut by the token limit, a missing, empty or
    oversized memory, a conversation whose response part exceeds `max_response_tokens` (truncated to
    it). In evaluation (as released) an invalid memory resets it to empty and the loop goes on, and
    a generation cut by the token limit still has its tool calls run.
    The prediction is the last boxed answer of the last assistant message (in evaluation, after
    removing `<think>...</think>`). `generate_fn(model, tokenizer, prompts, **sampling)` is
    swappable so tests and the oracle can script outputs; by default a fresh `CachedGenerate`
    (`generate` gives the same results, prefilling every prompt whole).
    """
    s = settings or RolloutSettings()
    if s.agent not in ("memsearcher", "react"):
        raise ValueError(f"agent must be 'memsearcher' or 'react', not {s.agent!r}")
    trajectories = [Trajectory(qid=str(q["id"]), question=q["question"], golden_answers=list(q["golden_answers"]))
                    for q in questions for _ in range(group_size)]
    sampling = dict(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, greedy=s.greedy)
    generate_fn = generate_fn or CachedGenerate()  # the speedup of `generate` (section 8)
    gen = lambda prompts: generate_fn(model, tokenizer, prompts, **sampling)  # noqa: E731
    if s.evaluation:  # as the release's client calls SGLang: stop at the eos ids only, `<|im_end|>` after every response
        sampling["stop_ids"], im_end = eos_ids(model, tokenizer), tokenizer.convert_tokens_to_ids(END_OF_TURN)
        gen = lambda prompts: [Generation((o.ids[:-1] if o.finished else o.ids) + [im_end],  # noqa: E731
                                          o.logprobs[:len(o.ids) - o.finished] + [0.0], o.finished)
                               for o in generate_fn(model, tokenizer, prompts, **sampling)]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731 -- for logs and reward only
    illegal = tokenizer.convert_tokens_to_ids(START_OF_TURN)
    instruction = (s.memory_instruction or MEMORY_INSTRUCTION) if s.agent == "memsearcher" else None
    if s.agent == "react":  # one growing conversation
        for t in trajectories:
            t.conversations.append(Conversation(encode(tokenizer, react_prompt(t.question, s.system_prompt or REACT_SYSTEM_PROMPT))))

    for _ in range(s.max_turns):
        active = [t for t in trajectories if not t.done]
        if not active:
            break
        if s.agent == "memsearcher":  # each turn a fresh context holding only (question, memory)
            for t in active:
                prompt = memsearcher_prompt(t.question, t.memory, s.system_prompt or SYSTEM_PROMPT)
                t.conversations.append(Conversation(encode(tokenizer, prompt)))
        # Phase 1: reason, then answer or call the search tool.
        searching = reason_and_act(active, gen, decode, illegal, s)
        updating = run_searches(searching, search, tokenizer, instruction, s.max_response_tokens)
        # Phase 2 (MemSearcher): read the results and rewrite the memory.
        if s.agent == "memsearcher" and updating:
            update_memories(updating, gen, decode, tokenizer, illegal, s.evaluation, s.max_memory_tokens)
        for t in active:
            t.context_tokens.append(len(t.conversations[-1]))
    end_of_turn = set(end_of_turn_ids(tokenizer))
    for t in trajectories:
        score(t, decode, end_of_turn, s.evaluation)
        if s.evaluation and s.agent == "memsearcher" and t.end_reason == "max_turns" and t.turns[-1].get("queries"):
            t.prediction = None  # as released: the last text is then a fresh prompt, with no answer in it
    return trajectories


def reason_and_act(active, gen, decode, illegal, s: RolloutSettings):
    """Phase 1: one generation per active trajectory, from its last conversation. It ends the
    trajectory (an answer, no tool call, an illegal stop, the token limit) or calls the tool;
    returns [(trajectory, conversation, calls)] of those that search."""
    conversations = [t.conversations[-1] for t in active]
    outputs = gen([c.prompt_ids + c.response_ids for c in conversations])
    searching = []
    for t, c, out in zip(active, conversations, outputs):
        log = {"turn": t.num_turns + 1, "context": decode(c.prompt_ids + c.response_ids), "generation": decode(out.ids)}
        t.turns.append(log)
        t.num_turns += 1
        c.append(out.ids, trained=True, logprobs=out.logprobs)
        calls = parse_tool_calls(log["generation"], s.default_top_n, s.max_top_n, s.tool_error)
        if out.ids and out.ids[-1] == illegal:
            t.end_reason = "illegal_stop"
        elif not out.finished and not (s.evaluation and calls):
            t.end_reason = "length"
        elif calls:
            log["queries"] = [call["query"] for call in calls]
            searching.append((t, c, calls))
        else:  # no tool call: the trajectory ends, and the reward decides whether it answered
            t.end_reason = "answer" if extract_boxed(log["generation"]) is not None else "no_answer"
    return searching


def run_searches(searching, search, tokenizer, instruction, max_response_tokens):
    """All of this turn's well-formed searches go to the retriever in one call (a bad call's result
    is its error text); each conversation gets its untrained tool-response turn. Returns the
    [(trajectory, conversation)] still within `max_response_tokens` (the others end, cut to it)."""
    valid = [call for _, _, calls in searching for call in calls if call["error"] is None]
    documents = iter(search([call["query"] for call in valid], [call["top_n"] for call in valid]) if valid else [])
    going_on = []
    for t, c, calls in searching:
        results = [call["error"] or next(documents) for call in calls]
        t.num_searches += len(calls)
        t.turns[-1]["documents"] = results
        t.turns[-1]["document_ids"] = [list(getattr(r, "ids", ())) for r in results]  # retriever.Documents
        c.append(encode(tokenizer, tool_response_turn(calls, results, instruction)), trained=False)
        if len(c.response_ids) > max_response_tokens:  # over the response budget: cut, and the trajectory ends
            c.response_ids, c.loss_mask, c.logprobs = (x[:max_response_tokens] for x in (c.response_ids, c.loss_mask, c.logprobs))
            t.end_reason = "context_overflow"
        else:
            going_on.append((t, c))
    return going_on


def update_memories(updating, gen, decode, tokenizer, illegal, evaluation, max_memory_tokens):
    """Phase 2: each trajectory rewrites its memory in the same conversation. In training a cut,
    missing, empty or oversized memory ends the trajectory; in evaluation (as released) an
    unusable memory becomes empty and the loop goes on."""
    outputs = gen([c.prompt_ids + c.response_ids for _, c in updating])
    for (t, c), out in zip(updating, outputs):
        c.append(out.ids, trained=True, logprobs=out.logprobs)
        text = decode(out.ids)
        memory = extract_memory(text)
        t.turns[-1].update(memory_generation=text, memory=memory)
        too_long = memory is not None and max_memory_tokens is not None and len(encode(tokenizer, memory)) > max_memory_tokens
        if out.ids and out.ids[-1] == illegal:
            t.end_reason = "illegal_stop"
        elif evaluation:
            t.memory = "" if memory is None or too_long else memory
        elif not out.finished:
            t.end_reason = "length"
        elif memory is None or memory == "":
            t.end_reason = "invalid_memory" if memory is None else "empty_memory"
        elif too_long:
            t.end_reason = "memory_overflow"
        else:
            t.memory = memory


def score(t, decode, end_of_turn, evaluation):
    """The trajectory's end reason (max_turns if none), prediction and reward, from its last conversation."""
    t.end_reason = t.end_reason or "max_turns"
    final = t.conversations[-1]
    text = decode(final.prompt_ids + final.response_ids)
    last = (assistant_messages(text) or [""])[-1]
    t.prediction = extract_boxed(remove_think(last) if evaluation else last)
    ends = bool(final.response_ids) and final.response_ids[-1] in end_of_turn
    t.reward = compute_reward(text, ends, t.golden_answers)


# ---------------------------------------------------------------------------------------------
# 7. Speedup (exact): generation that prefills nothing twice within a rollout
# ---------------------------------------------------------------------------------------------
def compact_cache(cache, mask):
    """Drop the pad columns every row can spare from a left-padded KV cache, in place; returns the
    kept columns [B, k] (k = the longest row's real tokens), each row's pads first, then its tokens.

    Cached keys already carry their rotary positions and attention does not care where a key sits,
    only whether the mask shows it, so moving a row's real slots next to each other changes no
    output; it shortens the cache every later token attends to. Rows that stopped early leave pad
    slots up to the longest generation, and short prompts leave left padding: both go.
    """
    if any(hasattr(layer, "cumulative_length") for layer in cache.layers):  # sliding-window layers: leave as is
        return torch.arange(mask.shape[1], device=mask.device).expand(mask.shape[0], -1)
    k = int(mask.sum(1).max())
    keep = torch.sort(mask.int(), dim=1, stable=True).indices[:, mask.shape[1] - k:]
    for layer in cache.layers:
        index = keep[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
    return keep


class CachedGenerate:
    """Speedup of the plain stateless call, which prefills every prompt whole each time:

        generate(model, tokenizer, prompts, **sampling)

    This one keeps state between the calls of one rollout and prefills nothing twice (same
    interface, same results; proven equal by tests/test_agent.py::
    test_cached_generate_equals_generate_across_a_tool_response and
    ::test_rollout_with_cached_generate_equals_stateless, and `compact_cache` by hand in
    ::test_compact_cache_by_hand):

    - **Across a tool response.** A prompt that extends a row of the previous call (that row's prompt
      and generation, then the tool-response turn) continues from that row's KV cache and prefills only
      the new tokens: MemSearcher's memory update, ReAct's next turn. Pad slots (left padding, and
      rows that finished before the longest one) are first squeezed out of the cache as far as the
      longest row allows (`compact_cache`); the attention mask hides the rest and positions follow
      the mask (HF derives them from its cumulative sum), so every token sees what it saw before.
    - **The shared prefix.** Otherwise the prompts' common prefix (the system prompt) is prefilled
      once (batch 1), kept for the rollout, and every row starts from a copy of its cache; the rest
      of each prompt is left-padded after it.
    A rollout makes a fresh one (`rollout(generate_fn=None)`); `generate` is the stateless reference.
    """

    def __init__(self):
        self.tokens, self.sequences, self.mask, self.cache = [], None, None, None  # the previous call's rows
        self.prefix_ids, self.prefix = [], None  # the shared prefix and its KV cache, batch 1
        self.prefilled = 0  # token positions prefilled so far, padding included (bench/rollout.py)

    @torch.no_grad()
    def __call__(self, model, tokenizer, prompts, **sampling):
        if not prompts:
            return []
        pad, device = tokenizer.pad_token_id, model.device
        rows = self._continued(prompts)
        if rows is not None:  # continue those rows: keep their cache, add only what follows their generation
            index = torch.tensor(rows, device=device)
            self.cache.batch_select_indices(index)
            new_ids, new_mask = left_pad([p[len(self.tokens[r]):] for p, r in zip(prompts, rows)], pad, device)
            seq, seq_mask, w = self.sequences[index], self.mask[index], self.cache.get_seq_length()
            keep = compact_cache(self.cache, seq_mask[:, :w])  # the cached columns kept, pads first
            ids = torch.cat([seq[:, :w].gather(1, keep), seq[:, w:], new_ids], 1)
            mask = torch.cat([seq_mask[:, :w].gather(1, keep), seq_mask[:, w:], new_mask], 1)
            cache = self.cache
        else:  # a fresh batch: its shared prefix once, then the rest of each prompt
            self.sequences = self.mask = self.cache = None  # free the previous call's cache before this one's
            p = self._prefix(model, prompts)
            rest_ids, rest_mask = left_pad([q[p:] for q in prompts], pad, device)
            prefix_ids = torch.tensor(self.prefix_ids[:p], device=device).expand(len(prompts), -1)
            ids, mask = torch.cat([prefix_ids, rest_ids], 1), torch.cat([torch.ones_like(prefix_ids), rest_mask], 1)
            cache = None
            if p:  # every row starts from the prefix's keys and values
                cache = copy.deepcopy(self.prefix)
                cache.batch_repeat_interleave(len(prompts))
        self.prefilled += ids.shape[0] * (ids.shape[1] - (cache.get_seq_length() if cache is not None else 0))
        results, self.sequences, self.cache = _generate(model, tokenizer, ids, mask, cache, **sampling)
        made = self.sequences.shape[1] - ids.shape[1]
        made_mask = torch.tensor([[1] * len(r.ids) + [0] * (made - len(r.ids)) for r in results], device=device)
        self.mask = torch.cat([mask, made_mask.view(len(results), made)], 1)
        self.tokens = [q + r.ids for q, r in zip(prompts, results)]
        return results

    def _continued(self, prompts):
        """For each prompt, a previous row it extends (None unless every prompt has one)."""
        rows = []
        for p in prompts:
            r = next((r for r, t in enumerate(self.tokens) if len(p) > len(t) and p[:len(t)] == t), None)
            if r is None:
                return None
            rows.append(r)
        return rows

    def _prefix(self, model, prompts) -> int:
        """Length of the cached prefix these prompts share (encoding it if it is new); 0 for none."""
        n = len(self.prefix_ids)
        if n and all(q[:n] == self.prefix_ids and len(q) > n for q in prompts):
            return n
        n = grpo.common_prefix(prompts)
        if n < 2:
            return 0
        self.prefix_ids = prompts[0][:n]
        self.prefilled += n
        was_training = model.training
        model.eval()
        try:
            out = model(input_ids=torch.tensor([self.prefix_ids], device=model.device), use_cache=True, logits_to_keep=1,
                        cache=kv_cache.room_for(None, model, n))
            self.prefix = getattr(out, "cache", None) or out.past_key_values
        finally:
            model.train(was_training)
        return n
