"""Host memory of train.py's start-up, per process: loading, the frozen copies, `prepare`.

    python bench/host_memory.py                          # this checkout: 0.5B shapes, FSDP2 over 2 CPU processes
    python bench/host_memory.py --repo ../old_checkout   # the same model and command, run by another checkout

It saves a random model with Qwen2.5-0.5B's shapes (24 layers, width 896, vocabulary 151,936, tied
embeddings; bfloat16 on disk, as the released weights are) and the embedded default's tokenizer,
then runs the README's FSDP command on CPUs, as the rehearsal does:

    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 --mixed_precision bf16 \\
        --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap Qwen2DecoderLayer \\
        --fsdp_state_dict_type SHARDED_STATE_DICT train.py --model M ... --max_steps 0

with the KL reference (--kl_coef 0.001) and FSDP's rollout copy, both bfloat16. `--max_steps 0` stops
after start-up, so each process's peak resident memory (VmHWM, read at exit) is start-up's. A
checkout whose train.py cannot run FSDP from the launcher's settings on CPUs (before this bench
existed) is run the way its tests ran it: the FSDP plugin set after start-up, every rank loading
the whole model (`--fsdp_cpu_ram_efficient_loading false`; that code cannot take the other way).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def child(repo: str, argv: list[str]):
    """One process of the launch: train.main(argv) in `repo`, then this process's peak."""
    sys.path.insert(0, repo)
    import train
    from tools import runs

    if not hasattr(runs, "make_accelerator"):  # an older checkout: switch FSDP on after start-up, as its tests did
        from accelerate import Accelerator
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        def with_fsdp(*args, **kwargs):
            accelerator = Accelerator(*args, **kwargs)
            plugin = FullyShardedDataParallelPlugin()
            if accelerator.mixed_precision != "no":
                plugin.set_mixed_precision(accelerator.mixed_precision)
            accelerator.state.fsdp_plugin = plugin
            accelerator.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            return accelerator
        train.Accelerator = with_fsdp
    load_models = train.load_models

    def measured(*args, **kwargs):  # the process before any model: torch, transformers, accelerate, the retriever
        with open("/proc/self/status") as f:
            base = int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024
        print(f"base rank {os.environ.get('RANK', '0')}: {base / 2**30:.2f} GiB", flush=True)
        return load_models(*args, **kwargs)
    train.load_models = measured
    train.main(argv)
    print(f"VmHWM rank {os.environ.get('RANK', '0')}: {vm_hwm() / 2**30:.2f} GiB", flush=True)


def make_model(folder: str):
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, ROOT)
    from tools import models
    gguf_folder, name = os.path.split(models.default_model_file())
    tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=name)
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=ROOT, help="the checkout whose train.py runs (default: this one)")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "host_memory"), help="model and data land here")
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return child(os.path.abspath(args.repo), args.child)
    model = os.path.join(args.work, "qwen2-0.5b-shapes")
    if not os.path.isfile(os.path.join(model, "config.json")):
        make_model(model)
    repo = os.path.abspath(args.repo)
    old = "def make_accelerator" not in open(os.path.join(repo, "tools", "runs.py")).read()
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
              "--dynamo_backend", "no", "--use_fsdp", "--fsdp_version", "2", "--mixed_precision", "bf16",
              "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Qwen2DecoderLayer",
              "--fsdp_state_dict_type", "SHARDED_STATE_DICT"] + (["--fsdp_cpu_ram_efficient_loading", "false"] if old else [])
    train_args = ["--model", model, "--train_data", os.path.join(ROOT, "data", "toy", "train.jsonl"),
                  "--output_dir", os.path.join(args.work, "run"), "--max_steps", "0", "--batch_size", "2",
                  "--mini_batch_size", "1", "--group_size", "2", "--kl_coef", "0.001", "--mixed_precision", "bf16"]
    cmd = launch + [os.path.abspath(__file__), "--repo", repo, "--child"] + train_args
    how = "FSDP set after start-up, every rank loads whole" if old else "the launcher's FSDP settings"
    print(f"{repo} ({how}):")
    out = subprocess.run(cmd, cwd=repo, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    peaks, bases = (dict(re.findall(rf"{what} rank (\d): ([\d.]+) GiB", out.stdout)) for what in ("VmHWM", "base"))
    if out.returncode or len(peaks) != 2:
        raise SystemExit(f"the launch failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    for rank in sorted(peaks):
        print(f"  rank {rank}: start-up peak {peaks[rank]} GiB (VmHWM); before the model {bases[rank]} GiB (VmRSS)")
    return {int(r): (float(peaks[r]), float(bases[r])) for r in peaks}


if __name__ == "__main__":
    main()
