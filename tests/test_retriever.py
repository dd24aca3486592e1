"""retriever.py: encoder, offset-table corpus, flat index, Search-R1 HTTP API."""
import json
import os
import shutil
import threading
import urllib.error
import urllib.request

import faiss
import numpy as np
import pytest

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
    docs = local(["paper company", "glass"], topk=[1, 3])
    assert docs[0].count("\n") == 0 and docs[0].startswith("Doc 1(Title: ")
    assert docs[1].count("\n") == 2 and "Doc 3(Title: " in docs[1]
    assert local([]) == []


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
])
def test_bad_requests_get_400_and_server_keeps_serving(server, body, message):
    code, out = post(server, body)
    assert code == 400 and message in out["error"]
    code, out = post(server, json.dumps({"queries": ["river"], "topk": 1}).encode())
    assert code == 200 and len(out["result"][0]) == 1


def test_unknown_path_is_404(server):
    code, out = post(server, b"{}", path="/search")
    assert code == 404 and "retrieve" in out["error"]


def test_remote_client_equals_local_index(server, local):
    remote = R.RemoteRetriever(server)
    queries = ["paper company founder", "glass novel", "mountain kingdom capital"]
    for r, l in zip(remote.search(queries, 4), local.search(queries, 4)):
        assert [h.id for h in r] == [h.id for h in l] and [h.contents for h in r] == [h.contents for h in l]
        np.testing.assert_allclose([h.score for h in r], [h.score for h in l], atol=1e-6)
    assert remote(queries, 2) == local(queries, 2)


def test_remote_client_unreachable_is_clear():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ConnectionError, match="retriever unreachable"):
        R.RemoteRetriever(f"http://127.0.0.1:{port}", timeout=5).search(["q"], 1)


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
