"""Run one trajectory and print it conversation by conversation, the tokens the policy is trained
on set apart from the masked ones (the prompt, tool responses, headers).

    python tools/trajectory.py "Who founded the company that employs Velmora Quint?" --answers "..."
    python tools/trajectory.py "..." --model runs/memsearcher --retriever_url http://host:8000/search
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import agent  # noqa: E402
import retriever  # noqa: E402
from tools import models  # noqa: E402


def render_conversation(conversation: agent.Conversation, tokenizer, color: bool = True) -> str:
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
    ap = argparse.ArgumentParser(description="Run one trajectory and print it turn by turn.")
    ap.add_argument("question")
    ap.add_argument("--answers", nargs="*", default=[], help="gold answers, to show the reward")
    ap.add_argument("--model", default="default", help="HF model name/path or `default` (embedded SmolLM2)")
    ap.add_argument("--agent", default="memsearcher", choices=["memsearcher", "react"])
    ap.add_argument("--corpus", default=None, help="default: data/toy/corpus.jsonl")
    ap.add_argument("--index", default=None)
    ap.add_argument("--encoder", default=None)
    ap.add_argument("--retriever_url", default=None, help="a retrieval server (.../retrieve or .../search) instead of a local index")
    ap.add_argument("--doc_format", default="release", choices=["release", "search-r1"], help="how results are shown")
    ap.add_argument("--system_prompt", default=None, help="a file with the system prompt (e.g. the release's wording)")
    ap.add_argument("--memory_instruction", default=None, help="a file with the memory-update instruction")
    ap.add_argument("--max_turns", type=int, default=20)
    ap.add_argument("--sample", action="store_true", help="sample (T=1.0, top-p 0.99) instead of greedy")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    model, tokenizer = models.load(args.model)
    search = retriever.open_retriever(args.corpus, args.index, args.encoder, url=args.retriever_url, doc_format=args.doc_format)
    settings = agent.RolloutSettings(agent=args.agent, max_turns=args.max_turns, greedy=not args.sample, evaluation=True,
                                     max_memory_tokens=None,
                                     **agent.read_prompts(args.agent, args.system_prompt, args.memory_instruction))
    (t,) = agent.rollout(model, tokenizer, [{"id": "0", "question": args.question, "golden_answers": args.answers}], search, settings)
    color = sys.stdout.isatty()
    for k, c in enumerate(t.conversations, 1):
        print(f"\n===== conversation {k} ({len(c)} tokens in context; dimmed/⟦⟧ = not trained) =====")
        print(render_conversation(c, tokenizer, color))
    print(f"\nend: {t.end_reason}  turns: {t.num_turns}  searches: {t.num_searches}  "
          f"prediction: {t.prediction!r}  reward: {t.reward:.2f}  context tokens per turn: {t.context_tokens}")


if __name__ == "__main__":
    main()
