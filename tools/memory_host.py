"""Host RAM of start-up (train.load_models), per rank and per node: what a GPU node needs besides its
GPUs before the first step (docs/memory_plan.md, section 7). `python tools/memory_plan.py --host`
prints the table; tools/memory_check.py checks the plan against a measured start-up on this CPU."""
from memory_gpu import MODELS, Dims, GiB, Term, count_params, gb


HOST_RUNTIME_GPU = 3.0 * GiB  # assumed: the CUDA libraries and context's host side, Python, torch, transformers
RETRIEVER_NODE = 64.6 * GiB + 1.0 * GiB  # wiki-18's flat index (page cache, shared) + corpus offsets and e5 on the CPU


def host_start_up(d: Dims, strategy: str, ranks: int, where: str = "gpu", base: float = HOST_RUNTIME_GPU) -> list[Term]:
    """Host peak of start-up of each rank (a list, one per rank), as train.load_models runs it.
    F = the checkpoint's bytes (bfloat16, as released: 2P). DDP: every rank loads the float32 policy,
    holding it and the file's tensors at once (4P + F), then `prepare` moves it to its GPU. FSDP:
    every rank starts from an empty model and reads the checkpoint one tensor at a time into its
    shards (models.load_shards): the largest tensor in float32 and as read (4VH + 2VH). The frozen
    copies are made on their device from the policy (on GPUs, no host memory). where="cpu" (the
    check on this machine) counts what lives on the device too: the policy's shard 4P/n, the
    reference's 2P/n, the whole rollout copy 2P and one gathered parameter 2VH."""
    P, F, VH = count_params(d), 2 * count_params(d), d.vocab * d.hidden
    if strategy == "lora":
        return [Term("base", base + 2 * P + F, "runtime + 2P (bf16 base) + F")]
    if strategy == "ddp":
        return [Term("each rank", base + 4 * P + F, "runtime + 4P + F")] * ranks
    if where == "gpu":
        return [Term("each rank", base + 6 * VH, "runtime + 4VH + 2VH (one tensor read)")] * ranks
    resident = 4 * P / ranks + 2 * P / ranks + 2 * P
    return [Term("each rank", base + resident + 2 * VH, "runtime + 4P/n + 2P/n + 2P + 2VH")] * ranks


def host_table() -> str:
    """Host RAM a 4-GPU node needs for start-up, per rank and per node."""
    lines = [f"host RAM of start-up on GPUs, runtime {gb(HOST_RUNTIME_GPU)} per process assumed; node: all ranks, "
             f"plus {gb(RETRIEVER_NODE)} when the wiki-18 server runs on the same node", "",
             "| model | strategy | ranks | each rank | node | node + retriever |", "| --- " * 6 + "|"]
    for size in ("3B", "7B"):
        for strategy, ranks in (("ddp", 4), ("fsdp", 4), ("lora", 1)):
            terms = host_start_up(MODELS[size], strategy, ranks)
            node = sum(t.bytes for t in terms)
            lines.append(f"| {size} | {strategy.upper() if strategy != 'lora' else 'LoRA'} | {ranks} | {gb(terms[0].bytes)} "
                         f"| {gb(node)} | {gb(node + RETRIEVER_NODE)} |")
    return "\n".join(lines)
