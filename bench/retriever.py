"""Benchmark retriever.py: FAISS flat search vs a numpy baseline, and the offset-table corpus.

    python bench/retriever.py [--n 1000000] [--dim 384] [--topk 10] [--lines 1000000]

Prints, from one run:
1. queries/s of faiss.IndexFlatIP at query batch 1 and 64 against numpy (matmul + argpartition)
   on the same unit vectors, with the ratio; the bytes of database scanned per second against the
   machine's memory copy bandwidth measured in the same run;
2. peak RSS of opening an N-line jsonl corpus through `retriever.Corpus` (offset table, first
   build and cached) against reading every line into a Python list (each in a fresh process).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def best_qps(search, queries, batch, repeats):
    """Best of `repeats` timings of searching all `queries` in batches of `batch` -> queries/s."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for s in range(0, len(queries), batch):
            search(queries[s:s + batch])
        best = min(best, time.perf_counter() - t)
    return len(queries) / best


def numpy_search(xb, k):
    def search(q):
        scores = q @ xb.T  # [b, n]
        top = np.argpartition(-scores, k, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, top, 1), axis=1)
        return np.take_along_axis(top, order, 1)
    return search


def copy_bandwidth(nbytes=1 << 30):
    """GB/s of a large memory copy (bytes read + bytes written), best of 3."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def bench_search(n, dim, k):
    import faiss

    rng = np.random.default_rng(0)
    xb = rng.standard_normal((n, dim), dtype=np.float32)
    xb /= np.linalg.norm(xb, axis=1, keepdims=True)
    index = faiss.IndexFlatIP(dim)
    index.add(xb)
    queries = rng.standard_normal((256, dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    # the two agree on the hits (ties aside) before we time them
    _, ids = index.search(queries[:8], k)
    agree = np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, numpy_search(xb, k)(queries[:8]))])
    bw = copy_bandwidth()
    db_gb = xb.nbytes / 1e9
    print(f"\n== Flat inner-product search: {n:,} x {dim} float32 ({db_gb:.2f} GB), top-{k}, "
          f"{faiss.omp_get_max_threads()} threads; hit agreement faiss/numpy {agree:.3f}")
    print(f"{'query batch':>11} | {'faiss q/s':>10} | {'numpy q/s':>10} | {'faiss/numpy':>11} | {'faiss scan GB/s':>15} | {'of copy bw':>10}")
    for batch, nq, reps in [(1, 16, 3), (64, 256, 3)]:
        f_qps = best_qps(lambda q: index.search(q, k), queries[:nq], batch, reps)
        n_qps = best_qps(numpy_search(xb, k), queries[:nq], batch, reps)
        scan = f_qps / batch * db_gb  # each batch of queries reads the whole database once
        print(f"{batch:>11} | {f_qps:>10.1f} | {n_qps:>10.1f} | {f_qps / n_qps:>10.2f}x | {scan:>15.2f} | {scan / bw:>9.0%}")
    print(f"memory copy bandwidth (read + write): {bw:.2f} GB/s")


CHILD = r"""
import json, sys
sys.path.insert(0, {root!r})
import retriever  # imported in both modes, before the baseline (torch and faiss are large)

def status(key):  # kB, from /proc/self/status
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])

mode, path = sys.argv[1], sys.argv[2]
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
base = status("VmRSS:")
if mode == "list":
    with open(path) as f:
        rows = f.readlines()
    probe = json.loads(rows[len(rows) // 2])
else:
    rows = retriever.Corpus(path)
    probe = rows[len(rows) // 2]
print(json.dumps({{"lines": len(rows), "delta_mb": (status("VmHWM:") - base) / 1024}}))
"""


def bench_corpus(lines):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "corpus.jsonl")
        rng = np.random.default_rng(0)
        words = np.array([f"word{i}" for i in range(5000)])
        with open(path, "w") as f:
            for s in range(0, lines, 10000):
                ids = rng.integers(0, len(words), (min(10000, lines - s), 16))
                f.writelines(json.dumps({"id": str(s + i), "contents": f'"Title {s + i}"\n' + " ".join(words[row])}) + "\n"
                             for i, row in enumerate(ids))
        size_mb = os.path.getsize(path) / 2**20
        script = CHILD.format(root=ROOT)

        def run(mode):
            out = subprocess.run([sys.executable, "-c", script, mode, path], capture_output=True, text=True, check=True)
            return json.loads(out.stdout)

        t = time.perf_counter(); first = run("offsets"); t_first = time.perf_counter() - t
        t = time.perf_counter(); cached = run("offsets"); t_cached = time.perf_counter() - t
        t = time.perf_counter(); plain = run("list"); t_list = time.perf_counter() - t
        print(f"\n== Opening a {lines:,}-line corpus ({size_mb:.0f} MB): peak RSS growth while opening it")
        print(f"{'method':>30} | {'RSS growth MB':>13} | {'process s':>9}")
        print(f"{'offset table, first open':>30} | {first['delta_mb']:>13.1f} | {t_first:>9.2f}")
        print(f"{'offset table, cached':>30} | {cached['delta_mb']:>13.1f} | {t_cached:>9.2f}")
        print(f"{'list of every line':>30} | {plain['delta_mb']:>13.1f} | {t_list:>9.2f}")
        print(f"list / offset table (cached): {plain['delta_mb'] / max(cached['delta_mb'], 1e-9):.1f}x the memory")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="database vectors")
    ap.add_argument("--dim", type=int, default=384, help="vector dimension (MiniLM: 384; e5-base: 768)")
    ap.add_argument("--topk", type=int, default=10)
    ap.add_argument("--lines", type=int, default=1_000_000, help="corpus lines for the RSS benchmark")
    args = ap.parse_args()
    import faiss
    print(f"machine: {os.cpu_count()} CPUs; faiss-cpu {faiss.__version__}, numpy {np.__version__}")
    bench_search(args.n, args.dim, args.topk)
    bench_corpus(args.lines)


if __name__ == "__main__":
    main()
