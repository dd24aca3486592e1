"""retriever.py: encoder, offset-table corpus, flat index (plain and memory-mapped), document
renderings, the /retrieve and /search HTTP APIs (server with batching, and client)."""
import json
import os
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import urllib.error
import urllib.request

import faiss
import numpy as np
import pytest
import torch

import retriever as R

PASSAGES = [
    ("Velmora Quint", "Velmora Quint is a painter born in 1871 in the town of Osk."),
    ("Osk", "Osk is a river town in the kingdom of Tamberlay, founded in 902."),
    ("Drakken Mills", "Drakken Mills is a paper company founded by Ivo Sarn in 1903."),
    ("Ivo Sarn", "Ivo Sarn was an industrialist who married the poet Lise Amber."),
    ("Lise Amber", "Lise Amber wrote the novel The Glass Orchard in 1922."),
    ("The Glass Orchard", "The Glass Orchard is a novel about an orchard made of glass."),
    ("Tamberlay", "Tamberlay is a mountain kingdom whose capital is Vey."),
    ("Vey", "Vey sits on the river Olm and hosts the Winter Lantern Fair."),
]


def write_corpus(path, flashrag=False, trailing_newline=True):
    with open(path, "w") as f:
        lines = []
        for i, (title, text) in enumerate(PASSAGES):
            row = {"id": str(i), "title": title, "text": text} if flashrag else {"id": str(i), "contents": f'"{title}"\n{text}'}
            lines.append(json.dumps(row))
        f.write("\n".join(lines) + ("\n" if trailing_newline else ""))
    return str(path)


@pytest.fixture(scope="module")
def encoder(tiny_encoder_dir):
    return R.Encoder(tiny_encoder_dir, batch_size=3)


@pytest.fixture(scope="module")
def local(tmp_path_factory, encoder):
    d = tmp_path_factory.mktemp("corpus")
    corpus = R.Corpus(write_corpus(d / "corpus.jsonl"))
    index = R.build_index(corpus, encoder, str(d / "test_Flat.index"))
    return R.Retriever(corpus, index, encoder)


# --- encoder -------------------------------------------------------------------------------------
def test_encoder_outputs_unit_vectors_independent_of_batching(encoder):
    texts = [t for _, t in PASSAGES]
    v = encoder.encode(texts)
    assert v.shape == (len(texts), encoder.dim) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    one_by_one = np.concatenate([encoder.encode([t]) for t in texts])  # no padding at batch 1
    np.testing.assert_allclose(v, one_by_one, atol=1e-5)


def test_encoder_ignores_a_callers_autocast(encoder):
    """The training loop searches inside bf16 autocast; the queries must still be encoded as the
    passages were (float32 on CPU, no autocast): bit for bit the same vectors."""
    texts = [t for _, t in PASSAGES]
    plain = encoder.encode(texts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = encoder.encode(texts)
        assert torch.is_autocast_enabled("cpu")  # the caller's autocast is still on afterwards
    assert np.array_equal(inside, plain)


def test_prefixes_only_for_e5_named_encoders(tiny_encoder_dir, tmp_path):
    assert R.default_prefixes("intfloat/e5-base-v2") == ("query: ", "passage: ")
    assert R.default_prefixes("/models/E5-large") == ("query: ", "passage: ")
    assert R.default_prefixes("sentence-transformers/all-MiniLM-L6-v2") == ("", "")
    e5_dir = tmp_path / "tiny-e5-base"
    shutil.copytree(tiny_encoder_dir, e5_dir)
    e5 = R.Encoder(str(e5_dir))
    plain = R.Encoder(tiny_encoder_dir)
    assert (e5.query_prefix, e5.passage_prefix) == ("query: ", "passage: ")
    assert (plain.query_prefix, plain.passage_prefix) == ("", "")
    # the prefix really reaches the model: e5("x", query) == plain("query: x")
    np.testing.assert_allclose(e5.encode(["osk river"], "query"), plain.encode(["query: osk river"]), atol=1e-5)
    np.testing.assert_allclose(e5.encode(["osk river"], "passage"), plain.encode(["passage: osk river"]), atol=1e-5)
    custom = R.Encoder(str(e5_dir), query_prefix="Q> ", passage_prefix="")
    assert (custom.query_prefix, custom.passage_prefix) == ("Q> ", "")


# --- corpus --------------------------------------------------------------------------------------
@pytest.mark.parametrize("trailing_newline", [True, False])
def test_offset_table_corpus_equals_plain_read(tmp_path, trailing_newline):
    path = write_corpus(tmp_path / "c.jsonl", trailing_newline=trailing_newline)
    plain = [json.loads(line) for line in open(path)]
    corpus = R.Corpus(path)
    assert len(corpus) == len(plain)
    assert [corpus[i] for i in range(len(corpus))] == [{"id": r["id"], "contents": r["contents"]} for r in plain]
    assert os.path.isfile(path + ".offsets.npy")
    again = R.Corpus(path)  # from the cache
    np.testing.assert_array_equal(again.offsets, corpus.offsets)


def test_offset_table_with_tiny_chunks_matches(tmp_path):
    path = write_corpus(tmp_path / "c.jsonl")
    np.testing.assert_array_equal(R.line_offsets(path, chunk_bytes=7), R.line_offsets(path))


def test_offset_cache_is_rebuilt_when_corpus_changes(tmp_path):
    path = write_corpus(tmp_path / "c.jsonl")
    assert len(R.Corpus(path)) == len(PASSAGES)
    with open(path, "a") as f:
        f.write(json.dumps({"id": "8", "contents": '"New"\nA new passage.'}) + "\n")
    corpus = R.Corpus(path)
    assert len(corpus) == len(PASSAGES) + 1 and corpus[8]["contents"].startswith('"New"')


def test_flashrag_rows_read_as_contents(tmp_path):
    corpus = R.Corpus(write_corpus(tmp_path / "f.jsonl", flashrag=True))
    assert corpus[1] == {"id": "1", "contents": '"Osk"\n' + PASSAGES[1][1]}


def test_bad_corpus_lines_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "0", "contents": "\\"A\\"\\ntext"}\nnot json\n{"id": "2"}\n')
    corpus = R.Corpus(str(path))
    assert corpus[0]["contents"] == '"A"\ntext'
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object"):
        corpus[1]
    with pytest.raises(ValueError, match=r"bad.jsonl:3: expected a `contents`"):
        corpus[2]
    with pytest.raises(IndexError):
        corpus[3]


def test_format_docs_search_r1_style():
    hits = [{"contents": '"Osk"\nOsk is a town.'}, {"contents": "no title here"}]
    assert R.format_docs(hits) == 'Doc 1(Title: "Osk") Osk is a town.\nDoc 2(Title: "") no title here'
    assert R.render_docs(hits, "search-r1") == R.format_docs(hits)


def test_format_docs_release_style_keeps_the_literal_backslash_n():
    hits = [{"contents": '"Osk"\nOsk is a town.'}, {"contents": "no title here"}]
    # raw contents, each followed by backslash, n, backslash, n (four characters), then .strip()
    expected = '"Osk"\nOsk is a town.' + "\\" + "n" + "\\" + "n" + "no title here" + "\\" + "n" + "\\" + "n"
    assert expected == r'"Osk"' + "\n" + r"Osk is a town.\n\nno title here\n\n"
    assert R.format_docs_release(hits) == R.render_docs(hits, "release") == expected
    # .strip() trims only the start here: the text always ends in the literal backslash-n
    assert R.format_docs_release([{"contents": " \n padded \n"}]) == "padded \n" + r"\n\n"
    assert R.format_docs_release([]) == ""
    with pytest.raises(ValueError, match="doc_format must be one of search-r1, release"):
        R.render_docs(hits, "markdown")
    assert R.DOC_FORMATS == ("search-r1", "release")


# --- index and search ----------------------------------------------------------------------------
def test_every_passage_retrieves_itself_first(local):
    texts = [local.corpus[i]["contents"] for i in range(len(local.corpus))]
    hits = local.search(texts, topk=3)
    assert [h[0].id for h in hits] == [str(i) for i in range(len(texts))]


def test_scores_in_range_and_sorted(local):
    for row in local.search(["who founded a paper company", "river town"], topk=len(PASSAGES)):
        scores = [h.score for h in row]
        assert len(row) == len(PASSAGES)
        assert all(-1.0 - 1e-5 <= s <= 1.0 + 1e-5 for s in scores)
        assert scores == sorted(scores, reverse=True)


def test_call_renders_per_query_topk(local):
    assert local.doc_format == "search-r1"
    docs = local(["paper company", "glass"], topk=[1, 3])
    assert docs[0].count("\n") == 0 and docs[0].startswith("Doc 1(Title: ")
    assert docs[1].count("\n") == 2 and "Doc 3(Title: " in docs[1]
    assert local([]) == []


def test_call_renders_in_the_release_format(local):
    release = R.Retriever(local.corpus, local.index, local.encoder, doc_format="release")
    hits = local.search(["glass"], 2)[0]
    expected = hits[0].contents + r"\n\n" + hits[1].contents + r"\n\n"
    assert release(["glass"], [2]) == [expected]
    with pytest.raises(ValueError, match="doc_format"):
        R.Retriever(local.corpus, local.index, local.encoder, doc_format="Release")


def test_mmap_index_equals_plain_read(tmp_path, local):
    path = str(tmp_path / "flat.index")
    faiss.write_index(local.index, path)
    queries = local.encoder.encode(["paper company", "river town", "glass novel"])
    plain, mapped = R.read_index(path, mmap=False), R.read_index(path)
    assert mapped.ntotal == plain.ntotal == len(PASSAGES)
    for a, b in zip(plain.search(queries, 5), mapped.search(queries, 5)):
        np.testing.assert_array_equal(a, b)
    if os.path.isfile("/proc/self/maps") and hasattr(faiss, "IO_FLAG_MMAP_IFC"):
        maps = open("/proc/self/maps").read()
        assert path in maps  # the vectors really are mapped from the file, not copied
    # through open_retriever: identical hits either way
    m = R.open_retriever(corpus=local.corpus.path, index=path, encoder=local.encoder.name)
    p = R.open_retriever(corpus=local.corpus.path, index=path, encoder=local.encoder.name, mmap=False)
    qs = ["who founded a paper company", "mountain kingdom"]
    assert [[(h.id, h.score) for h in row] for row in m.search(qs, 4)] == [[(h.id, h.score) for h in row] for row in p.search(qs, 4)]


def test_search_command_prints_the_chosen_doc_format(tmp_path, tiny_encoder_dir, capsys):
    path = write_corpus(tmp_path / "c.jsonl")
    R.main(["search", "--corpus", path, "--encoder", tiny_encoder_dir, "--topk", "2", "--doc_format", "release", "glass"])
    out = capsys.readouterr().out
    assert out.startswith("query: glass\n") and out.count(r"\n\n") == 2  # two documents, each + backslash-n x2
    R.main(["search", "--corpus", path, "--encoder", tiny_encoder_dir, "--topk", "2", "--doc_format", "search-r1", "glass"])
    assert capsys.readouterr().out.count("(Title: ") == 2


def test_the_command_line_puts_the_encoder_on_the_device_named(tmp_path, tiny_encoder_dir, monkeypatch):
    """`retriever.py serve|search|build --device D`: the query encoder lands on D (a multi-GPU node
    serves from the GPU it names, not cuda:0 whatever the rank)."""
    path = write_corpus(tmp_path / "c.jsonl")
    devices = []
    encoder = R.Encoder
    monkeypatch.setattr(R, "Encoder", lambda name, device=None, **k: devices.append(device) or encoder(name, device=device, **k))
    R.main(["build", "--corpus", path, "--encoder", tiny_encoder_dir, "--device", "cpu"])
    R.main(["search", "--corpus", path, "--encoder", tiny_encoder_dir, "--device", "cpu", "glass"])
    assert devices == ["cpu", "cpu"]


def test_faiss_gpu_is_a_clear_error_without_a_gpu_build_and_shards_in_float16_with_one(tmp_path, tiny_encoder_dir,
                                                                                         capsys, monkeypatch):
    """`--faiss_gpu` on faiss-cpu stops with a message naming the fix; on a GPU build (here a stand-in
    for faiss's GPU calls) the index is sharded over the GPUs in float16 and searched there."""
    path = write_corpus(tmp_path / "c.jsonl")
    R.main(["build", "--corpus", path, "--encoder", tiny_encoder_dir])
    capsys.readouterr()
    with pytest.raises(SystemExit, match="no GPU support or sees no GPU.*faiss-gpu"):
        R.main(["search", "--corpus", path, "--encoder", tiny_encoder_dir, "--faiss_gpu", "glass"])

    class Options:
        shard = useFloat16 = False
    moved = []
    monkeypatch.setattr(faiss, "GpuMultipleClonerOptions", Options, raising=False)
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 2)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", lambda index, co: moved.append((co.shard, co.useFloat16)) or index,
                        raising=False)
    R.main(["search", "--corpus", path, "--encoder", tiny_encoder_dir, "--faiss_gpu", "--topk", "1", "glass"])
    assert moved == [(True, True)] and capsys.readouterr().out.startswith("query: glass\n")


def test_read_index_falls_back_without_the_mmap_flag(tmp_path, local, monkeypatch):
    path = str(tmp_path / "flat.index")
    faiss.write_index(local.index, path)
    monkeypatch.delattr(faiss, "IO_FLAG_MMAP_IFC", raising=False)
    assert R.read_index(path).ntotal == len(PASSAGES)


def test_corpus_index_mismatch_is_a_clear_error(tmp_path, local, encoder):
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(open(local.corpus.path).read().splitlines()[:5]) + "\n")
    with pytest.raises(ValueError, match="index has 8 rows but corpus .* has 5 lines"):
        R.Retriever(R.Corpus(str(short)), local.index, encoder)
    with pytest.raises(ValueError, match="dim"):
        wrong_dim = faiss.IndexFlatIP(7)
        wrong_dim.add(np.zeros((len(local.corpus), 7), dtype=np.float32))
        R.Retriever(local.corpus, wrong_dim, encoder)


def test_open_retriever_builds_caches_and_rebuilds_stale_index(tmp_path, tiny_encoder_dir):
    path = write_corpus(tmp_path / "c.jsonl")
    r1 = R.open_retriever(corpus=path, encoder=tiny_encoder_dir)
    assert r1.doc_format == "search-r1"
    assert R.open_retriever(corpus=path, encoder=tiny_encoder_dir, doc_format="release").doc_format == "release"
    index_path = R.default_index_path(path, tiny_encoder_dir)
    assert os.path.isfile(index_path) and r1.index.ntotal == len(PASSAGES)
    mtime = os.path.getmtime(index_path)
    R.open_retriever(corpus=path, encoder=tiny_encoder_dir)
    assert os.path.getmtime(index_path) == mtime  # reused
    with open(path, "a") as f:
        f.write(json.dumps({"id": "8", "contents": '"New"\nnew'}) + "\n")
    r3 = R.open_retriever(corpus=path, encoder=tiny_encoder_dir)
    assert r3.index.ntotal == len(PASSAGES) + 1  # stale cache rebuilt
    with pytest.raises(FileNotFoundError, match="index not found"):
        R.open_retriever(corpus=path, index=str(tmp_path / "missing.index"), encoder=tiny_encoder_dir)


# --- HTTP server and client ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(local):
    srv = R.make_server(local, "127.0.0.1", 0)  # port 0: a free port
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def post(url, body: bytes, path="/retrieve"):
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_round_trip_search_r1_format(server, local):
    code, out = post(server, json.dumps({"queries": ["paper company", "kingdom"], "topk": 2, "return_scores": True}).encode())
    assert code == 200 and len(out["result"]) == 2
    expect = local.search(["paper company", "kingdom"], 2)
    for row, hits in zip(out["result"], expect):
        assert [set(item) for item in row] == [{"document", "score"}] * 2
        assert [item["document"] for item in row] == [{"id": h.id, "contents": h.contents} for h in hits]
        np.testing.assert_allclose([item["score"] for item in row], [h.score for h in hits], atol=1e-6)
    code, out = post(server, json.dumps({"queries": ["kingdom"], "topk": 1}).encode())
    assert code == 200 and set(out["result"][0][0]) == {"id", "contents"}  # without scores: documents


@pytest.mark.parametrize("body,message", [
    (b"this is not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b"{}", "queries"),
    (json.dumps({"queries": "one string"}).encode(), "queries"),
    (json.dumps({"queries": [1, 2]}).encode(), "queries"),
    (json.dumps({"queries": ["q"], "topk": 0}).encode(), "topk"),
    (json.dumps({"queries": ["q"], "topk": "3"}).encode(), "topk"),
    (json.dumps({"queries": ["q"], "return_scores": "yes"}).encode(), "return_scores"),
    (json.dumps({"queries": ["lone \ud800 surrogate"]}).encode(), "queries"),  # the tokenizer would fail
])
def test_bad_requests_get_400_and_server_keeps_serving(server, body, message):
    code, out = post(server, body)
    assert code == 400 and message in out["error"]
    code, out = post(server, json.dumps({"queries": ["river"], "topk": 1}).encode())
    assert code == 200 and len(out["result"][0]) == 1


def test_unknown_path_is_404(server):
    code, out = post(server, b"{}", path="/query")
    assert code == 404 and "/retrieve" in out["error"] and "/search" in out["error"]


def test_server_release_search_api(server, local):
    code, out = post(server, json.dumps({"query": "paper company", "top_n": 3}).encode(), path="/search")
    hits = local.search(["paper company"], 3)[0]
    assert code == 200 and isinstance(out, list)
    assert [(d["id"], d["contents"]) for d in out] == [(h.id, h.contents) for h in hits]
    np.testing.assert_allclose([d["score"] for d in out], [h.score for h in hits], atol=1e-6)
    # extra keys of the tool call's arguments are ignored; the path may end in a slash
    code, out = post(server, json.dumps({"query": "glass", "top_n": 1, "other": 1}).encode(), path="/search/")
    assert code == 200 and len(out) == 1


class SpyRetriever(R.Retriever):
    """The local retriever, recording every search; a search containing "boom" fails."""

    def __init__(self, local):
        super().__init__(local.corpus, local.index, local.encoder)
        self.calls = []

    def search(self, queries, topk=5):
        self.calls.append((list(queries), topk))
        if "boom" in queries:
            raise RuntimeError("boom")
        return super().search(queries, topk)


def serve(retriever, **kwargs):
    srv = R.make_server(retriever, "127.0.0.1", 0, **kwargs)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def test_search_api_defaults_top_n_to_10(local):
    spy = SpyRetriever(local)
    srv, url = serve(spy, batch_window_ms=0)
    try:
        code, out = post(url, json.dumps({"query": "kingdom"}).encode(), path="/search")
        assert code == 200 and spy.calls == [(["kingdom"], 10)] and len(out) == len(PASSAGES)  # 8 < 10
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("body,message", [
    (b"not json", "not JSON"),
    (b'["q"]', "JSON object"),
    (b"{}", "query"),
    (json.dumps({"query": ["a list"]}).encode(), "query"),
    (json.dumps({"query": "lone \udc00"}).encode(), "query"),
    (json.dumps({"query": "q", "top_n": 0}).encode(), "top_n"),
    (json.dumps({"query": "q", "top_n": "5"}).encode(), "top_n"),
    (json.dumps({"query": "q", "top_n": True}).encode(), "top_n"),
])
def test_bad_search_requests_get_400(server, body, message):
    code, out = post(server, body, path="/search")
    assert code == 400 and message in out["error"]


GOOD_REQUESTS = [
    ("/retrieve", {"queries": ["paper company", "glass"], "topk": 2, "return_scores": True}),
    ("/retrieve", {"queries": ["river town"], "topk": 5}),
    ("/search", {"query": "mountain kingdom", "top_n": 3}),
    ("/search", {"query": "the poet Lise Amber"}),
    ("/retrieve", {"queries": [], "topk": 1}),
    ("/retrieve", {"queries": ["Vey lantern fair", "Ivo Sarn", "novel"], "topk": 1, "return_scores": True}),
]
BAD_REQUESTS = [
    ("/retrieve", {"queries": ["q"], "topk": 0}),  # 400: never joins the batch
    ("/search", {"query": "boom"}),  # valid, but its search fails (SpyRetriever): 500, alone
]


def comparable(path, out):
    """An answer as (documents, scores) per query, whichever API it came from."""
    rows = [out] if path == "/search" else out["result"]
    rows = [[dict(d["document"], score=d["score"]) if "document" in d else d for d in row] for row in rows]
    return [[(d["id"], d["contents"]) for d in row] for row in rows], [[d.get("score", 0.0) for d in row] for row in rows]


@pytest.mark.parametrize("with_bad", [False, True])
def test_concurrent_requests_are_batched_and_answer_as_alone(local, with_bad):
    """8 client threads at once, both APIs: merged into fewer searches than requests; the good
    answers are those of a server that searches each request alone; bad requests fail alone."""
    extra = [("/search", {"query": "Osk", "top_n": 8}), ("/retrieve", {"queries": ["Tamberlay"], "topk": 4})]
    requests = GOOD_REQUESTS + (BAD_REQUESTS if with_bad else extra)
    spy = SpyRetriever(local)
    batched, url = serve(spy, batch_window_ms=300)  # a wide window: every thread lands in it
    alone, alone_url = serve(local, batch_window_ms=0)
    try:
        answers = [None] * len(requests)
        barrier = threading.Barrier(len(requests))

        def client(i):
            barrier.wait()
            answers[i] = post(url, json.dumps(requests[i][1]).encode(), path=requests[i][0])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        n_good = len(GOOD_REQUESTS) if with_bad else len(requests)
        for (path, body), (code, out) in zip(requests[:n_good], answers):
            code_alone, out_alone = post(alone_url, json.dumps(body).encode(), path=path)
            assert code == code_alone == 200
            (docs, scores), (docs_alone, scores_alone) = comparable(path, out), comparable(path, out_alone)
            assert docs == docs_alone
            for row, row_alone in zip(scores, scores_alone):
                np.testing.assert_allclose(row, row_alone, atol=1e-5)
        searched = [c for c in spy.calls if len(c[0]) > 1]
        assert searched and max(len(c[0]) for c in searched) > 3, "the requests were not merged"
        if with_bad:
            assert answers[-2][0] == 400 and "topk" in answers[-2][1]["error"]
            assert answers[-1][0] == 500 and "boom" in answers[-1][1]["error"]
        else:
            assert len(spy.calls) < len(requests)
    finally:
        for srv in (batched, alone):
            srv.shutdown()
            srv.server_close()


@pytest.mark.parametrize("api,path", [(None, ""), (None, "/retrieve"), ("retrieve", ""),
                                      (None, "/search"), ("search", ""), ("search", "/search/")])
def test_remote_client_equals_local_index(server, local, api, path):
    remote = R.RemoteRetriever(server + path, api=api)
    assert remote.api == (api or path.strip("/") or "retrieve") and remote.url.endswith("/" + remote.api)
    queries = ["paper company founder", "glass novel", "mountain kingdom capital"]
    for r, l in zip(remote.search(queries, 4), local.search(queries, 4)):
        assert [h.id for h in r] == [h.id for h in l] and [h.contents for h in r] == [h.contents for h in l]
        np.testing.assert_allclose([h.score for h in r], [h.score for h in l], atol=1e-6)
    assert remote(queries, 2) == local(queries, 2)
    release = R.RemoteRetriever(server + path, api=api, doc_format="release")
    assert release(queries, [1, 3, 2]) == R.Retriever(local.corpus, local.index, local.encoder, "release")(queries, [1, 3, 2])


def test_endpoint_from_url_and_api():
    assert R.endpoint("http://h:8000", None) == ("http://h:8000/retrieve", "retrieve")  # today's behaviour
    assert R.endpoint("http://h:8000/", "search") == ("http://h:8000/search", "search")
    assert R.endpoint("http://h:8000/search/", None) == ("http://h:8000/search", "search")
    assert R.endpoint("http://h:8000/retrieve", "retrieve") == ("http://h:8000/retrieve", "retrieve")
    with pytest.raises(ValueError, match="contradicts"):
        R.endpoint("http://h:8000/search", "retrieve")
    with pytest.raises(ValueError, match="api must be one of retrieve, search"):
        R.endpoint("http://h:8000", "SEARCH")
    assert R.open_retriever(url="http://h:8000/search", doc_format="release").doc_format == "release"


def test_remote_client_speaks_the_release_api():
    """Against a stand-in for the release's server: one {"query", "top_n"} body a query, a list of
    documents with only `contents` back."""
    bodies = []

    class Release(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append((self.path, body))
            data = json.dumps([{"contents": f'"{body["query"]}"\ntext {k}'} for k in range(body["top_n"])]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Release)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        remote = R.RemoteRetriever(f"http://127.0.0.1:{srv.server_address[1]}/search", doc_format="release")
        assert remote(["a", "b"], [2, 1]) == ['"a"\ntext 0' + r"\n\n" + '"a"\ntext 1' + r"\n\n", '"b"\ntext 0' + r"\n\n"]
        assert sorted(bodies, key=lambda b: b[1]["query"]) == [("/search", {"query": "a", "top_n": 2}),
                                                               ("/search", {"query": "b", "top_n": 2})]
        hit = remote.search(["c"], 1)[0][0]
        assert (hit.id, hit.contents, hit.score) == ("", '"c"\ntext 0', 0.0)
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def sleeps(monkeypatch):
    """The client's waits between tries, recorded instead of slept."""
    waits = []
    monkeypatch.setattr(R, "retry_sleep", waits.append)
    return waits


def scripted_server(script):
    """A stand-in Search-R1 server whose i-th request gets script[i] (the last entry once past the
    end): an HTTP status code, or a float, seconds to wait before answering 200. A 200 answer has
    one hit per query, `"<query>"\\ntext`. Returns (server, url, the request bodies seen)."""
    seen = []

    class Scripted(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            step = script[min(len(seen), len(script)) - 1]
            if isinstance(step, float):
                time.sleep(step)
                step = 200
            if step == 200:
                payload = {"result": [[{"document": {"id": "7", "contents": f'"{q}"\ntext'}, "score": 0.5}]
                                      for q in seen[-1]["queries"]]}
            else:
                payload = {"error": f"scripted {step}"}
            data = json.dumps(payload).encode()
            try:
                self.send_response(step)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client stopped waiting (a timeout)
                pass

        def log_message(self, *args):
            pass

    srv = R.Server(("127.0.0.1", 0), Scripted)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()  # quick shutdown
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/retrieve", seen


@pytest.mark.parametrize("script", [[503, 503, 200], [429, 500, 200]])
def test_remote_client_retries_server_errors_with_backoff(script, sleeps, capsys):
    srv, url, seen = scripted_server(script)
    try:
        hits = R.RemoteRetriever(url, retries=5, backoff=0.25).search(["osk", "vey"], 1)
    finally:
        srv.shutdown()
        srv.server_close()
    assert [[(h.id, h.contents, h.score) for h in row] for row in hits] == [[("7", '"osk"\ntext', 0.5)], [("7", '"vey"\ntext', 0.5)]]
    assert len(seen) == 3 and seen[0] == seen[2] == {"queries": ["osk", "vey"], "topk": 1, "return_scores": True}
    assert sleeps == [0.25, 0.5]  # the first wait is `backoff`, then doubling
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and all(url in w for w in warnings)
    assert "try 1/6" in warnings[0] and f"HTTP {script[0]}" in warnings[0] and "try 2/6" in warnings[1]


def test_remote_client_gives_up_after_retries_with_connection_error(sleeps):
    srv, url, seen = scripted_server([500])
    try:
        with pytest.raises(ConnectionError, match=f"retriever unreachable at {url} after 4 tries: HTTP 500: .*scripted 500"):
            R.RemoteRetriever(url, retries=3).search(["q"], 1)
        assert len(seen) == 3 + 1 and sleeps == [1.0, 2.0, 4.0]  # retries = tries after the first
        with pytest.raises(ConnectionError, match="after 1 try: HTTP 500"):
            R.RemoteRetriever(url, retries=0).search(["q"], 1)
        assert len(seen) == 5 and len(sleeps) == 3
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("code", [400, 404])
def test_remote_client_does_not_retry_a_bad_request(code, sleeps):
    srv, url, seen = scripted_server([code, 200])
    try:
        with pytest.raises(RuntimeError, match=f"retriever at {url} answered HTTP {code}: .*scripted {code}"):
            R.RemoteRetriever(url).search(["q"], 1)
    finally:
        srv.shutdown()
        srv.server_close()
    assert len(seen) == 1 and sleeps == []


def test_remote_client_retries_after_a_timeout(sleeps, capsys):
    srv, url, seen = scripted_server([2.0, 200])  # the first answer comes after 2 s, the next at once
    try:
        start = time.perf_counter()
        hits = R.RemoteRetriever(url, timeout=0.2).search(["osk"], 1)
        assert time.perf_counter() - start < 1.5  # gave up on the slow answer instead of waiting for it
    finally:
        srv.shutdown()
        srv.server_close()
    assert [h.contents for h in hits[0]] == ['"osk"\ntext'] and len(seen) == 2 and sleeps == [1.0]
    assert "timed out" in capsys.readouterr().err


def test_remote_client_unreachable_is_clear(sleeps):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ConnectionError, match=f"retriever unreachable at http://127.0.0.1:{port}/retrieve after 8 tries: "
                                              "ConnectionRefusedError"):
        R.RemoteRetriever(f"http://127.0.0.1:{port}", timeout=5, retries=7, backoff=10).search(["q"], 1)
    assert sleeps == [10, 20, 40, 60, 60, 60, 60]  # doubling, capped at MAX_BACKOFF
    assert R.MAX_BACKOFF == 60


def test_open_retriever_passes_timeout_and_retries():
    default = R.open_retriever(url="http://h:8000")
    assert (default.timeout, default.retries, default.backoff) == (300.0, 5, 1.0)
    custom = R.open_retriever(url="http://h:8000", timeout=7.5, retries=2)
    assert (custom.timeout, custom.retries) == (7.5, 2) and custom.url == "http://h:8000/retrieve"
    for bad in (dict(timeout=0), dict(retries=-1), dict(retries=1.5), dict(backoff=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            R.RemoteRetriever("http://h:8000", **bad)


# --- the embedded default (integration) ----------------------------------------------------------
@pytest.mark.integration
def test_default_retriever_resolves_builds_and_finds_supporting_passages():
    r = R.open_retriever()  # embedded default: toy corpus, MiniLM, index built or read from cache
    assert r.encoder.dim == 384 and r.encoder.query_prefix == "" and r.index.ntotal == len(r.corpus) == 3000
    sample = list(range(0, len(r.corpus), 75))
    texts = [r.corpus[i]["contents"] for i in sample]
    assert [h[0].id for h in r.search(texts, 1)] == [str(i) for i in sample]
    rows = [json.loads(line) for line in open(os.path.join(os.path.dirname(R.DEFAULT_CORPUS), "test.jsonl"))]
    single = [row for row in rows if row["metadata"]["type"] == "single"][:40]
    found = [bool(set(row["metadata"]["supporting_ids"]) & {h.id for h in hits})
             for row, hits in zip(single, r.search([row["question"] for row in single], 5))]
    assert sum(found) / len(found) >= 0.8  # the toy questions are answerable by search


def test_results_carry_their_passage_ids(small_corpus, tiny_encoder_dir):
    """The search tool's text is what the model reads; `.ids` says which corpus passages it holds."""
    search = R.open_retriever(corpus=small_corpus, encoder=tiny_encoder_dir, doc_format="release")
    (docs,) = search(["a river"], 3)
    hits = search.search(["a river"], 3)[0]
    assert isinstance(docs, str) and docs.ids == tuple(h.id for h in hits) and len(docs.ids) == 3
    assert docs == R.render_docs(hits, "release")
