"""Download what the paper's runs use, from the Hugging Face hub (huggingface_hub comes with transformers).

    python data/download.py train  --out data/paper   # Search-R1's NQ + HotpotQA train and test parquet
    python data/download.py eval   --out data/paper   # the seven benchmarks, each in the split the paper evaluates
    python data/download.py corpus --out data/paper   # wiki-18 (gunzipped) and its e5 flat index (its parts joined)
    python data/download.py all    --out data/paper

The repositories and file names are the ones Search-R1's and the release's own download scripts
name. What lands in --out:

    nq_hotpotqa_train/train.parquet, test.parquet      train.py --train_data
    flashrag/<dataset>/<split>.jsonl                    evaluate.py --data OUT/flashrag
    wiki-18.jsonl, e5_Flat.index                        retriever.py serve --corpus ... --index ...

A file already complete is skipped (the final file is written under a temporary name and renamed,
so one that exists is whole); an interrupted run is resumed by running it again. HF_ENDPOINT points
it at a mirror. The index alone is about 65 GB (21M passages x 768 float32): check the disk first.
"""
import argparse
import gzip
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.questions import PAPER_SPLIT  # noqa: E402

TRAIN = [("PeterJinGo/nq_hotpotqa_train", name, os.path.join("nq_hotpotqa_train", name))
         for name in ("train.parquet", "test.parquet")]
EVAL = [("RUC-NLPIR/FlashRAG_datasets", f"{name}/{split}.jsonl", os.path.join("flashrag", name, f"{split}.jsonl"))
        for name, split in PAPER_SPLIT.items()]
CORPUS = ("PeterJinGo/wiki-18-corpus", "wiki-18.jsonl.gz", "wiki-18.jsonl")
INDEX = ("PeterJinGo/wiki-18-e5-index", ("part_aa", "part_ab"), "e5_Flat.index")


def size(path: str) -> str:
    return f"{os.path.getsize(path) / 2**20:,.1f} MB"


def done(dest: str) -> bool:
    if os.path.isfile(dest):
        print(f"skip  {dest} (already complete, {size(dest)})")
        return True
    return False


def hub_file(repo: str, filename: str, out: str) -> str:
    """One file of a dataset repository, with the hub's progress bar; a failure names what failed."""
    from huggingface_hub import constants, hf_hub_download

    try:
        return hf_hub_download(repo, filename, repo_type="dataset",
                               local_dir=os.path.join(out, ".download", repo.replace("/", "__")))
    except Exception as e:  # unreachable hub, missing file, refused request: say which and where
        raise SystemExit(f"download.py: could not fetch {filename} of the dataset {repo} from {constants.ENDPOINT} "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def fetch(repo: str, filename: str, dest: str, out: str):
    if done(dest):
        return
    path = hub_file(repo, filename, out)
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    os.replace(path, dest)
    print(f"got   {dest} ({size(dest)})")


def gunzipped(repo: str, filename: str, dest: str, out: str):
    """A .gz file, unpacked into dest (the download is removed once unpacked)."""
    if done(dest):
        return
    packed = hub_file(repo, filename, out)
    with gzip.open(packed, "rb") as src, open(dest + ".tmp", "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 24)
    os.replace(dest + ".tmp", dest)
    os.remove(packed)
    print(f"got   {dest} ({size(dest)}, unpacked)")


def joined(repo: str, parts: tuple, dest: str, out: str):
    """A file published in parts, concatenated in order into dest (the parts are removed after)."""
    if done(dest):
        return
    paths = [hub_file(repo, part, out) for part in parts]
    with open(dest + ".tmp", "wb") as dst:
        for path in paths:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, dst, length=1 << 24)
    os.replace(dest + ".tmp", dest)
    for path in paths:
        os.remove(path)
    print(f"got   {dest} ({size(dest)}, {len(parts)} parts joined)")


def next_commands(out: str, what: set) -> str:
    corpus, index = os.path.join(out, "wiki-18.jsonl"), os.path.join(out, "e5_Flat.index")
    lines = ["Next: these, or the README's \"Reproduce the paper\" block whole (FSDP over 4 GPUs included)"]
    if "corpus" in what:
        lines.append(f"  python retriever.py serve --corpus {corpus} --index {index} --encoder intfloat/e5-base-v2 "
                     "--device cuda:0 --host 0.0.0.0 --port 8000   # on a machine with the index's ~65 GB of memory")
    if "train" in what:
        lines.append(f"  accelerate launch train.py --model Qwen/Qwen2.5-3B-Instruct "
                     f"--train_data {os.path.join(out, 'nq_hotpotqa_train', 'train.parquet')} --retriever_url http://HOST:8000")
    if "eval" in what:
        lines.append(f"  accelerate launch --multi_gpu --num_processes 4 evaluate.py --model CHECKPOINT "
                     f"--data {os.path.join(out, 'flashrag')} --retriever_url http://HOST:8000")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["train", "eval", "corpus", "all"])
    ap.add_argument("--out", required=True, help="the folder everything lands in")
    args = ap.parse_args(argv)
    what = {"train", "eval", "corpus"} if args.what == "all" else {args.what}
    os.makedirs(args.out, exist_ok=True)
    for kind, files in (("train", TRAIN), ("eval", EVAL)):
        if kind in what:
            for repo, filename, dest in files:
                fetch(repo, filename, os.path.join(args.out, dest), args.out)
    if "corpus" in what:
        gunzipped(CORPUS[0], CORPUS[1], os.path.join(args.out, CORPUS[2]), args.out)
        joined(INDEX[0], INDEX[1], os.path.join(args.out, INDEX[2]), args.out)
    shutil.rmtree(os.path.join(args.out, ".download"), ignore_errors=True)
    print(next_commands(args.out, what))


if __name__ == "__main__":
    main()
