"""Sequence packing: the packed layout holds exactly each example's tokens, and a packed batch gives the same
logits, losses and training as the unpacked one (real MiniLM on real SST-2, and a tiny GPT-2 on a mesh)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from jaxseq.data import batches, packing  # noqa: E402
from jaxseq.data.glue import encode, get_task, load_split  # noqa: E402
from jaxseq.models import load_pretrained  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402
from tests.test_trainer import (  # noqa: E402,F401 (fixtures)
    make_trainer,
    sst2,
    tiny_classifier,
    tokenizer,
    train_losses,
)


@pytest.fixture(scope="module")
def minilm_sst2():
    folder = shared_asset("models/all-MiniLM-L6-v2")
    task = get_task("sst2")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    arrays = encode(task, load_split(task, "validation", data_dir=shared_asset("data/glue"))[:48], tok, 64)
    return folder, arrays


@pytest.mark.parametrize("pool", ["first", "last"])
def test_pack_keeps_every_token_and_points_at_the_pooled_one(minilm_sst2, pool):
    _, arrays = minilm_sst2
    rows = packing.rows_needed([arrays])
    assert rows < 48 / 2  # SST-2 dev averages ~25 tokens of 64
    packed = packing.pack(arrays, rows + 1, pool)  # a spare row stays empty
    assert packed["input_ids"].shape == (rows + 1, 64) and not packed["attention_mask"][-1].any()
    np.testing.assert_array_equal(packed["labels"], arrays["labels"])
    flat = {k: packed[k].reshape(-1) for k in ("input_ids", "attention_mask", "position_ids", "token_type_ids")}
    for i, length in enumerate(packing.lengths(arrays)):
        start = packed["pool_index"][i] - (length - 1 if pool == "last" else 0)
        span = slice(start, start + length)
        np.testing.assert_array_equal(flat["input_ids"][span], arrays["input_ids"][i, :length])
        np.testing.assert_array_equal(flat["position_ids"][span], np.arange(length))
        assert len(set(flat["attention_mask"][span])) == 1 and flat["attention_mask"][start] > 0
    assert (packed["attention_mask"] > 0).sum() == packing.lengths(arrays).sum()
    with pytest.raises(ValueError, match="packed rows"):
        packing.pack(arrays, rows - 1, pool)


def test_row_buckets_hold_every_batch_in_a_few_counts():
    needed = np.array([7] * 500 + [8] * 400 + [10] * 100)
    assert packing.row_buckets(needed, 128) == [7, 8, 10]  # 7700 rows computed instead of 10000
    assert packing.row_buckets(needed, 128, most=2) == [8, 10]
    assert packing.row_buckets(np.array([4] * 10 + [5] * 990), 128) == [5]  # 4 would save 0.2% for a compilation
    assert packing.row_buckets(needed[::100], 128) == [10]  # 18 rows of 128 tokens: less than a compilation costs
    assert packing.row_buckets(needed[::100], 512) == [8, 10]  # 18 rows of 512 tokens: more
    qa = np.array([23, 22, 24, 20, 22, 21, 21, 22, 23, 21, 22, 25])  # SQuAD windows, 32 a batch (the QA bench)
    assert packing.row_buckets(qa, 384) == [22, 25]  # 276 rows of 384 tokens instead of 300


def test_eval_width_buckets_merge_rare_widths_upward(monkeypatch):
    assert batches.length_buckets(128) == [16, 32, 64, 128]
    assert batches.length_buckets(512, multiple=128) == [128, 256, 512]
    ends = [10, 12, 13, 14, 20, 30, 40, 40]  # of each batch's longest row
    assert batches.bucket_widths(ends, [16, 32, 64, 128]).tolist() == [16] * 4 + [64] * 4  # 32: 2 batches
    monkeypatch.setattr(batches, "BUCKET_BATCHES", 1)
    assert batches.bucket_widths(ends, [16, 32, 64, 128]).tolist() == [16] * 4 + [32] * 2 + [64] * 2


def test_trimming_cuts_each_array_with_the_mask_it_follows():
    """A batch cut to its width bucket keeps every per-token array beside its tokens: labels and loss_mask
    with the input's (masked LM, tagging, chat), a seq2seq batch's labels with the decoder's mask even when
    both have the same width; per-example arrays stay whole."""
    ids = np.arange(24).reshape(3, 8)
    encoder = {"input_ids": ids, "attention_mask": ids > 0, "labels": -ids, "loss_mask": ids % 2, "score": ids[:, 0]}
    cut = batches.trim(encoder, {"attention_mask": 4})
    assert {k: v.shape for k, v in cut.items()} == {**dict.fromkeys(encoder, (3, 4)), "score": (3,)}
    np.testing.assert_array_equal(cut["labels"], -ids[:, :4])
    seq2seq = {"input_ids": ids, "attention_mask": ids, "labels": ids, "decoder_attention_mask": ids}
    cut = batches.trim(seq2seq, {"attention_mask": 4, "decoder_attention_mask": 6})
    assert [cut[k].shape[1] for k in seq2seq] == [4, 4, 6, 6]


def test_packed_minilm_gives_the_unpacked_logits(minilm_sst2):
    folder, arrays = minilm_sst2
    model = load_pretrained(folder, "sequence-classification", num_labels=2, seed=0)
    inputs = {k: v for k, v in arrays.items() if k != "labels"}
    expected = model(**{k: jnp.asarray(v) for k, v in inputs.items()})
    packed = packing.pack(inputs, packing.rows_needed([arrays]), model.pooled_token)
    got = model(**{k: jnp.asarray(v) for k, v in packed.items()})
    assert got.shape == expected.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)


def test_packed_evaluation_batches_gather_every_tokens_logits_as_its_unpacked_row(minilm_sst2):
    """Evaluation packs a whole set at once (``packed_batches``: each example once, a few rows a batch) and
    ``token_index`` puts each example's per-token outputs back at its own columns (padded on either side)."""
    folder, arrays = minilm_sst2
    inputs = {k: v for k, v in arrays.items() if k != "labels"}
    lengths = packing.lengths(inputs)
    layout = packing.packed_batches(lengths, 64, rows=4, multiple=2)
    assert len(layout) > 1 and len({len(index) for index, _, _ in layout}) == 1 and len(layout[0][0]) % 2 == 0
    seen = np.concatenate([index[valid] for index, valid, _ in layout])
    np.testing.assert_array_equal(np.sort(seen), np.arange(len(lengths)))  # every example, once
    model = load_pretrained(folder, "token-classification", num_labels=5, seed=0)
    expected = np.asarray(model(**{k: jnp.asarray(v) for k, v in inputs.items()}))
    left = {k: np.stack([np.roll(row, 64 - n) for row, n in zip(v, lengths)]) for k, v in inputs.items()}
    for index, valid, assignment in layout:
        assert len(assignment) <= 4 and all(lengths[index[row]].sum() <= 64 for row in assignment)
        batch = {k: v[index] for k, v in inputs.items()}
        packed = packing.pack(batch, 4, packing.TOKENS, assignment=assignment, token_index=True)
        assert packed["input_ids"].shape == (4, 64) and packed["token_index"].shape == (len(index), 64)
        logits = np.asarray(model(**{k: jnp.asarray(packed[k]) for k in packing.ROW_ARRAYS}))
        got = logits.reshape(-1, 5)[packed["token_index"]]
        real = (batch["attention_mask"] != 0) & valid[:, None]  # the repeats that fill the batch: not packed
        np.testing.assert_allclose(got[real], expected[index][real], atol=1e-5)
        shifted = packing.pack(
            {k: v[index] for k, v in left.items()}, 4, packing.TOKENS, assignment=assignment, token_index=True
        )
        flat = shifted["input_ids"].reshape(-1)[shifted["token_index"]]
        real = (left["attention_mask"][index] != 0) & valid[:, None]
        np.testing.assert_array_equal(flat[real], left["input_ids"][index][real])


def test_packed_gpt2_gives_the_unpacked_logits(tokenizer, sst2):  # noqa: F811 (fixtures)
    _, _, dev = sst2
    model = tiny_classifier(tokenizer, dropout=0.0)
    inputs = {k: v for k, v in dev.items() if k != "labels"}
    expected = model(**{k: jnp.asarray(v) for k, v in inputs.items()})
    packed = packing.pack(inputs, packing.rows_needed([dev]), model.pooled_token)
    got = model(**{k: jnp.asarray(v) for k, v in packed.items()})
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)


def test_packed_training_follows_unpacked_on_a_mesh(tmp_path, tokenizer, sst2, monkeypatch):  # noqa: F811 (fixtures)
    monkeypatch.setattr(packing, "COMPILE_TOKENS", 0)  # a row count per need, even in a run of 4 steps
    # dropout off: packed rows draw different dropout masks; two micro-batches each packed on their own
    kw = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4, dropout=0.0)
    # the compilations: the train step's later row counts compile in the background, once each, and so does
    # the eval step of the evaluation at the end
    compiled, evals = [], []

    def count(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            for name, seen in (("train_step", compiled), ("eval_step", evals)):
                if name in fun_name:
                    seen.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        packed = make_trainer(tmp_path / "packed", tokenizer, sst2, "dp=2,mp=4", pack="last", **kw)
        own = [jax.device_get(batch) for batch, _ in zip(packed.feed.batches(), range(4))]
        rows = [batch["input_ids"].shape[1] for batch in own]  # [2, rows, seq]
        largest = max(packed.feed.row_buckets)  # while the smaller counts compile: the same examples, more rows
        padded = [jax.device_get(b) for b, _ in zip(packed.feed.batches(ready=lambda r: r == largest), range(4))]
        assert [batch["input_ids"].shape[1] for batch in padded] == [largest] * 4
        for a, b in zip(own, padded):
            np.testing.assert_array_equal(a["labels"], b["labels"])
            np.testing.assert_array_equal(
                np.sort(a["input_ids"], None), np.sort(b["input_ids"], None)[-a["input_ids"].size :]
            )
        packed_losses = train_losses(packed)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    plain = make_trainer(tmp_path / "plain", tokenizer, sst2, "dp=2,mp=4", **kw)
    assert len(set(rows)) > 1 and set(rows) <= set(packed.feed.row_buckets)  # steps packed into two row counts
    assert all(r % 2 == 0 and r < plain.feed.micro_batch for r in rows)
    assert len(compiled) == len(set(rows)) and compiled[0] == threading.main_thread().name, compiled
    assert all(name.startswith("jaxseq-compile") for name in compiled[1:]), compiled
    assert len(evals) == 1 and evals[0].startswith("jaxseq-compile"), evals
    np.testing.assert_allclose(packed_losses, train_losses(plain), atol=1e-5)
    a, b = plain.logger.records[-1], packed.logger.records[-1]
    assert a.keys() == b.keys() and "eval/accuracy" in a
    for key in a:
        if key.startswith("eval/"):
            np.testing.assert_allclose(b[key], a[key], atol=1e-5)


def test_every_eval_width_compiles_in_the_background_while_training(
    tmp_path,
    tokenizer,  # noqa: F811 (fixture)
    sst2,  # noqa: F811 (fixture)
    monkeypatch,
):
    """Length-bucketed evaluation: the eval step of each width compiles on the background thread while the
    run trains (Feeder.eval_shapes: each batch shape once, in order of first use), none when it evaluates."""
    monkeypatch.setattr(batches, "BUCKET_BATCHES", 1)  # a program per width
    trainer = make_trainer(tmp_path, tokenizer, sst2, "dp=2,mp=4", max_steps=4)
    used = [b["input_ids"].shape for b, _, _ in trainer.feed.eval_batches("")]
    shapes = trainer.feed.eval_shapes("")
    assert [s["input_ids"].shape for s in shapes] == list(dict.fromkeys(used)) and len(shapes) > 1
    first = next(trainer.feed.eval_batches(""))[0]
    assert {k: (a.shape, a.dtype, a.sharding) for k, a in first.items()} == {
        k: (a.shape, a.dtype, a.sharding) for k, a in shapes[0].items()
    }
    evals = []

    def count(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration" and "eval_step" in fun_name:
            evals.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        trainer.train()
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
        trainer.close()
    assert len(evals) == len(shapes) and all(name.startswith("jaxseq-compile") for name in evals), evals
    assert trainer.program.eval_step._cache_size() == len(shapes)  # the run's calls found them compiled


def test_packed_and_bucketed_evaluation_and_prediction_equal_unpacked_rows_in_input_order(
    tmp_path,
    tokenizer,  # noqa: F811 (fixture)
    sst2,  # noqa: F811 (fixture)
    monkeypatch,
):
    monkeypatch.setattr(batches, "BUCKET_BATCHES", 1)  # a program per width, even for 5 batches
    _, _, dev = sst2
    kw = dict(max_steps=1, predict_sets={"": dev})
    plain = make_trainer(tmp_path / "plain", tokenizer, sst2, "dp=2,mp=4", **kw)  # length buckets
    packed = make_trainer(tmp_path / "packed", tokenizer, sst2, "dp=2,mp=4", pack="last", **kw)
    # the reference: the same weights on every unpacked, full-length row at once, in input order
    expected = np.asarray(plain.model()(jnp.asarray(dev["input_ids"]), jnp.asarray(dev["attention_mask"])))
    widths = sorted({b["input_ids"].shape[1] for b, _, _ in plain.feed.eval_batches("")})
    assert len(widths) > 1 and set(widths) <= {8, 16, 32}  # batches sorted by length and cut to buckets
    assert "pool_index" in next(packed.feed.eval_batches(""))[0]  # evaluated on packed rows
    for trainer in (plain, packed):
        for _ in range(2):
            out = trainer.predict()
            np.testing.assert_array_equal(out["labels"], dev["labels"])
            np.testing.assert_allclose(out["logits"], expected, atol=1e-5)
            np.testing.assert_array_equal(out["prediction"], out["logits"].argmax(-1))
        trainer.close()
    assert plain.program.eval_step._cache_size() == len(widths)  # one program per bucket, reused
    a, b = plain.evaluate(), packed.evaluate()
    assert a.keys() == b.keys() and "accuracy" in a
    for key in a:
        np.testing.assert_allclose(b[key], a[key], atol=1e-5)
    assert a["accuracy"] == pytest.approx(float(np.mean(expected.argmax(-1) == dev["labels"])))
