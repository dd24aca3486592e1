"""train.py: one step, metrics and checkpoints, bf16 autocast, exact resume, and two-process CPU
runs (torchrun, gloo) under DDP and FSDP."""
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = {"step", "reward", "em", "f1", "format_valid", "turns", "searches", "conversations_per_trajectory",
           "context_tokens_mean", "context_tokens_max", "trained_tokens", "loss", "kl", "clip_frac", "entropy",
           "grad_norm", "updates", "lr", "seconds_rollout", "seconds_reference", "seconds_update", "peak_memory_gb"}


@pytest.fixture(scope="module")
def yes_questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "question": f"Is fact number {i} true?", "golden_answers": ["yes"]}) + "\n"
                            for i in range(8)))
    return str(path)


def base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, out, **extra):
    args = dict(model=tiny_lm_dir, corpus=small_corpus, encoder=tiny_encoder_dir, output_dir=str(out), preset="toy",
                batch_size=2, group_size=2, mini_batch_size=1, micro_batch_size=2, max_new_tokens=12, max_turns=2,
                lr=1e-3, save_every=1, warm_start_steps=0, old_logprobs="recompute")
    args.update(extra)
    argv = []
    for k, v in args.items():
        argv += [f"--{k}"] if v is True else [f"--{k}", str(v)]
    return argv


@pytest.fixture(scope="module")
def demo_world(tmp_path_factory):
    """12 toy train questions with reasoning chains (8 to train on, 4 held out), and a corpus of
    their supporting passages plus 40 others; the embedded MiniLM finds each hop's entity by name."""
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "data", "toy", "train.jsonl"))][:12]
    corpus = [json.loads(line) for line in open(os.path.join(ROOT, "data", "toy", "corpus.jsonl"))]
    needed = {h["passage_id"] for r in rows for h in r["metadata"]["chain"]}
    passages = [p for p in corpus if p["id"] in needed] + [p for p in corpus[:60] if p["id"] not in needed][:40]
    folder = tmp_path_factory.mktemp("world")
    for name, items in (("train.jsonl", rows[:8]), ("heldout.jsonl", rows[8:]), ("corpus.jsonl", passages)):
        (folder / name).write_text("".join(json.dumps(x) + "\n" for x in items))
    return folder


def state(path):
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


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

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    precisions, token_logprobs = [], train.grpo.token_logprobs

    def recording(model, *args, **kwargs):  # old, reference and update forward passes
        precisions.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32)
        return token_logprobs(model, *args, **kwargs)
    monkeypatch.setattr(train.grpo, "token_logprobs", recording)
    AcceleratorState._reset_state(reset_partial_state=True)  # the precision is fixed per process otherwise
    try:
        model = train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path, max_steps=1, batch_size=4,
                                     mini_batch_size=4, train_data=yes_questions, weight_decay=0.0),
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
                         train_data=yes_questions)
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
        train.main(argv[:-2] + ["--retriever_url", "http://127.0.0.1:9"])


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


def run_two_processes(argv, **env):
    """torchrun --nproc_per_node 2 tests/scripted_policy.py <argv>; returns each rank's saved record."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **env)
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           os.path.join(ROOT, "tests", "scripted_policy.py"), *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = argv[argv.index("--output_dir") + 1]
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in (0, 1)]


@pytest.fixture(scope="module")
def two_process_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, yes_questions):
    common = dict(max_steps=2, train_data=yes_questions, batch_size=4, mini_batch_size=2, micro_batch_size=2, max_turns=4)
    return lambda out, **extra: base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, out, **{**common, **extra})


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


@pytest.fixture(scope="module")
def fsdp_run(two_process_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    return out, run_two_processes(two_process_args(out), TEST_FSDP_VERSION="2")


def test_fsdp_matches_ddp(ddp_run, fsdp_run):
    """FSDP shards the policy; rollouts use a gathered full copy. The result equals DDP's."""
    (_, (d0, _)), (out, (f0, f1)) = ddp_run, fsdp_run
    # both ranks rolled out with the same full weights, those DDP had, refreshed after step 1
    assert len(f0["checksums"]) == 2 and f0["checksums"] == f1["checksums"]
    assert f0["checksums"] == pytest.approx(d0["checksums"], rel=1e-6)
    saved = state(out / "checkpoint-2")  # the gathered weights, by save_pretrained on rank 0
    assert saved.keys() == d0["params"].keys()
    for k in saved:
        torch.testing.assert_close(saved[k], d0["params"][k], rtol=1e-4, atol=1e-6)


def test_fsdp_resume_reproduces_the_next_step(two_process_args, fsdp_run, tmp_path):
    """Sharded optimizer state and RNG come back from checkpoint-1/state: step 2 is bit-identical."""
    out, _ = fsdp_run
    run_two_processes(two_process_args(tmp_path, max_steps=1), TEST_FSDP_VERSION="2")
    run_two_processes(two_process_args(tmp_path, resume=True), TEST_FSDP_VERSION="2")
    a, b = state(out / "checkpoint-2"), state(tmp_path / "checkpoint-2")
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- the warm start on oracle demonstrations (DESIGN §9) -----------------------------------------
def warm_args(tiny_lm_dir, world, out, **extra):
    """The tiny model on the demo world with the embedded encoder: warm start only, unless told."""
    args = dict(corpus=world / "corpus.jsonl", encoder="default", train_data=world / "train.jsonl", max_steps=0,
                warm_start_steps=24, warm_start_batch=4, warm_start_lr=1e-2, warm_start_questions=8,
                warm_start_mix="7:1:0")  # all 8 train rows of demo_world: 7 single-hop, 1 bridge
    args.update(extra)
    return base_args(tiny_lm_dir, None, None, out, **args)


def demonstration_fit(model, conversations, pad_id):
    """(token-mean NLL, top-1 accuracy) over the loss masks, teacher-forced: what the warm start
    minimises, and how often the model's greedy next token is the demonstrated one."""
    ids, attn, _, f = train.pad_batch(conversations, pad_id, "cpu", ("loss_mask",))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    target, mask = ids[:, 1:], f["loss_mask"][:, 1:]
    nll = -torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]
    hits = (logits.argmax(-1) == target).float()
    return float((nll * mask).sum() / mask.sum()), float((hits * mask).sum() / mask.sum())


def test_warm_start_lowers_heldout_nll_and_teaches_the_format(tiny_lm_dir, tokenizer, demo_world, tmp_path):
    import retriever
    from data import oracle

    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["phase"] for r in rows] == ["warm_start"] * 24 and [r["step"] for r in rows] == list(range(1, 25))
    assert sum(r["loss"] for r in rows[-4:]) < 0.5 * sum(r["loss"] for r in rows[:4])
    assert not any(p.startswith("checkpoint-") for p in os.listdir(tmp_path))  # --max_steps 0: warm start only
    warm = AutoModelForCausalLM.from_pretrained(tmp_path / "warm_start").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    search = retriever.open_retriever(str(demo_world / "corpus.jsonl"), doc_format="release")
    heldout, stats = oracle.make_demonstrations(oracle.load_rows(demo_world / "heldout.jsonl"), search, tokenizer, max_turns=3)
    assert stats["kept"] == 4  # questions never trained on
    conversations = [c for t in heldout for c in t.conversations]
    (nll_before, acc_before), (nll_after, acc_after) = (demonstration_fit(m, conversations, tokenizer.pad_token_id)
                                                        for m in (base, warm))
    assert nll_after < 0.8 * nll_before
    assert acc_before < 0.01 and acc_after > 0.3  # the demonstrated format, token by token, on unseen questions


def test_a_warm_start_mix_the_data_cannot_fill_fails_clearly(tiny_lm_dir, demo_world, tmp_path):
    """demo_world's 8 train rows hold 7 single-hop questions, 1 bridge and no comparison."""
    with pytest.raises(SystemExit, match=r"--warm_start_mix 1:1:1: too few .*'bridge': '1 of 3', 'comparison': '0 of 2'"):
        train.main(warm_args(tiny_lm_dir, demo_world, tmp_path, warm_start_mix="1:1:1"))
    assert not (tmp_path / "warm_start").exists()


def test_resume_after_warm_start_continues_exactly(tiny_lm_dir, demo_world, tmp_path, monkeypatch):
    """A straight run (warm start, then 1 GRPO step) equals a warm-start-only run resumed for the
    GRPO step; the resumed run does not warm-start again, and its KL reference is the warm start."""
    common = dict(warm_start_steps=3, kl_coef=0.01, old_logprobs="recorded", batch_size=2, group_size=2, max_turns=2)
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / "straight", max_steps=1, **common))
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / "resumed", max_steps=0, **common))
    references = []  # with recorded old log-probs, response_logprobs runs for the KL reference only
    original = train.response_logprobs
    monkeypatch.setattr(train, "response_logprobs", lambda model, *a: references.append(
        {k: v.clone() for k, v in model.state_dict().items()}) or original(model, *a))
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / "resumed", max_steps=1, resume=True, **common))
    a, b = state(tmp_path / "straight" / "checkpoint-1"), state(tmp_path / "resumed" / "checkpoint-1")
    assert all(torch.equal(a[k], b[k]) for k in a)
    warm = state(tmp_path / "resumed" / "warm_start")
    assert len(references) == 1 and all(torch.equal(references[0][k], warm[k]) for k in warm)
    phases = [json.loads(line)["phase"] for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    assert phases == ["warm_start"] * 3 + ["grpo"]


def test_warm_start_on_two_processes_equals_one(tiny_lm_dir, demo_world, tmp_path):
    """Two ranks split each step's demonstrations unequally in tokens; the pooled token-mean gives
    the same update as one process, and both ranks stay identical."""
    common = dict(warm_start_steps=2, warm_start_lr=1e-3)
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / "one", **common))
    r0, r1 = run_two_processes(warm_args(tiny_lm_dir, demo_world, tmp_path / "two", **common))
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])
    one = state(tmp_path / "one" / "warm_start")
    for k in one:  # AdamW divides each gradient by its own scale, so where a gradient is near zero the
        # order of a float32 sum shows as up to ~0.1% of one 1e-3 step: allow 1% of a step
        torch.testing.assert_close(r0["params"][k], one[k], rtol=1e-4, atol=1e-5)
