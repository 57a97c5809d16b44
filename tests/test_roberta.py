"""RoBERTa against transformers PyTorch, from perturbed weights: every task (the bare model and its pooler, the
classifier and regressor on <s>, the masked LM tied and untied) on left- and right-padded rows, positions
counted from padding_idx + 1 over real tokens, export round trips; packed rows (0-based positions from the
packer) equal unpacked; partition rules on a mesh; and `jaxseq glue` fine-tuning a tiny RoBERTa folder whose
export transformers loads with the same logits."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.data import packing  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import load_pretrained, roberta, save_pretrained  # noqa: E402
from jaxseq.models.hub import position_limit  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402
from tests.reference import max_diff_on, perturb, torch_forward  # noqa: E402

VOCAB, PAD, POSITIONS = 101, 1, 34  # RoBERTa's <pad> is 1: its 32 positions start at row 2
RTOL = 1e-4  # of max(1, max |output|)


def tiny_config(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=POSITIONS, type_vocab_size=1, pad_token_id=PAD, bos_token_id=0, eos_token_id=2,
    )  # fmt: skip
    return transformers.RobertaConfig(**{**base, **kw})


def rows(left: bool, lengths=(12, 9, 5)):
    """int32 ``(ids, mask)`` of random tokens (3..VOCAB-1) padded with <pad> on the left or the right."""
    rng = np.random.RandomState(0)
    width = max(lengths)
    ids, mask = np.full((len(lengths), width), PAD, np.int32), np.zeros((len(lengths), width), np.int32)
    for row, n in enumerate(lengths):
        span = slice(width - n, width) if left else slice(0, n)
        ids[row, span], mask[row, span] = rng.randint(3, VOCAB, n), 1
    return ids, mask


@nnx.jit
def forward(model, *args, **kwargs):
    return model(*args, **kwargs)


def outputs(model, task, ids, mask) -> list[np.ndarray]:
    """The per-position output (logits, or the base model's states) and the base model's pooled output."""
    if isinstance(model, torch.nn.Module):
        out = torch_forward(model, input_ids=ids, attention_mask=mask)
        return [out.last_hidden_state.numpy(), out.pooler_output.numpy()] if task == "base" else [out.logits.numpy()]
    out = forward(model, jnp.asarray(ids), jnp.asarray(mask))
    return [np.asarray(out.last_hidden_state), np.asarray(out.pooler_output)] if task == "base" else [np.asarray(out)]


def assert_close(mask, got, want):
    """Each output within RTOL of max(1, max |want|) on the real positions (every row of per-row outputs)."""
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        real = mask if g.ndim == 3 else np.ones(len(g), np.int32)
        assert max_diff_on(real, g, w) <= RTOL * max(1.0, max_diff_on(real, w, np.zeros_like(w)))


CASES = {  # task, transformers class, config overrides
    "base": ("base", transformers.RobertaModel, {}),
    "classification": ("sequence-classification", transformers.RobertaForSequenceClassification, dict(num_labels=3)),
    "regression": ("sequence-classification", transformers.RobertaForSequenceClassification, dict(num_labels=1)),
    "masked-lm": ("masked-lm", transformers.RobertaForMaskedLM, {}),
    "masked-lm-untied": ("masked-lm", transformers.RobertaForMaskedLM, dict(tie_word_embeddings=False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_pytorch_on_both_paddings_and_round_trips(case, tmp_path):
    """transformers' positions come from the ids (padding_idx + 1 + the real tokens before), so left padding
    moves nothing; the export loads back with no missing or unexpected weights and the same outputs."""
    task, torch_cls, kw = CASES[case]
    torch.manual_seed(0)
    ref = perturb(torch_cls(tiny_config(**kw))).eval()
    ref.save_pretrained(tmp_path / "ref")
    model = load_pretrained(tmp_path / "ref", task)
    assert type(model).hf_architecture == torch_cls.__name__
    save_pretrained(model, tmp_path / "out")
    back, info = torch_cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    for left in (False, True):
        ids, mask = rows(left)
        want = outputs(ref, task, ids, mask)
        got = outputs(model, task, ids, mask)
        assert got[0].dtype == np.float32
        assert_close(mask, got, want)
        assert_close(mask, outputs(back, task, ids, mask), want)


def test_positions_count_real_tokens_from_padding_idx():
    """The default positions are transformers' ``create_position_ids_from_input_ids`` less padding_idx + 1,
    what the embeddings add back; too long a row is a one-line error naming the 32 positions."""
    ids, _ = rows(left=True)
    embeddings = roberta.RobertaEmbeddings(tiny_config(), dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    want = transformers.models.roberta.modeling_roberta.RobertaEmbeddings.create_position_ids_from_input_ids(
        torch.as_tensor(ids).long(), PAD
    ).numpy()
    got = np.asarray(embeddings.default_positions(jnp.asarray(ids))) + embeddings.position_offset
    np.testing.assert_array_equal(got, want)
    assert position_limit(tiny_config()) == POSITIONS - PAD - 1
    model = nnx.eval_shape(lambda: roberta.RobertaModel(tiny_config(), rngs=nnx.Rngs(0)))
    with pytest.raises(JaxseqError, match=r"^sequence length 33 exceeds the model's 32 positions"):
        model(jnp.full((1, 33), 5, jnp.int32))


def test_packed_rows_equal_unpacked(tmp_path):
    """The packer's positions restart at 0 in every example: the classifier adds padding_idx + 1 as it does to
    its own, so packed examples score as unpacked ones."""
    torch.manual_seed(0)
    perturb(transformers.RobertaForSequenceClassification(tiny_config(num_labels=3))).save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "sequence-classification")
    ids, mask = rows(left=False, lengths=(16, 9, 5, 7, 3))
    batch = packing.pack({"input_ids": ids, "attention_mask": mask}, 3, pool=type(model).pooled_token)
    assert batch["input_ids"].shape[0] == 3 and batch["position_ids"].max() == 15
    packed = forward(model, **{k: jnp.asarray(v) for k, v in batch.items()})
    np.testing.assert_allclose(packed, forward(model, jnp.asarray(ids), jnp.asarray(mask)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("task", ["base", "sequence-classification", "masked-lm"])
def test_partition_rules_place_every_task_on_a_mesh(task, tmp_path):
    """Every parameter has a rule; on (dp=2, fsdp=2, mp=2) the outputs equal one device's."""
    torch.manual_seed(0)
    cls = {"base": "RobertaModel", "sequence-classification": "RobertaForSequenceClassification"}
    ref = getattr(transformers, cls.get(task, "RobertaForMaskedLM"))(tiny_config(num_labels=2))
    perturb(ref).save_pretrained(tmp_path)
    ids, mask = rows(left=False)
    want = outputs(load_pretrained(tmp_path, task), task, ids, mask)
    model = load_pretrained(tmp_path, task, mesh=make_mesh("dp=2,fsdp=2,mp=2"))
    specs = {name: x.sharding.spec for name, x in partition.named_leaves(nnx.state(model, nnx.Param))}
    query = [spec for name, spec in specs.items() if name.endswith("layer/0/attention/self/query/kernel")]
    assert query == [P("fsdp", "mp")]
    if task == "masked-lm":
        assert specs["lm_head/bias"] == P("mp") and specs["lm_head/dense/kernel"] == P("fsdp", None)
    for got, w in zip(outputs(model, task, ids, mask), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- jaxseq glue on a RoBERTa folder


@pytest.fixture(scope="module")
def tiny_roberta(tmp_path_factory):
    """A RoBERTa classifier folder as transformers saves it: perturbed weights and a byte-level BPE tokenizer
    (<s>, <pad>, </s>, <unk>, <mask> first, as roberta-base's) trained on SST-2's sentences."""
    from tokenizers import ByteLevelBPETokenizer

    sentences = [line.split("\t")[0] for line in shared_asset("data/glue/SST-2/train.tsv").read_text().splitlines()]
    bpe = ByteLevelBPETokenizer()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe.train_from_iterator(sentences[1:3000], vocab_size=500, special_tokens=specials)
    folder = tmp_path_factory.mktemp("tiny-roberta")
    bpe.save_model(str(folder))
    tokenizer = transformers.RobertaTokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    assert [tokenizer.convert_tokens_to_ids(t) for t in specials] == list(range(5))
    config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=66, num_labels=2)
    torch.manual_seed(0)
    perturb(transformers.RobertaForSequenceClassification(config)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def glue_run(model, out, *flags):
    from jaxseq.commands import glue

    args = [
        "--model_name_or_path", model, "--data_dir", shared_asset("data/glue"), "--task_name", "sst2",
        "--output_dir", out, "--max_train_samples", 64, "--max_eval_samples", 32, "--max_seq_length", 64,
        "--per_device_train_batch_size", 2, "--per_device_eval_batch_size", 4, "--max_steps", 4,
        "--logging_steps", 1, "--learning_rate", 1e-3, "--compilation_cache_dir", "",
        "--config_overrides", "hidden_dropout_prob=0,attention_probs_dropout_prob=0", *flags,
    ]  # fmt: skip
    assert glue.main([str(a) for a in args]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in records if "train/loss" in r], json.loads((out / "eval_results.json").read_text())


@pytest.mark.slow
def test_glue_fine_tunes_a_roberta_folder_and_transformers_loads_the_export(tiny_roberta, tmp_path, capsys):
    """`jaxseq glue` on SST-2 trains the folder (packed rows, the default, and unpacked: the same losses and
    scores, so the packed positions are RoBERTa's), and transformers' RobertaForSequenceClassification loads the
    export with jaxseq's logits on sentences the tokenizer encodes."""
    folder, _ = tiny_roberta
    packed = glue_run(folder, tmp_path / "packed")
    assert "packing 16 examples into" in capsys.readouterr().out
    unpacked = glue_run(folder, tmp_path / "unpacked", "--no_pack_sequences")
    assert packed[0] == pytest.approx(unpacked[0], abs=1e-4) and len(packed[0]) == 4
    assert packed[1]["eval_loss"] == pytest.approx(unpacked[1]["eval_loss"], abs=1e-4)
    assert packed[1]["eval_samples"] == 32

    out = tmp_path / "packed"
    back, info = transformers.RobertaForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert back.config.id2label == {0: "negative", 1: "positive"}
    start = transformers.RobertaForSequenceClassification.from_pretrained(folder)
    moved = [n for n, p in back.named_parameters() if not torch.equal(p, start.state_dict()[n])]
    assert "classifier.out_proj.weight" in moved and "roberta.encoder.layer.0.attention.self.query.weight" in moved
    encoded = transformers.AutoTokenizer.from_pretrained(out)(
        ["a gorgeous film", "dull and far too long"], ["it is", "nothing works"], padding=True, return_tensors="np"
    )
    assert "token_type_ids" not in encoded and (encoded["attention_mask"] == 0).any()
    want = torch_forward(back, **encoded).logits.numpy()
    got = load_pretrained(out, "sequence-classification")(*(jnp.asarray(encoded[k]) for k in encoded))
    assert_close(None, [np.asarray(got)], [want])
