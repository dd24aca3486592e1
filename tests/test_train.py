"""train.py: one step, metrics and checkpoints, bf16 autocast, exact resume, two-process CPU runs
(torchrun, gloo) under DDP and FSDP, LoRA, and the shared-prefix speedup. The toy preset's recipe
(warm start, oracle, evidence credit, skipped groups) is tested in tests/test_toy.py."""
import importlib.util
import json
import math
import types
import os
import random
import socket
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

import agent
import train
from tools import models, runs
from toy import recipe
from train_helpers import FSDP, base_args, run_two_machines, run_two_processes, state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = {"step", "reward", "em", "f1", "format_valid", "turns", "searches", "conversations_per_trajectory",
           "context_tokens_mean", "context_tokens_max", "trained_tokens", "loss", "kl", "clip_frac", "entropy",
           "grad_norm", "updates", "lr", "seconds_rollout", "seconds_reference", "seconds_update", "peak_memory_gb", "peak_update_gb"}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prefix_step_equals_plain(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path, checkpointing):
    """One GRPO step (reference pass, two updates of several micro-batches of mixed lengths) with the
    shared prefix ends where the plain one does, and runs fewer tokens through the model."""
    flags = dict(max_steps=1, batch_size=4, mini_batch_size=2, micro_batch_size=2, max_new_tokens=16,
                 **({"gradient_checkpointing": True} if checkpointing else {}))
    train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path / "plain", no_shared_prefix=True, **flags))
    train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path / "shared", **flags))
    (plain,), (shared,) = ([json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")] for run in ("plain", "shared"))
    assert shared["updates"] == plain["updates"] == 2 and shared["trained_tokens"] == plain["trained_tokens"]
    assert shared["encoded_tokens"] < plain["encoded_tokens"]
    assert shared["loss"] == pytest.approx(plain["loss"], abs=1e-6) and shared["kl"] == pytest.approx(plain["kl"], abs=1e-7)
    a, b = state(tmp_path / "plain" / "checkpoint-1"), state(tmp_path / "shared" / "checkpoint-1")
    # AdamW's update is lr * m / (sqrt(v) + eps): a gradient that cancels to near eps turns float order
    # into a visible share of the 1e-3 step (1.2% for one weight in 1.5M on AVX-512 kernels, none on AVX2).
    # So: every weight within 1e-5 but at most a few, and those within 5% of a step.
    for k in a:
        off = ~torch.isclose(b[k], a[k], rtol=1e-4, atol=1e-5)
        assert off.sum() <= 4 and (b[k] - a[k]).abs().max() <= 5e-5, (k, int(off.sum()))


SYSTEM, QA, QB, M1, M2 = list(range(11, 21)), [101] * 5, [201] * 5, [301] * 7, [401] * 7  # 10, 5, 5, 7, 7 tokens
SHARING = {  # the 7 prompts of an update, and the tokens encoded at micro-batch 1 (plain: 148 in the first case)
    "turn-1 prompts": ([SYSTEM + QA] * 3 + [SYSTEM + QB] * 2 + [SYSTEM + M1, SYSTEM + M2],
                       10 + 2 * 4 + (5 + 6 + 7) + (8 + 9) + (11 + 12)),  # system once, each group's question once
    "system prompt": ([SYSTEM + [101 + 100 * k] * 5 for k in range(5)] + [SYSTEM + M1, SYSTEM + M2], 148 - 6 * 10),
    "nothing": ([[101 + 100 * k] * 5 for k in range(5)] + [M1, M2], 148 - 7 * 10),
    "turn-1 prompts only": ([QA + SYSTEM] * 3 + [QB + SYSTEM] * 2 + [M1 + SYSTEM, M2 + SYSTEM],
                            2 * 14 + (5 + 6 + 7) + (8 + 9) + (21 + 22)),  # no common prefix, whole prompts shared
}


@pytest.mark.parametrize("micro_batch_size", [1, 3])
@pytest.mark.parametrize("sharing", list(SHARING))
def test_shared_prefix_update_equals_plain(tiny_lm, micro_batch_size, sharing):
    """One optimizer update (SGD, lr 1: the parameters move by minus the gradient) over 7
    conversations of mixed lengths and prefixes, with the shared prefixes (`encode_prefixes`) and
    without: the same parameters after (float32, 1e-5), and at micro-batch 1 the hand-counted
    tokens (a row keeps its prompt's last token: a shared 15-token prompt saves 14)."""
    import copy
    import types

    from accelerate import Accelerator

    prompts, expected = SHARING[sharing]
    rng = random.Random(0)
    conversations = []
    for prompt, n in zip(prompts, (4, 5, 6, 7, 8, 4, 5)):
        conversations.append(agent.Conversation(prompt_ids=list(prompt)))
        conversations[-1].append([rng.randrange(3, 500) for _ in range(n)], trained=True)
    nll = lambda logprobs, entropy, f, n: (-(logprobs * f["loss_mask"]).sum() / n, {})  # noqa: E731
    after, encoded = {}, {}
    for shared in (False, True):
        model = copy.deepcopy(tiny_lm).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        config = types.SimpleNamespace(micro_batch_size=micro_batch_size, shared_prefix=shared, grad_clip=1e9)
        counter = Counter()
        train.optimizer_update(Accelerator(cpu=True), model, optimizer, sorted(conversations, key=len),
                               conversations[:1], 2, config, (), nll, return_entropy=True, counter=counter)
        after[shared], encoded[shared] = model.state_dict(), counter["encoded_tokens"]
    if micro_batch_size == 1:  # (larger micro-batches also encode their padding)
        assert (encoded[False], encoded[True]) == (sum(map(len, conversations)), expected)
    moved = max(float((after[False][k] - v).abs().max()) for k, v in tiny_lm.state_dict().items())
    assert moved > 1e-3
    for k, v in after[False].items():
        torch.testing.assert_close(after[True][k], v, rtol=0, atol=1e-5)


def test_config_errors_fail_fast(tmp_path):
    for bad, message in [(["--group_size", "1"], "group_size must be >= 2"),
                         (["--batch_size", "3", "--mini_batch_size", "2"], "multiple of --mini_batch_size"),
                         (["--train_data", str(tmp_path / "none.jsonl")], "train_data not found"),
                         (["--warm_start_mix", "1:2"], "warm_start_mix 1:2 .flag.: give three shares"),
                         (["--warm_start_mix", "a:b:c"], "single:bridge:comparison"),
                         (["--warm_start_mix", "0:0:0"], "not all 0")]:
        with pytest.raises(SystemExit, match=message):
            train.check_config(train.parse_args(bad), world_size=1)
    with pytest.raises(SystemExit, match="divisible by the 3 processes"):
        train.check_config(train.parse_args(["--batch_size", "4", "--mini_batch_size", "2"]), world_size=3)
    with pytest.raises(SystemExit, match="DeepSpeed is not supported"):
        train.check_config(train.parse_args([]), world_size=1, distributed_type=train.DistributedType.DEEPSPEED)
    with pytest.raises(SystemExit, match="FSDP1 is not supported.*--fsdp_version 2"):
        train.check_config(train.parse_args([]), world_size=2, distributed_type=train.DistributedType.FSDP,
                           fsdp=types.SimpleNamespace(fsdp_version=1))


def test_help_lists_every_flag_with_both_presets(capsys):
    with pytest.raises(SystemExit) as stop:
        train.parse_args(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert all(f"--{name}" in text for name, *_ in train.HYPERPARAMETERS)
    assert {name for name, *_ in recipe.HYPERPARAMETERS} <= {name for name, *_ in train.HYPERPARAMETERS}
    flat = " ".join(text.split())  # argparse wraps the help
    assert "(toy: 0; paper: 64)" in flat and "activations in the update to save memory (docs/performance.md)" in flat


def test_presets_and_overrides():
    toy = train.parse_args([])
    paper = train.parse_args(["--model", "Qwen/Qwen2.5-3B-Instruct"])
    assert (toy.preset, paper.preset) == ("toy", "paper")
    assert (paper.lr, paper.batch_size, paper.group_size, paper.mini_batch_size, paper.max_turns) == (1e-6, 256, 5, 128, 5)
    assert (paper.kl_coef, paper.entropy_coef, paper.clip_eps, paper.clip_ratio_c, paper.top_k) == (0.001, 0.001, 0.2, 3.0, 10000)
    assert train.parse_args(["--model", "Qwen/Qwen2.5-3B-Instruct", "--lr", "3e-6"]).lr == 3e-6
    assert paper.train_data == toy.train_data  # no paper default for data: the toy file unless given
    assert (toy.default_top_n, paper.default_top_n, paper.doc_format) == (5, 10, "release")  # the release's server: 10


def test_a_checkpoint_keeps_its_preset_and_errors_name_the_preset(tmp_path):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 4, "args": {"preset": "toy"}}))
    args = train.parse_args(["--model", str(tmp_path), "--batch_size", "2"])
    assert (args.preset, args.batch_size, args.mini_batch_size, args.lr) == ("toy", 2, 4, 1e-5)
    with pytest.raises(SystemExit, match=r"--batch_size 2 \(flag\) must be a multiple of --mini_batch_size 4 \(toy preset\)"):
        train.check_config(args, world_size=1)
    paper = train.parse_args(["--model", "Qwen/Qwen2.5-3B-Instruct", "--batch_size", "8"])
    with pytest.raises(SystemExit, match=r"--mini_batch_size 128 \(paper preset\)"):
        train.check_config(paper, world_size=1)


def test_updates_per_step_count_conversations(tiny_lm_dir, small_corpus, tiny_encoder_dir, yes_questions, tmp_path, monkeypatch):
    """Every trajectory here searches twice, then answers: 3 conversations each, 2 questions x G 2 x 3
    = 12 a step; --mini_batch_size 1 x G 2 = 2 conversations an update -> ceil(12 / 2) = 6 updates."""
    import scripted_policy
    monkeypatch.setattr(scripted_policy, "RANK", 1)  # rank 1's policy searches twice before answering
    steps = []
    monkeypatch.setattr(train.torch.optim.AdamW, "step", lambda self, *a, **k: steps.append(1))
    train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path, max_steps=1, train_data=yes_questions,
                         max_turns=3), generate_fn=scripted_policy.scripted_generate)
    (row,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert row["conversations_per_trajectory"] == 3 and row["updates"] == len(steps) == math.ceil(2 * 2 * 3 / 2)


def test_one_step_changes_parameters_writes_metrics_and_checkpoint(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path):
    train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path, max_steps=1, mini_batch_size=2))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 1 and METRICS <= set(rows[0]) and rows[0]["trained_tokens"] > 0
    assert rows[0]["ratio"] == pytest.approx(1.0, abs=1e-5)  # one update: old log-probs = the policy it starts from
    assert rows[0]["old_logprob_gap"] < 1e-3  # float32: recorded while sampling = recomputed
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert samples and {"question", "turns", "reward", "end_reason"} <= set(samples[0])
    after, before = state(tmp_path / "checkpoint-1"), state(tiny_lm_dir)
    assert any(not torch.equal(after[k], before[k]) for k in before)
    assert os.path.isfile(tmp_path / "checkpoint-1" / "tokenizer_config.json")
    assert not any(p.endswith(".tmp") for p in os.listdir(tmp_path))


def test_bf16_autocast_keeps_float32_master_weights(tiny_lm_dir, small_corpus, tiny_encoder_dir, yes_questions, tmp_path,
                                                    monkeypatch):
    """`accelerate launch --mixed_precision bf16` (here on CPU): bf16 autocast, float32 weights."""
    from accelerate.state import AcceleratorState
    from scripted_policy import scripted_generate  # answers yes/no at random: non-zero advantages

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # as `accelerate launch --mixed_precision bf16` sets it
    precisions, token_logprobs = [], train.grpo.token_logprobs

    def recording(model, *args, **kwargs):  # old, reference and update forward passes
        precisions.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32)
        return token_logprobs(model, *args, **kwargs)
    monkeypatch.setattr(train.grpo, "token_logprobs", recording)
    AcceleratorState._reset_state(reset_partial_state=True)  # the precision is fixed per process otherwise
    try:
        model = train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path, max_steps=1, batch_size=4,
                                     mini_batch_size=4, train_data=yes_questions, weight_decay=0.0, mixed_precision="auto"),
                           generate_fn=scripted_generate)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert len(precisions) == 3 * 4 and set(precisions) == {torch.bfloat16}  # 8 conversations, micro-batches of 2
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["skipped_updates"] == 0 and math.isfinite(row["loss"]) and row["grad_norm"] > 0
    assert row["ratio"] == pytest.approx(1.0, abs=1e-2)  # old log-probs under the same autocast as the update
    after, before = state(tmp_path / "checkpoint-1"), state(tiny_lm_dir)
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(after[k], before[k]) for k in before)  # no weight decay: the gradient did it


def test_gradient_checkpointing_recomputes_in_the_update_only(tiny_lm_dir, small_corpus, tiny_encoder_dir,
                                                              yes_questions, tmp_path, monkeypatch):
    """Rollouts run in eval mode (KV cache on, no checkpointing); with --gradient_checkpointing the
    update recomputes each layer in the backward pass: twice the forward calls, the same result."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from scripted_policy import scripted_generate
    counts = {"grad_forwards": 0, "rollouts_in_train_mode": 0}
    mlp_forward = LlamaMLP.forward

    def counting_forward(self, *args, **kwargs):  # (module hooks do not fire on recomputation)
        counts["grad_forwards"] += torch.is_grad_enabled()
        return mlp_forward(self, *args, **kwargs)

    def generate(model, *args, **kwargs):
        counts["rollouts_in_train_mode"] += model.training
        with torch.no_grad():
            return scripted_generate(model, *args, **kwargs)
    monkeypatch.setattr(LlamaMLP, "forward", counting_forward)

    def run(out, *flags):
        counts.update(grad_forwards=0, rollouts_in_train_mode=0)
        argv = base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, out, max_steps=1, batch_size=4, mini_batch_size=4,
                         train_data=yes_questions, no_shared_prefix=True)  # (a shared prefix runs once more, unrecomputed)
        model = train.main(argv + list(flags), generate_fn=generate)
        return dict(counts), model.state_dict()

    plain, p = run(tmp_path / "plain")
    checkpointed, c = run(tmp_path / "checkpointed", "--gradient_checkpointing")
    assert plain["rollouts_in_train_mode"] == checkpointed["rollouts_in_train_mode"] == 0
    # 8 conversations in micro-batches of 2, through 2 layers: 8 forwards, and 8 more recomputed
    assert plain["grad_forwards"] == 8 and checkpointed["grad_forwards"] == 16
    for k in p:
        torch.testing.assert_close(c[k], p[k], rtol=1e-5, atol=1e-7)


def test_remote_retriever(tiny_lm_dir, small_corpus, tiny_encoder_dir, yes_questions, tmp_path, monkeypatch):
    """--retriever_url: every search goes to the server; an unreachable one stops the run at once."""
    import threading

    import retriever
    import scripted_policy

    local = retriever.open_retriever(corpus=small_corpus, encoder=tiny_encoder_dir)
    queries = []
    search = local.search
    monkeypatch.setattr(local, "search", lambda qs, topk=5: queries.extend(qs) or search(qs, topk))
    server = retriever.make_server(local, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(scripted_policy, "RANK", 1)  # search twice, then answer
    argv = base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path / "run", max_steps=1, train_data=yes_questions,
                     max_turns=4, retriever_url=url)
    try:
        train.main(argv, generate_fn=scripted_policy.scripted_generate)
    finally:
        server.shutdown()
        server.server_close()
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert row["searches"] == 2.0 and len(queries) == 1 + 2 * 4  # the start-up check, then 2 per trajectory
    with pytest.raises(SystemExit, match="--retriever_url: retriever unreachable at http://127.0.0.1:9"):
        train.main(argv[:-2] + ["--retriever_url", "http://127.0.0.1:9", "--retriever_retries", "0"])


def test_resume_reproduces_the_next_step(tiny_lm_dir, small_corpus, tiny_encoder_dir, yes_questions, tmp_path):
    common = dict(train_data=yes_questions, kl_coef=0.01)
    train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path / "straight", max_steps=2, **common))
    train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path / "resumed", max_steps=1, **common))
    train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path / "resumed", max_steps=2, resume=True, **common))
    a, b = state(tmp_path / "straight" / "checkpoint-2"), state(tmp_path / "resumed" / "checkpoint-2")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], state(tmp_path / "straight" / "checkpoint-1")[k]) for k in a)
    rows = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]


@pytest.fixture(scope="module")
def ddp_run(two_process_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    return out, run_two_processes(two_process_args(out))


def test_two_processes_with_unequal_conversations(ddp_run, tiny_lm_dir):
    out, (r0, r1) = ddp_run
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    # rank 0 answers at once (1 conversation per trajectory), rank 1 searches twice first (3)
    assert [r["conversations_per_trajectory"] for r in rows] == [2.0, 2.0]
    assert all(r["searches"] == 1.0 for r in rows)
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])
    initial = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).state_dict()
    assert not all(torch.equal(r0["params"][k], initial[k]) for k in r0["params"])
    # each step's rollout saw the same, current weights on both ranks: the initial ones, then step 1's
    assert len(r0["checksums"]) == 2 and r0["checksums"] == r1["checksums"]
    assert r0["checksums"][0] == pytest.approx(sum(v.double().sum().item() for v in initial.values()), rel=1e-9)
    # the process group waits --timeout_minutes (60, not torch's 10 of NCCL), DDP's buckets are views of the grads
    assert r0["settings"] == r1["settings"] == {"timeout": 60 * 60.0, "gradient_as_bucket_view": True}


@pytest.fixture(scope="module")
def fsdp_run(two_process_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    return out, run_two_processes(two_process_args(out), **FSDP)


def test_fsdp_matches_ddp(ddp_run, fsdp_run):
    """FSDP shards the policy; rollouts use a gathered full copy. The result equals DDP's."""
    (ddp_out, (d0, _)), (out, (f0, f1)) = ddp_run, fsdp_run
    # the sharded KL reference (its passes padded to the same count on both ranks) gives DDP's KL
    kl = [[json.loads(line)["kl"] for line in open(o / "metrics.jsonl")] for o in (ddp_out, out)]
    assert kl[1] == pytest.approx(kl[0], rel=1e-3, abs=1e-9) and kl[0][-1] > 0
    # both ranks rolled out with the same full weights, those DDP had, refreshed after step 1
    assert len(f0["checksums"]) == 2 and f0["checksums"] == f1["checksums"]
    assert f0["checksums"] == pytest.approx(d0["checksums"], rel=1e-6)
    saved = state(out / "checkpoint-2")  # the gathered weights, by save_pretrained on rank 0
    assert saved.keys() == d0["params"].keys()
    for k in saved:  # (DDP encodes the shared prefix once, FSDP does not: float order, ~0.3% of a 1e-3 step)
        torch.testing.assert_close(saved[k], d0["params"][k], rtol=1e-4, atol=1e-5)


def test_fsdp_resume_reproduces_the_next_step(two_process_args, fsdp_run, tmp_path):
    """Sharded optimizer state and RNG come back from checkpoint-1/state: step 2 is bit-identical."""
    out, _ = fsdp_run
    run_two_processes(two_process_args(tmp_path, max_steps=1), **FSDP)
    run_two_processes(two_process_args(tmp_path, resume=True), **FSDP)
    a, b = state(out / "checkpoint-2"), state(tmp_path / "checkpoint-2")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_folder_not_shared_by_two_machines_stops_every_rank(tiny_lm_dir, small_corpus, tiny_encoder_dir,
                                                                   yes_questions, tmp_path):
    """Two "machines" (torchrun --nnodes 2, a process each), each launched from its own folder with
    the same relative --output_dir, so rank 1 cannot see what rank 0 writes: both stop at start-up
    with the named error, before any model loads and without a hang or a collective mismatch."""
    argv = base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, "runs/x", train_data=yes_questions, batch_size=2)
    results = run_two_machines(os.path.join(ROOT, "train.py"), argv, [tmp_path / "machine0", tmp_path / "machine1"])
    for code, out in results:
        assert code != 0, out[-2000:]
        assert "train.py: --output_dir runs/x is not one folder for every machine: rank 0 on machine 0" in out, out[-2000:]
        assert f"rank 1 on machine 1 ({socket.gethostname()}) does not see it in {tmp_path / 'machine1' / 'runs' / 'x'}" in out
        assert "Fix: give --output_dir a folder on a file system every machine mounts" in out
        assert "Loading weights" not in out  # stopped before anything was loaded
    assert not (tmp_path / "machine1" / "runs").exists()  # and nothing was written on the other machine
    assert os.listdir(tmp_path / "machine0" / "runs" / "x") == []  # the first rank's check file is removed


def test_a_step_with_every_group_tied_trains_nothing_and_the_run_goes_on(tiny_lm_dir, small_corpus, tiny_encoder_dir,
                                                                         yes_questions, tmp_path):
    """--skip_equal_groups when every group of a step is tied (a random tiny model never earns a
    reward, and these questions have no reasoning chains for the oracle): each step logs its row
    with no update and every trajectory skipped, the weights stay as they were, and the run ends
    with its checkpoint."""
    out = tmp_path / "tied"
    train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, out, max_steps=2, batch_size=2, group_size=2,
                         mini_batch_size=2, train_data=yes_questions, skip_equal_groups=True, oracle_per_group=1))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward"] == 0 and r["updates"] == 0 and r["skipped_trajectories"] == 4 and r["trained_tokens"] == 0
               and r["equal_reward_groups"] == 1.0 for r in rows)
    initial, saved = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).state_dict(), state(out / "checkpoint-2")
    assert all(torch.equal(saved[k], initial[k]) for k in saved)


@pytest.mark.parametrize("tied_ranks", ["0,1", "0"])
def test_tied_groups_on_two_processes(two_process_args, tiny_lm_dir, tmp_path, tied_ranks):
    """Two ranks under DDP, --skip_equal_groups. Every group tied on both ranks: no update on
    either, together, and the run goes on. Every group tied on rank 0 only: rank 0 has nothing to
    train and joins rank 1's updates with passes of weight 0; both ranks end equal and moved."""
    rows_out = tmp_path / "run"
    r0, r1 = run_two_processes(two_process_args(rows_out, skip_equal_groups=True), TEST_YES_ON_RANKS=tied_ranks)
    rows = [json.loads(line) for line in open(rows_out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    initial = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).state_dict()
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])
    moved = not all(torch.equal(r0["params"][k], initial[k]) for k in r0["params"])
    if tied_ranks == "0,1":
        assert all(r["updates"] == 0 and r["skipped_trajectories"] == 8 and r["equal_reward_groups"] == 1.0 for r in rows)
        assert not moved
    else:
        assert all(r["skipped_trajectories"] >= 4 for r in rows) and sum(r["updates"] for r in rows) > 0
        assert moved


def test_bf16_on_cpu_recomputes_old_logprobs(tiny_lm_dir, small_corpus, tiny_encoder_dir, yes_questions, tmp_path,
                                              monkeypatch):
    """--mixed_precision bf16 with --old_logprobs recorded: the recorded float32 log-probs are not
    the update's precision, so the old log-probs are recomputed under the same bf16 autocast."""
    from accelerate.state import AcceleratorState
    from scripted_policy import scripted_generate

    passes = []
    response_logprobs = train.grpo.response_logprobs
    monkeypatch.setattr(train.grpo, "response_logprobs", lambda model, conversations, *a: passes.append(
        torch.is_autocast_enabled("cpu")) or response_logprobs(model, conversations, *a))
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        model = train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path, max_steps=1, batch_size=4,
                                     mini_batch_size=4, train_data=yes_questions, kl_coef=0.0, old_logprobs="recorded",
                                     mixed_precision="bf16"), generate_fn=scripted_generate)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert passes == [True]  # one pass, the old log-probs (no reference with kl_coef 0), under autocast
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert json.loads(open(tmp_path / "metrics.jsonl").readline())["ratio"] == pytest.approx(1.0, abs=1e-2)


# --- memory: frozen copies in the run's precision, rollout chunks, the fp16 scaler (docs/memory_plan.md)
def test_frozen_copies_follow_the_runs_precision_and_logits_stay_bf16(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path):
    """In a bf16 run the KL reference is a bfloat16 copy (half the bytes of float32), the trained
    weights stay float32, and the forward passes return bf16 logits: accelerate's float32-output
    wrapper (a float32 copy of every logits tensor) is taken off."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    args = train.parse_args(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path, kl_coef=0.001))
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        model, _, tokenizer, reference, rollout_model = train.load_models(args, accelerator)
        ids = torch.tensor([agent.encode(tokenizer, "Is fact number 3 true?")])
        with accelerator.autocast():
            logits = [m(input_ids=ids).logits.dtype for m in (model, accelerator.unwrap_model(model), reference)]
        policy = accelerator.unwrap_model(model)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16} and rollout_model is None
    # an empty frame filled from the policy: its weights cast to bf16, its rotary frequencies computed
    weights = policy.state_dict()
    assert all(torch.equal(v, weights[k].to(torch.bfloat16)) for k, v in reference.state_dict().items())
    assert torch.equal(reference.model.rotary_emb.inv_freq, policy.model.rotary_emb.inv_freq)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert logits == [torch.bfloat16] * 3


def test_rollout_in_chunks_bounds_the_rows_per_generate_call(tiny_lm, tokenizer, monkeypatch):
    """--rollout_batch_size 2 with G = 2: one question (2 rows) per generate call; greedy
    trajectories equal those of one chunk, token for token."""
    rows, generate = [], agent._generate
    monkeypatch.setattr(agent, "_generate", lambda model, tok, ids, *a, **k: rows.append(ids.shape[0]) or generate(model, tok, ids, *a, **k))
    questions = [{"id": f"q{i}", "question": f"Where was person {i} born?", "golden_answers": ["x"]} for i in range(3)]
    search = lambda queries, topk: [f"A passage about {q}." for q in queries]  # noqa: E731
    rollouts = []
    for size in (0, 2):
        rows.clear()
        settings = agent.RolloutSettings(max_turns=2, max_new_tokens=6, greedy=True)
        rollouts.append(train.rollout_in_chunks(tiny_lm, tokenizer, questions, search, settings, 2, size, 7))
        assert max(rows) == (6 if size == 0 else 2)
    assert [t.qid for t in rollouts[0]] == [t.qid for t in rollouts[1]] == ["q0", "q0", "q1", "q1", "q2", "q2"]
    for a, b in zip(*rollouts):
        assert [(c.prompt_ids, c.response_ids, c.loss_mask) for c in a.conversations] == \
               [(c.prompt_ids, c.response_ids, c.loss_mask) for c in b.conversations]


def test_an_fp16_loss_scaler_sees_every_overflow(monkeypatch):
    """A non-finite gradient under an fp16 loss scaler: no weight moves, and the scale halves (the
    scaler's step and update run); without it the scale would stay and every later step overflow."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # the wrapper reads the process's accelerate state
    layer = torch.nn.Linear(2, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    optimizer = AcceleratedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0), device_placement=False, scaler=scaler)

    def clip(params, max_norm):
        scaler.unscale_(optimizer.optimizer)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    accelerator = SimpleNamespace(scaler=scaler, clip_grad_norm_=clip, print=lambda *a: None)
    before = [p.detach().clone() for p in layer.parameters()]
    scaler.scale(layer(torch.tensor([[float("inf"), 1.0]])).sum()).backward()
    assert not math.isfinite(train.step_optimizer(accelerator, layer, optimizer, 1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    assert scaler.get_scale() == 2.0 ** 15
    scaler.scale(layer(torch.ones(1, 2)).sum()).backward()  # a finite step then moves the weights
    assert math.isfinite(train.step_optimizer(accelerator, layer, optimizer, 1.0))
    assert not all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))


# --- LoRA: adapters train, the base is the reference ------------------------------------------------
NEEDS_PEFT = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="LoRA needs peft (make test installs it)")


def adapter_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@NEEDS_PEFT
def test_a_lora_update_changes_only_the_adapter(tiny_lm_dir, small_corpus, tiny_encoder_dir, yes_questions, tmp_path):
    """--lora_rank 4: one GRPO update moves the adapters (B from 0) and no base weight; the
    checkpoint holds the adapter alone, and models.load merges it into the base."""
    from scripted_policy import scripted_generate

    model = train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path, max_steps=1, batch_size=4,
                                 mini_batch_size=4, train_data=yes_questions, weight_decay=0.0, lora_rank=4, lora_alpha=8),
                       generate_fn=scripted_generate)
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["updates"] == 1 and row["grad_norm"] > 0 and row["kl"] == pytest.approx(0.0, abs=1e-6)
    base, trained = state(tiny_lm_dir), adapter_state(model)
    lora = {k: v for k, v in trained.items() if "lora_" in k}
    assert lora and all("lora_A" in k or v.abs().sum() > 0 for k, v in lora.items())  # every B moved from 0
    frozen = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in trained.items() if "lora_" not in k}
    assert frozen.keys() == base.keys() and all(torch.equal(frozen[k], base[k]) for k in base)
    ckpt = tmp_path / "checkpoint-1"
    assert (ckpt / "adapter_config.json").is_file() and not (ckpt / "model.safetensors").exists()
    assert os.path.getsize(ckpt / "adapter_model.safetensors") < os.path.getsize(os.path.join(tiny_lm_dir, "model.safetensors"))
    merged, _ = models.load(str(tmp_path))  # the run folder: its newest checkpoint, merged
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    models.save_merged(str(ckpt), str(tmp_path / "merged"))
    assert (tmp_path / "merged" / "config.json").is_file()


@NEEDS_PEFT
def test_the_lora_reference_is_the_base_model(tiny_lm, tokenizer):
    """With the adapter disabled, the policy's log-probs are the base model's exactly; enabled, they differ."""
    import copy as copy_module
    from types import SimpleNamespace

    policy = models.add_adapter(copy_module.deepcopy(tiny_lm), 4, 8, "q_proj,v_proj,down_proj")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    prompt = agent.encode(tokenizer, agent.memsearcher_prompt("Where was Velmora Quint born?", ""))
    c = agent.Conversation(prompt_ids=prompt)
    c.append(agent.encode(tokenizer, " I must look this up.</think>"), trained=True)
    logprobs = lambda m: train.grpo.response_logprobs(m, [c], tokenizer.pad_token_id, "cpu", 1, 1.0)[0]  # noqa: E731
    with train.reference_pass(SimpleNamespace(lora_rank=4), policy, None, "cpu") as reference:
        assert reference is policy
        disabled = logprobs(reference)
    assert torch.equal(disabled, logprobs(tiny_lm))
    assert not torch.allclose(logprobs(policy), disabled, atol=1e-3)


@NEEDS_PEFT
def test_a_lora_run_resumes_bit_exactly(tiny_lm_dir, small_corpus, tiny_encoder_dir, yes_questions, tmp_path):
    from scripted_policy import scripted_generate  # answers right or wrong at random: real advantages

    common = dict(train_data=yes_questions, kl_coef=0.01, lora_rank=4, lora_alpha=8)
    straight = train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path / "straight", max_steps=2, **common),
                          generate_fn=scripted_generate)
    train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path / "resumed", max_steps=1, **common),
               generate_fn=scripted_generate)
    state_files = os.listdir(tmp_path / "resumed" / "checkpoint-1" / "state")
    resumed = train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path / "resumed", max_steps=2,
                                   resume=True, **common), generate_fn=scripted_generate)
    a, b = adapter_state(straight), adapter_state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    lora = [k for k in a if "lora_B" in k]
    assert lora and all(a[k].abs().sum() > 0 for k in lora)
    size = os.path.getsize(tmp_path / "resumed" / "checkpoint-1" / "state" / "model.safetensors")
    assert "model.safetensors" in state_files and size < os.path.getsize(os.path.join(tiny_lm_dir, "model.safetensors")) / 4


@NEEDS_PEFT
def test_lora_on_two_processes_ends_equal(two_process_args, tiny_lm_dir, tmp_path):
    r0, r1 = run_two_processes(two_process_args(tmp_path, lora_rank=4, lora_alpha=8))
    assert r0["params"].keys() == r1["params"].keys()
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in r0["params"].items())


# --- on a GPU (tools/gpu_check.py runs these: MEMSEARCHER_TEST_CUDA=1 pytest -m cuda) ----------------
def cuda_step(tiny_lm_dir, tmp_path, **extra):
    """One GRPO step on the GPU through train.py's own parts (no retriever: a stand-in search), in
    the precision `--mixed_precision auto` picks there. Returns (policy, reference, policy before, grad norms)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    argv = ["--model", tiny_lm_dir, "--output_dir", str(tmp_path), "--preset", "paper", "--kl_coef", "0.001",
            "--group_size", "2", "--micro_batch_size", "2", "--mini_batch_size", "2", "--batch_size", "2"]
    for k, v in extra.items():
        argv += [f"--{k}"] if v is True else [f"--{k}", str(v)]
    args = train.parse_args(argv)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(mixed_precision=runs.resolve_precision(args.mixed_precision))
        assert accelerator.mixed_precision == "bf16" and accelerator.device.type == "cuda"
        model, optimizer, tokenizer, reference, _ = train.load_models(args, accelerator)
        policy = accelerator.unwrap_model(model)
        before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        questions = [{"id": f"q{i}", "question": f"Is fact number {i} true?", "golden_answers": ["yes"]} for i in range(2)]
        search = lambda queries, topk: [f"A passage about {q}." for q in queries]  # noqa: E731
        with accelerator.autocast():
            settings = agent.RolloutSettings(max_turns=2, max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0)
            trajectories = train.rollout_in_chunks(policy, tokenizer, questions, search, settings, 2, args.rollout_batch_size, 0)
        conversations = [c for t in trajectories for c in t.conversations]
        for k, c in enumerate(conversations):
            c.advantage = 1.0 if k % 2 else -1.0
        with accelerator.autocast():
            train.old_and_reference_logprobs(args, accelerator, policy, reference, conversations, [True] * len(conversations),
                                             tokenizer.pad_token_id)
        _, grad_norms = train.ppo_updates(accelerator, model, optimizer, conversations, conversations[:1], True,
                                          tokenizer.pad_token_id, args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return policy, reference, before, grad_norms


@pytest.mark.cuda
@pytest.mark.parametrize("reference_on_cpu", [False, True])
def test_a_bf16_step_on_cuda(tiny_lm_dir, tmp_path, reference_on_cpu):
    """auto = bf16 on the GPU: float32 trained weights, a bf16 reference (on the CPU between its
    passes with --reference_on_cpu), finite gradients, the weights move."""
    policy, reference, before, grad_norms = cuda_step(tiny_lm_dir, tmp_path, **({"reference_on_cpu": True} if reference_on_cpu else {}))
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    assert next(reference.parameters()).device.type == ("cpu" if reference_on_cpu else "cuda")
    assert grad_norms and all(math.isfinite(g) and g > 0 for g in grad_norms)
    assert any(not torch.equal(v, policy.state_dict()[k]) for k, v in before.items())


@pytest.mark.cuda
@NEEDS_PEFT
def test_a_lora_step_on_cuda(tiny_lm_dir, tmp_path):
    """LoRA in a bf16 run: the base frozen in bf16, float32 adapters; only the adapters move."""
    policy, reference, before, grad_norms = cuda_step(tiny_lm_dir, tmp_path, lora_rank=4, lora_alpha=8)
    assert reference is None and grad_norms and all(math.isfinite(g) for g in grad_norms)
    after = policy.state_dict()
    assert {v.dtype for k, v in after.items() if "lora_" not in k} == {torch.bfloat16}
    assert {v.dtype for k, v in after.items() if "lora_" in k} == {torch.float32}
    moved = {k for k, v in before.items() if not torch.equal(v, after[k])}
    assert moved and all("lora_B" in k for k in moved)
