"""Benchmark retriever.py: FAISS flat search vs a numpy baseline, the offset-table corpus, the
memory-mapped index, and the server's request batching.

    python bench/retriever.py [--n 1000000] [--dim 384] [--topk 10] [--lines 1000000]
                              [--parts search corpus mmap server]

Prints, from one run:
1. search: queries/s of faiss.IndexFlatIP at query batch 1 and 64 against numpy (matmul +
   argpartition) on the same unit vectors, with the ratio; the bytes of database scanned per second
   against the machine's memory copy bandwidth measured in the same run;
2. corpus: peak RSS of opening an N-line jsonl corpus through `retriever.Corpus` (offset table,
   first build and cached) against reading every line into a Python list (each in a fresh process);
3. mmap: two processes at once opening (and searching) an N x dim flat index, read plainly vs
   memory-mapped (`retriever.read_index`): open time, peak RSS and the shared/private split of
   each process's memory from /proc/<pid>/smaps_rollup, as ratios; then open + first search of
   one process on a cold page cache (the file evicted), plain vs memory-mapped;
4. server: queries/s of `retriever.make_server` on the embedded encoder, with 8 concurrent clients
   each sending 8 queries per request, request batching on vs off; over the toy corpus alone (the
   encoder dominates) and over a flat index padded to --server_rows (the scan dominates, as at scale).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
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


MMAP_CHILD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, {root!r})
import retriever  # imported in both modes, before the baseline (torch and faiss are large)

def rollup():  # MB, from /proc/self/smaps_rollup: Rss, Pss, Private_*, Shared_*
    out = {{}}
    for line in open("/proc/self/smaps_rollup"):
        f = line.split()
        if len(f) == 3 and f[2] == "kB":
            out[f[0].rstrip(":")] = int(f[1]) / 1024
    out["Private"] = out["Private_Clean"] + out["Private_Dirty"]
    out["Shared"] = out["Shared_Clean"] + out["Shared_Dirty"]
    return out

def hwm():  # peak RSS, MB
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) / 1024

mode, path = sys.argv[1], sys.argv[2]
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark to the current RSS
base = rollup()
t = time.perf_counter()
index = retriever.read_index(path, mmap=mode == "mmap")
t_open = time.perf_counter() - t
query = np.ones((1, index.d), dtype=np.float32) / np.sqrt(index.d)
t = time.perf_counter()
index.search(query, 10)  # a flat search reads every vector once
t_search = time.perf_counter() - t
print("ready", flush=True)
sys.stdin.readline()  # measured while both processes hold the index
now = rollup()
print(json.dumps({{"open_s": t_open, "search_s": t_search, "peak_mb": hwm(), "base": base, "now": now}}), flush=True)
"""


def bench_mmap(n, dim):
    import faiss

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "flat.index")
        rng = np.random.default_rng(0)
        index = faiss.IndexFlatIP(dim)
        for s in range(0, n, 100_000):
            x = rng.standard_normal((min(100_000, n - s), dim), dtype=np.float32)
            index.add(x / np.linalg.norm(x, axis=1, keepdims=True))
        faiss.write_index(index, path)
        del index
        size_mb = os.path.getsize(path) / 2**20
        script = MMAP_CHILD.format(root=ROOT)

        def processes(mode, count=2):
            procs = [subprocess.Popen([sys.executable, "-c", script, mode, path], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True) for _ in range(count)]
            for p in procs:
                assert p.stdout.readline().strip() == "ready"
            outs = []
            for p in procs:
                p.stdin.write("\n")
                p.stdin.flush()
                outs.append(json.loads(p.stdout.readline()))
            for p in procs:
                p.wait()
            return outs

        print(f"\n== Two processes at once opening a {n:,} x {dim} flat index ({size_mb:.0f} MB; in the page "
              "cache), then one search each; memory per process (MB) while both hold it")
        print(f"{'read':>6} | {'proc':>4} | {'open s':>7} | {'1st search s':>12} | {'peak RSS':>8} | {'Rss':>7} | "
              f"{'Pss':>7} | {'private':>7} | {'shared':>7} | {'private growth':>14}")
        rows = {}
        for mode in ("plain", "mmap"):
            rows[mode] = processes(mode)
            for i, r in enumerate(rows[mode]):
                now, grow = r["now"], r["now"]["Private"] - r["base"]["Private"]
                print(f"{mode:>6} | {i:>4} | {r['open_s']:>7.4f} | {r['search_s']:>12.3f} | {r['peak_mb']:>8.0f} | "
                      f"{now['Rss']:>7.0f} | {now['Pss']:>7.0f} | {now['Private']:>7.0f} | {now['Shared']:>7.0f} | {grow:>14.1f}")

        def mean(mode, f):
            return sum(f(r) for r in rows[mode]) / 2

        def ratio(f):
            return mean("mmap", f) / mean("plain", f)

        print(f"mmap / plain, per process: open time {ratio(lambda r: r['open_s']):.2g}x, "
              f"private memory {ratio(lambda r: r['now']['Private']):.3f}x "
              f"(its growth from opening the index {ratio(lambda r: r['now']['Private'] - r['base']['Private']):.2g}x), "
              f"Pss {ratio(lambda r: r['now']['Pss']):.2f}x, peak RSS {ratio(lambda r: r['peak_mb']):.2f}x "
              "(RSS counts the shared page-cache pages in every process)")
        print("cold page cache (this file evicted with POSIX_FADV_DONTNEED), one process:")
        for mode in ("plain", "mmap"):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            r = processes(mode, count=1)[0]
            print(f"  {mode:>5}: open {r['open_s']:.4f} s, first search {r['search_s']:.3f} s, "
                  f"together {r['open_s'] + r['search_s']:.2f} s")


class PaddedCorpus:
    """The toy corpus followed by filler rows, so the index can be node-sized (see bench_server)."""

    def __init__(self, corpus, rows):
        self.corpus, self.rows, self.path = corpus, rows, f"{corpus.path} + filler"

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        return self.corpus[i] if i < len(self.corpus) else {"id": str(i), "contents": "filler"}


def padded_retriever(local, rows, seed=0):
    """`local`'s passages plus random unit vectors up to `rows` in one flat index: every search scans
    rows x dim floats, as a wiki-18 index makes it do, so FAISS rather than the encoder dominates."""
    import faiss
    import retriever
    index = faiss.IndexFlatIP(local.index.d)
    index.add(local.index.reconstruct_n(0, local.index.ntotal))
    rng = np.random.default_rng(seed)
    for start in range(local.index.ntotal, rows, 100_000):
        x = rng.standard_normal((min(100_000, rows - start), local.index.d), dtype=np.float32)
        index.add(x / np.linalg.norm(x, axis=1, keepdims=True))
    return retriever.Retriever(PaddedCorpus(local.corpus, rows), index, local.encoder, doc_format=local.doc_format)


def bench_server(rows=0, clients=8, per_request=8, rounds=4, repeats=3):
    sys.path.insert(0, ROOT)
    import retriever

    local = retriever.open_retriever()  # the embedded default: MiniLM and the toy corpus
    what_index = f"the toy corpus ({len(local.corpus):,} passages)"
    if rows > len(local.corpus):
        local = padded_retriever(local, rows)
        what_index = f"the toy corpus padded with random unit vectors to a {rows:,}-row flat index"
    with open(os.path.join(os.path.dirname(retriever.DEFAULT_CORPUS), "test.jsonl")) as f:
        questions = [json.loads(line)["question"] for line in f]
    print(f"\n== Server throughput: {clients} concurrent clients x {rounds} requests x {per_request} queries, "
          f"top-5, MiniLM on {what_index}; best of {repeats}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs before")
    print(f"{'API':>36} | {'batching off q/s':>16} | {'on (5 ms) q/s':>13} | {'on / off':>8}")
    for api, what in (("retrieve", "/retrieve, 8 queries a request"), ("search", "/search, 1 query a request (x8)")):
        qps = {}
        for window in (0, 5):
            server = retriever.make_server(local, "127.0.0.1", 0, batch_window_ms=window)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            remote = retriever.RemoteRetriever(f"http://127.0.0.1:{server.server_address[1]}", api=api)

            def client(c):
                for r in range(rounds):
                    s = ((c * rounds + r) * per_request) % (len(questions) - per_request)
                    remote.search(questions[s:s + per_request], 5)

            def all_clients():
                threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
                t = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                return time.perf_counter() - t

            all_clients()  # warm-up
            qps[window] = clients * rounds * per_request / min(all_clients() for _ in range(repeats))
            server.shutdown()
            server.server_close()
        print(f"{what:>36} | {qps[0]:>16.1f} | {qps[5]:>13.1f} | {qps[5] / qps[0]:>7.2f}x")
    print(f"load average {os.getloadavg()[0]:.1f} after (other processes share these CPUs)")


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="database vectors (search and mmap)")
    ap.add_argument("--dim", type=int, default=384, help="vector dimension (MiniLM: 384; e5-base: 768)")
    ap.add_argument("--topk", type=int, default=10)
    ap.add_argument("--lines", type=int, default=1_000_000, help="corpus lines for the RSS benchmark")
    ap.add_argument("--server_rows", nargs="+", type=int, default=[0, 1_000_000],
                    help="index rows for the server part: 0 = the toy corpus alone (the encoder dominates); "
                         "1000000 = padded to a node-sized flat index (search dominates, as with wiki-18)")
    ap.add_argument("--parts", nargs="+", choices=["search", "corpus", "mmap", "server"],
                    default=["search", "corpus", "mmap", "server"])
    args = ap.parse_args()
    import faiss
    print(f"machine: {os.cpu_count()} CPUs ({cpu_model()}); faiss-cpu {faiss.__version__}, numpy {np.__version__}")
    if "search" in args.parts:
        bench_search(args.n, args.dim, args.topk)
    if "corpus" in args.parts:
        bench_corpus(args.lines)
    if "mmap" in args.parts:
        bench_mmap(args.n, args.dim)
    if "server" in args.parts:
        for rows in args.server_rows:
            bench_server(rows)


if __name__ == "__main__":
    main()
