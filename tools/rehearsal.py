"""The few-GPU path rehearsed on CPUs, from an empty folder to results.md: the README's
"Reproduce the paper" commands, run as the README writes them but for sizes.

    python tools/rehearsal.py                   # (make rehearsal) about 2 minutes on 2 cores
    python tools/rehearsal.py --work DIR        # keep what it made in DIR (default: a temporary folder)

1. A stand-in hub on 127.0.0.1 (HF_ENDPOINT) holds tiny files in the real layouts: Search-R1's NQ +
   HotpotQA parquet, the seven benchmarks in FlashRAG's folders, wiki-18 gzipped and its flat
   index in two parts (built here with a tiny encoder), so `data/download.py all` runs for real.
2. The commands of the README's block, in order, with these replacements only: the model and the
   encoder are a tiny random Qwen2 and a tiny BERT saved in the folder; `cuda:0` is `cpu`; the
   retrieval server listens on 127.0.0.1 at a free port; 4 processes are 2; `data/paper` and
   `runs/` lie in the folder; and train.py and evaluate.py get the size flags below (TRAIN_SIZE,
   EVAL_SIZE). `accelerate launch --use_fsdp --fsdp_version 2` then trains under FSDP2 over gloo
   (tools/runs.make_accelerator). The FSDP run is also interrupted after step 2 and resumed to
   step 3 with `--resume`, as the README says to.
3. After each command, what it must leave: the files, metrics rows per step, the checkpoints,
   the resumed step, a results row per benchmark. A command that fails, or leaves less, stops
   the rehearsal with its command line and its output's end.
4. Then docs/reproduce.md's "Two machines" block, the same way: two launchers on 127.0.0.1, one per
   "machine", each started in its own folder with its own copy of the data (the block's download
   runs in each), the retrieval server once, and the run folder shared. Each pair of lines (they
   differ only in --machine_rank) runs at once: FSDP2 training, its resume, the sharded evaluation.
   Before them the training pair runs once with a --output_dir that is not shared (the same relative
   path in each folder), and both machines must stop with train.py's error naming the folder.
   Replacements as above, and: MACHINE0 is 127.0.0.1, its port a free one, 8 processes are 2,
   `/shared/runs/` lies in the rehearsal's folder, and the scripts are named by their full path.
"""
import argparse
import gzip
import hashlib
import http.server
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TRAIN_SIZE = ["--max_steps", "2", "--save_every", "2", "--batch_size", "2", "--group_size", "2", "--mini_batch_size", "1",
              "--micro_batch_size", "2", "--max_turns", "2", "--max_new_tokens", "16", "--rollout_batch_size", "0"]
EVAL_SIZE = ["--limit", "2", "--max_turns", "2", "--max_new_tokens", "16", "--batch_size", "2"]


class RehearsalError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# 1. The stand-in hub and its files
# ---------------------------------------------------------------------------------------------
class StandInHub:
    """The hub's file protocol for dataset repositories, enough for hf_hub_download: HEAD and GET
    /datasets/<repo>/resolve/<revision>/<path>, with the commit, ETag and size headers. Counts GETs."""

    def __init__(self, files: dict):
        hub = self
        self.files, self.gets = files, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body_too):
                parts = self.path.split("?")[0].split("/")  # /datasets/<owner>/<name>/resolve/<rev>/<path...>
                key = ("/".join(parts[2:4]), "/".join(parts[6:])) if len(parts) > 6 and parts[4] == "resolve" else None
                if key not in hub.files:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.end_headers()
                    return
                body = hub.files[key]
                self.send_response(200)
                self.send_header("X-Repo-Commit", "0" * 40)
                self.send_header("ETag", '"%s"' % hashlib.sha1(body).hexdigest())
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body_too:
                    hub.gets.append(key)
                    self.wfile.write(body)

            def do_HEAD(self):
                self.reply(False)

            def do_GET(self):
                self.reply(True)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def tiny_models(folder: str) -> tuple[str, str]:
    """A 2-layer random Qwen2 over the embedded default's tokenizer, and a 2-layer random BERT with
    the embedded encoder's tokenizer, saved as folders (the shapes of the real ones, not the sizes)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel, Qwen2Config, Qwen2ForCausalLM

    import retriever
    from tools import models
    model, encoder = os.path.join(folder, "tiny-qwen2"), os.path.join(folder, "tiny-bert")
    if os.environ.get("MEMSEARCHER_TEST_TOKENIZER"):  # a machine without the embedded default (tools/gpu_check.py)
        tokenizer = AutoTokenizer.from_pretrained(os.environ["MEMSEARCHER_TEST_TOKENIZER"])
    else:
        gguf_folder, name = os.path.split(models.default_model_file())
        tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=name)
    vocab = os.environ.get("MEMSEARCHER_TEST_ENCODER_VOCAB") or retriever.default_encoder_path()
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    os.makedirs(encoder)
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(vocab, f)):
            shutil.copy(os.path.join(vocab, f), encoder)
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=256)).save_pretrained(encoder)
    return model, encoder


def hub_files(encoder: str, folder: str, passages: int = 60) -> dict:
    """{(repo, path): bytes} as the hub holds them, made from the toy world: data/download.py's repositories."""
    import pyarrow
    import pyarrow.parquet as pq

    import retriever
    from data import download

    def rows(path, n):
        with open(path) as f:
            return [json.loads(line) for line, _ in zip(f, range(n))]

    def parquet(records):
        sink = io.BytesIO()
        pq.write_table(pyarrow.Table.from_pylist(records), sink)
        return sink.getvalue()

    toy = os.path.join(ROOT, "data", "toy")
    train = [{"id": f"train_{k}", "question": q["question"], "golden_answers": q["golden_answers"],
              "data_source": ("nq", "hotpotqa")[k % 2], "reward_model": {"ground_truth": {"target": q["golden_answers"]}}}
             for k, q in enumerate(rows(os.path.join(toy, "train.jsonl"), 8))]
    files = {(repo, name): parquet(train if name == "train.parquet" else train[:2]) for repo, name, _ in download.TRAIN}
    test = rows(os.path.join(toy, "test.jsonl"), 14)
    for k, (repo, name, _) in enumerate(download.EVAL):
        files[repo, name] = "".join(json.dumps({"id": f"{k}_{j}", "question": q["question"], "golden_answers": q["golden_answers"]})
                                    + "\n" for j, q in enumerate(test[2 * k:2 * k + 2])).encode()
    corpus = os.path.join(folder, "corpus.jsonl")
    with open(retriever.DEFAULT_CORPUS) as src, open(corpus, "w") as dst:
        dst.write("".join(line for line, _ in zip(src, range(passages))))
    retriever.build_index(retriever.Corpus(corpus), retriever.Encoder(encoder, device="cpu"), corpus + ".index")
    index = open(corpus + ".index", "rb").read()
    files[download.CORPUS[:2]] = gzip.compress(open(corpus, "rb").read())
    for part, (start, end) in zip(download.INDEX[1], ((0, len(index) // 2), (len(index) // 2, len(index)))):
        files[download.INDEX[0], part] = index[start:end]
    return files


# ---------------------------------------------------------------------------------------------
# 2. The README's commands, as written but for sizes
# ---------------------------------------------------------------------------------------------
def block_commands(path: str, heading: str) -> list[str]:
    """The shell commands of the first bash block under the heading that contains `heading`
    (continued lines joined, comments dropped)."""
    text = open(path).read()
    section = re.search(r"^##+ [^\n]*" + re.escape(heading) + r".*?^```bash\n(.*?)^```", text, re.S | re.M)
    if not section:
        raise RehearsalError(f"{path}: no bash block under a heading with {heading!r}")
    lines = [re.sub(r"\s+#.*$", "", line).rstrip() for line in section.group(1).replace("\\\n", " ").splitlines()]
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def readme_commands(readme: str) -> list[str]:
    """The README's "## Reproduce the paper" block."""
    return block_commands(readme, "Reproduce the paper")


def two_machine_commands(docs: str) -> list[str]:
    """docs/reproduce.md's "Two machines" block."""
    return block_commands(docs, "Two machines")


def sized(command: str, work: dict, machine: bool = False) -> list[str]:
    """One README command made runnable here: the replacements of the module docstring (on GPUs,
    `--on_gpus`, the server's encoder stays on cuda:0 and the launches use NCCL). `machine`: a
    two-machine line, run in its machine's own folder (its data relative to it, the scripts by path)."""
    replacements = [("Qwen/Qwen2.5-3B-Instruct", work["model"]), ("Qwen/Qwen2.5-7B-Instruct", work["model"]),
                    ("intfloat/e5-base-v2", work["encoder"]), ("cuda:0", "cuda:0" if work["on_gpus"] else "cpu"),
                    ("--host 0.0.0.0 --port 8000", f"--host 127.0.0.1 --port {work['port']}"),
                    ("http://HOST:8000", f"http://127.0.0.1:{work['port']}"), ("http://MACHINE0:8000", f"http://127.0.0.1:{work['port']}"),
                    ("--main_process_ip MACHINE0", "--main_process_ip 127.0.0.1"), ("--main_process_port 29500", f"--main_process_port {work['rendezvous']}"),
                    ("--num_processes 4", "--num_processes 2"), ("--num_processes 8", "--num_processes 2"),
                    ("/shared/runs/", os.path.join(work["dir"], "shared", "runs", ""))]
    if not machine:
        replacements += [("data/paper", os.path.join(work["dir"], "data", "paper")), ("runs/", os.path.join(work["dir"], "runs", ""))]
    for real, stand_in in replacements:
        command = command.replace(real, stand_in)
    argv = shlex.split(command.rstrip("& "))
    if argv[:2] == ["accelerate", "launch"]:
        one_machine = [] if "--num_machines" in argv else ["--num_machines", "1", "--main_process_port", str(free_port())]
        argv[:2] = [sys.executable, "-m", "accelerate.commands.launch", *one_machine, "--dynamo_backend", "no"]
    elif argv[0] == "python":
        argv[0] = sys.executable
    k, script = next(((k, a) for k, a in enumerate(argv) if a.endswith(".py") and not a.startswith("-")), (0, ""))
    if machine and script:
        argv[k] = os.path.join(ROOT, script)
    return argv + {"train.py": TRAIN_SIZE, "evaluate.py": EVAL_SIZE}.get(os.path.basename(script), [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv: list[str], env: dict, what: str, timeout: int = 300, cwd: str = ROOT) -> str:
    print(f"$ {shlex.join(argv)}", flush=True)
    t0 = time.time()
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RehearsalError(f"{what}: no end after {timeout} s:\n  {shlex.join(argv)}") from None
    if done.returncode:
        raise RehearsalError(f"{what} failed (exit {done.returncode}):\n  {shlex.join(argv)}\n{(done.stdout + done.stderr)[-3000:]}")
    print(f"  ok in {time.time() - t0:.0f} s", flush=True)
    return done.stdout


def serve(argv: list[str], env: dict, port: int, cwd: str = ROOT):
    """Start the README's retrieval server in the background; return it once it answers."""
    print(f"$ {shlex.join(argv)} &", flush=True)
    server = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for _ in range(240):
        if server.poll() is not None:
            raise RehearsalError(f"the retrieval server stopped (exit {server.returncode}):\n  {shlex.join(argv)}\n"
                                 f"{server.stdout.read()[-3000:]}")
        try:
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/search", data=b'{"query": "x"}'), timeout=5)
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise RehearsalError(f"the retrieval server did not answer within 2 minutes:\n  {shlex.join(argv)}")


# ---------------------------------------------------------------------------------------------
# 3. What each command must leave
# ---------------------------------------------------------------------------------------------
def metric_steps(output_dir: str) -> list[int]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [row["step"] for row in map(json.loads, f) if row.get("phase", "grpo") == "grpo"]


def expect(ok: bool, message: str):
    if not ok:
        raise RehearsalError(message)


def check_training(argv: list[str], steps: int, lora: bool = False):
    expect("--output_dir" in argv, f"a training command without --output_dir: {shlex.join(argv)}")
    out = argv[argv.index("--output_dir") + 1]
    expect(metric_steps(out) == list(range(1, steps + 1)), f"{out}/metrics.jsonl: steps {metric_steps(out)}, not 1..{steps}")
    checkpoint = os.path.join(out, f"checkpoint-{steps}")
    weights = "adapter_config.json" if lora else "config.json"
    expect(os.path.isfile(os.path.join(checkpoint, weights)), f"{checkpoint}: no {weights}")
    return out


def check_evaluation(argv: list[str], benchmarks: list[str]):
    out = argv[argv.index("--output_dir") + 1]
    results = json.load(open(os.path.join(out, "results.json")))
    expect(sorted(results["datasets"]) == sorted(benchmarks), f"{out}/results.json: datasets {sorted(results['datasets'])}")
    expect(all(d["n"] == 2 for d in results["datasets"].values()), f"{out}/results.json: not 2 questions per benchmark")
    expect(results["config"]["world_size"] == 2, f"{out}: evaluated by {results['config']['world_size']} process(es), not 2")
    table = open(os.path.join(out, "results.md")).read()
    expect(table.count("| EM |") >= 1 and "Bamboogle" in table and "MuSiQue" in table, f"{out}/results.md: no main table")


def prepare(work_dir: str, on_gpus: bool = False) -> tuple[dict, "StandInHub", dict]:
    """The tiny models, the stand-in hub, and the environment every command runs in."""
    os.makedirs(work_dir, exist_ok=True)
    model, encoder = tiny_models(work_dir)
    hub = StandInHub(hub_files(encoder, work_dir))
    work = {"dir": work_dir, "model": model, "encoder": encoder, "port": free_port(), "rendezvous": free_port(),
            "on_gpus": on_gpus}
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=os.path.join(work_dir, ".hf"), HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT)
    return work, hub, env


def rehearse(work_dir: str, readme: str = os.path.join(ROOT, "README.md"), on_gpus: bool = False,
             docs: str | None = os.path.join(ROOT, "docs", "reproduce.md")):
    """The README's block on one "machine", then (unless `docs` is None) the two-machine block."""
    from data.questions import PAPER_SPLIT

    commands = readme_commands(readme)
    work, hub, env = prepare(work_dir, on_gpus)
    server, trained = None, {}
    t0 = time.time()
    try:
        for command in commands:
            argv = sized(command, work)
            script = os.path.basename(next((a for a in argv if a.endswith(".py") and not a.startswith("-")), ""))
            if command.rstrip().endswith("&"):
                server = serve(argv, env, work["port"])
            elif script == "download.py":
                out = run(argv, env, "the data download")
                expect(len(hub.gets) == len(hub.files) and "Next:" in out, f"download: got {len(hub.gets)} of {len(hub.files)} files")
            elif script == "train.py" and "--lora_rank" in argv:
                run(argv, env, "LoRA training")
                trained["lora"] = check_training(argv, 2, lora=True)
            elif script == "train.py":
                out = run(argv, env, "training")
                sharded = "--use_fsdp" not in argv or "2 process(es), FSDP" in out
                expect(sharded, f"FSDP asked for, but train.py reported:\n{out[:500]}")
                check_training(argv, 2)
                trained["full"] = check_training(run_resumed([argv], env, [ROOT])[0], 3)
            elif script == "evaluate.py":
                run(argv, env, "evaluation")
                check_evaluation(argv, list(PAPER_SPLIT))
            else:
                run(argv, env, f"the README's command {command!r}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    expect({"full", "lora"} <= set(trained), f"the README's block trained {sorted(trained)}: not a full and a LoRA run")
    print(f"rehearsal passed in {time.time() - t0:.0f} s: {len(commands)} commands of the README, in {work_dir}")
    if docs:
        rehearse_two_machines(work, env, docs)


def run_resumed(argvs: list[list[str]], env: dict, cwds: list[str]) -> list[list[str]]:
    """The training command(s) interrupted after step 2: the same with --resume, to step 3."""
    longer = [a[:] for a in argvs]
    for a in longer:
        a[a.index("--max_steps") + 1] = "3"
        a.append("--resume")
    if len(longer) == 1:
        run(longer[0], env, "the resumed training", cwd=cwds[0])
    else:
        run_pair(longer, env, "the resumed training on two machines", cwds)
    expect(metric_steps(longer[0][longer[0].index("--output_dir") + 1])[-1] == 3, "the resumed run did not log step 3")
    return longer


# ---------------------------------------------------------------------------------------------
# 4. Two machines: docs/reproduce.md's block, a launcher per "machine" folder, the run folder shared
# ---------------------------------------------------------------------------------------------
def machine_steps(commands: list[str]) -> list[list[str]]:
    """The block as steps: a line without --machine_rank alone, a machine-0 line with the machine-1
    line that follows it (the same line but for its rank) as a pair."""
    steps, k = [], 0
    while k < len(commands):
        line = commands[k]
        if "--machine_rank" not in line:
            steps.append([line])
            k += 1
            continue
        pair = commands[k:k + 2]
        same = len(pair) == 2 and re.sub(r"--machine_rank \d+", "", pair[0]) == re.sub(r"--machine_rank \d+", "", pair[1])
        expect(same and "--machine_rank 0" in pair[0] and "--machine_rank 1" in pair[1],
               "two-machine block: a --machine_rank 0 line must be followed by the same line with --machine_rank 1:\n  "
               + "\n  ".join(pair))
        steps.append(pair)
        k += 2
    return steps


def launch_pair(argvs: list[list[str]], env: dict, cwds: list[str], timeout: int = 300) -> list[tuple[int, str]]:
    """Both machines' launchers at once, each in its folder; (exit code, output) of each."""
    for argv, cwd in zip(argvs, cwds):
        print(f"$ (cd {cwd}) {shlex.join(argv)} &", flush=True)
    procs = [subprocess.Popen(a, cwd=c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for a, c in zip(argvs, cwds)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RehearsalError(f"no end after {timeout} s on two machines:\n  " + "\n  ".join(map(shlex.join, argvs))) from None
    return [(p.returncode, out) for p, out in zip(procs, outputs)]


def run_pair(argvs: list[list[str]], env: dict, what: str, cwds: list[str]) -> list[str]:
    t0 = time.time()
    results = launch_pair(argvs, env, cwds)
    for machine, (argv, (code, out)) in enumerate(zip(argvs, results)):
        if code:
            raise RehearsalError(f"{what} failed on machine {machine} (exit {code}):\n  {shlex.join(argv)}\n{out[-3000:]}")
    print(f"  ok in {time.time() - t0:.0f} s", flush=True)
    return [out for _, out in results]


def check_unshared_folder_stops_both(argvs: list[list[str]], env: dict, cwds: list[str]):
    """The training pair with the same relative --output_dir in each machine's folder: two folders,
    so both machines must stop at start-up with train.py's error naming it."""
    unshared = [a[:] for a in argvs]
    for a in unshared:
        a[a.index("--output_dir") + 1] = os.path.join("runs", "not-shared")
    t0 = time.time()
    for machine, (code, out) in enumerate(launch_pair(unshared, env, cwds, timeout=120)):
        expect(code != 0 and "--output_dir runs/not-shared is not one folder for every machine" in out,
               f"a --output_dir that the two machines do not share: machine {machine} gave (exit {code}):\n{out[-2000:]}")
    print(f"  both machines stopped, naming the folder, in {time.time() - t0:.0f} s", flush=True)


def rehearse_two_machines(work: dict, env: dict, docs: str):
    """docs/reproduce.md's "Two machines" block, run as written but for sizes (the module docstring, 4)."""
    from data.questions import PAPER_SPLIT

    t0 = time.time()
    steps = machine_steps(two_machine_commands(docs))
    cwds = [os.path.join(work["dir"], f"machine{k}") for k in (0, 1)]
    for cwd in cwds:
        os.makedirs(cwd, exist_ok=True)
    work = {**work, "port": free_port()}
    server, trained = None, False
    try:
        for step in steps:
            work["rendezvous"] = free_port()
            argvs = [sized(line, work, machine=True) for line in step]
            script = os.path.basename(next((a for a in argvs[0] if a.endswith(".py") and not a.startswith("-")), ""))
            if step[0].rstrip().endswith("&"):
                server = serve(argvs[0], env, work["port"], cwd=cwds[0])
            elif len(step) == 1:  # a line for each machine (the download), in its own folder
                for cwd in cwds:
                    run(argvs[0], env, f"the block's command {step[0]!r}", cwd=cwd)
            elif script == "train.py":
                check_unshared_folder_stops_both(argvs, env, cwds)
                outs = run_pair(argvs, env, "training on two machines", cwds)
                expect("2 process(es), FSDP" in outs[0], f"FSDP over two machines asked for, but train.py reported:\n{outs[0][:500]}")
                check_training(argvs[0], 2)
                check_training(run_resumed(argvs, env, cwds)[0], 3)
                trained = True
            elif script == "evaluate.py":
                run_pair(argvs, env, "evaluation on two machines", cwds)
                check_evaluation(argvs[0], list(PAPER_SPLIT))
            else:
                run_pair(argvs, env, f"the block's pair {step[0]!r}", cwds)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    expect(trained, f"{docs}: the two-machine block has no training pair")
    print(f"two-machine rehearsal passed in {time.time() - t0:.0f} s: {sum(map(len, steps))} lines of {docs}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=None, help="the folder everything lands in (default: a temporary one, removed after)")
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    ap.add_argument("--docs", default=os.path.join(ROOT, "docs", "reproduce.md"), help="the page with the two-machine block")
    ap.add_argument("--on_gpus", action="store_true", help="2 GPUs or more: the same sequence over NCCL (tools/gpu_check.py)")
    args = ap.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="rehearsal-")
    try:
        rehearse(os.path.abspath(work), args.readme, args.on_gpus, args.docs)
    except RehearsalError as e:
        raise SystemExit(f"rehearsal failed: {e}") from None
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
