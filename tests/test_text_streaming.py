"""Causal-LM text through ``datasets``: ``--streaming`` writes exactly the tokens of the in-memory path (and of
the tokenizer run on the whole text) for text, jsonl and csv files and a dataset folder, and on a ~100 MB
generated corpus its peak host memory grows by a small fraction of the file's size."""

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from jaxseq.data import text  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    folder = shared_asset("data/tokenizers/gpt2")
    return transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))


def both_ways(path, tokenizer, tmp_path, **kw):
    """(streamed, in memory) token streams of ``path``, each through its own cache."""
    quiet = dict(progress=False, log=lambda _: None, **kw)
    streamed = text.file_tokens(path, tokenizer, text.TokenCache(tmp_path / "a"), streaming=True, **quiet)
    in_memory = text.file_tokens(path, tokenizer, text.TokenCache(tmp_path / "b"), **quiet)
    return streamed, in_memory


def test_a_streamed_text_file_gives_the_tokens_of_the_whole_document(tokenizer, tmp_path):
    path = shared_asset("data/text/tinyshakespeare.txt")  # 1 MB: many pieces, cut while streaming
    streamed, in_memory = both_ways(path, tokenizer, tmp_path)
    whole = tokenizer(path.read_text(), verbose=False)["input_ids"] + [tokenizer.eos_token_id]
    np.testing.assert_array_equal(streamed, whole)
    np.testing.assert_array_equal(in_memory, whole)
    (cached,) = (tmp_path / "a").glob("*.npy")
    np.testing.assert_array_equal(np.load(cached, allow_pickle=False), whole)  # a plain .npy file
    messages = []
    again = text.file_tokens(
        path, tokenizer, text.TokenCache(tmp_path / "a"), streaming=True, progress=False, log=messages.append
    )
    assert "from the cache" in messages[0] and np.array_equal(again, whole)
    uncached = text.file_tokens(path, tokenizer, text.TokenCache(""), streaming=True, progress=False)
    np.testing.assert_array_equal(uncached, whole)


def test_streamed_records_are_documents(tokenizer, tmp_path):
    rows = ["First Citizen: speak.", "", "007", "NA", "All: Speak, speak.\n\nYou are all resolved."]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": i, "body": r}) + "\n" for i, r in enumerate(rows)))
    with open(tmp_path / "d.tsv", "w", newline="") as f:  # quoted as the csv module quotes (the line breaks too)
        csv.writer(f, delimiter="\t").writerows([("id", "body"), *enumerate(rows)])
    expected = [t for r in rows if r for t in tokenizer(r)["input_ids"] + [tokenizer.eos_token_id]]
    for name in ("d.jsonl", "d.tsv"):
        assert list(text.read_documents(tmp_path / name, "body")) == rows
        streamed, in_memory = both_ways(tmp_path / name, tokenizer, tmp_path / f"{name}-cache", text_column="body")
        np.testing.assert_array_equal(streamed, expected)
        np.testing.assert_array_equal(in_memory, expected)


def test_a_streamed_dataset_gives_the_same_blocks(tokenizer, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    rows = [f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(100)]
    for split, part in (("train", rows[:90]), ("validation", rows[90:])):
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "data" / f"{split}.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in part))
    blocks = {}
    for streaming in (False, True):
        config = text.TextDataConfig(
            dataset_name=str(tmp_path / "data"), data_cache_dir=str(tmp_path / "cache"), streaming=streaming
        )
        blocks[streaming] = text.load_blocks(config, tokenizer, 16, progress=False, log=lambda _: None)
    for a, b in zip(blocks[False], blocks[True]):
        np.testing.assert_array_equal(a, b)


PROBE = """
import json, resource, sys
from pathlib import Path
import tokenizers, transformers
from jaxseq.data import text

root, words = Path(sys.argv[1]), json.loads(sys.argv[2])
model = tokenizers.models.WordLevel({w: i for i, w in enumerate(["[UNK]", "<eos>", *words])}, unk_token="[UNK]")
backend = tokenizers.Tokenizer(model)
backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]")

def blocks(name):
    cache = str(root / name) + "-cache"
    config = text.TextDataConfig(train_file=str(root / name), streaming=True, data_cache_dir=cache)
    return text.load_blocks(config, tokenizer, 64, progress=False, log=lambda _: None)

blocks("small.txt")  # the same path once on a small file: imports and buffers count in the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
train, valid = blocks("big.txt")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth": (after - before) * 1024, "blocks": len(train) + len(valid), "last": valid[-1].tolist()}))
"""


@pytest.mark.slow
def test_streaming_a_large_corpus_keeps_host_memory_bounded(tmp_path):
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, n)) for n in rng.integers(30, 50, 2000)]  # long words: fewer tokens
    lines = [" ".join(rng.choice(words, 12)) + "\n" for _ in range(4000)]
    chunk = "".join(lines)
    repeats = (100 << 20) // len(chunk) + 1
    with open(tmp_path / "big.txt", "w") as f:
        for _ in range(repeats):
            f.write(chunk)
    (tmp_path / "small.txt").write_text(chunk)
    size = (tmp_path / "big.txt").stat().st_size
    assert size > 100 << 20

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    probe = [sys.executable, "-c", textwrap.dedent(PROBE), str(tmp_path), json.dumps(words)]
    result = subprocess.run(probe, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    tokens = 12 * len(lines) * repeats + 1  # every word, then EOS: one document
    assert report["blocks"] == tokens // 64
    ids = {w: i for i, w in enumerate(["[UNK]", "<eos>", *words])}
    period = [ids[w] for line in lines for w in line.split()]
    n = tokens // 64
    last = [period[k % len(period)] if k < len(period) * repeats else ids["<eos>"] for k in range(n * 64 - 64, n * 64)]
    assert report["last"] == last  # the corpus's tokens in order, to the last block
    assert report["growth"] < size / 5, f"peak memory grew by {report['growth'] >> 20} MiB for {size >> 20} MiB"


def test_text_without_safe_breaks_is_cut_at_line_breaks_the_same_way_streamed(tmp_path):
    document = "".join(f"Line {i} of a double-spaced text.\n\n" for i in range(60_000))  # no break between two
    (tmp_path / "double.txt").write_text(document)  # non-blank lines: only the forced cuts
    streamed = list(text.file_parts(tmp_path / "double.txt"))
    assert streamed == list(text.document_parts(text.read_documents(tmp_path / "double.txt")))
    assert "".join(p for p, _ in streamed) == document and [end for _, end in streamed][-1]
    limit = text.LIMIT_PIECES * text.PIECE_CHARS
    assert len(streamed) > 1 and all(len(p) <= limit and p.endswith("\n") for p, _ in streamed)
