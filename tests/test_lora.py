"""LoRA, the parameters' moving average and per-group learning rates, on tiny models: only the adapters (and
the task head) train and the base stays frozen bit for bit; the merged export and the PEFT adapter give the
LoRA model's logits; the average follows its definition; a group trains at its factor times the rate."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.data.glue import get_task  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import from_config, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.train.lora import LoraConfig  # noqa: E402
from jaxseq.train.objectives import CausalLM, SequenceClassification  # noqa: E402
from jaxseq.train.optim import OptimizerConfig, ema_update  # noqa: E402
from jaxseq.train.results import export_model  # noqa: E402
from jaxseq.train.spec import RunSpec  # noqa: E402
from jaxseq.train.trainer import Trainer  # noqa: E402
from jaxseq.train.trainer_config import TrainerConfig  # noqa: E402
from tests.tiny import DEFAULT, tiny_config  # noqa: E402

VOCAB, SEQ, HIDDEN, RANK = 128, 16, 64, 4


def tiny(task="sequence-classification", family="bert", mesh=None, dropout=0.0):
    if family == "bert":
        config = tiny_config(
            "bert", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, max_position_embeddings=64,
            num_labels=2, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        )  # fmt: skip
    elif family == "llama":
        config = FAMILY_CONFIGS["llama"][1]()
    else:
        config = tiny_config(
            "gpt2", vocab_size=VOCAB, n_embd=HIDDEN, n_positions=64, resid_pdrop=dropout, embd_pdrop=dropout,
            attn_pdrop=dropout,
        )  # fmt: skip
    return from_config(config, task, mesh=mesh, seed=0)


def arrays(n, seed=0):
    """Token ids whose label is a rule of the first token (learnable), with padded tails."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (n, SEQ)).astype(np.int32)
    mask = (np.arange(SEQ)[None] < rng.integers(SEQ // 2, SEQ + 1, (n, 1))).astype(np.int32)
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "token_type_ids": np.zeros_like(ids),
        "labels": (ids[:, 0] % 2).astype(np.int32),
    }


def make_trainer(tmp_path, model, mesh, *, lora=None, objective=None, steps=4, dtype="float32", **optim):
    train, dev = arrays(64), arrays(20, seed=1)
    if objective is not None:  # causal LM: ids and mask only
        train, dev = ({k: v[k] for k in ("input_ids", "attention_mask")} for v in (train, dev))
    config = TrainerConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        max_steps=steps,
        logging_steps=1,
        eval_steps=100,
        seed=0,
    )
    optimizer = OptimizerConfig(**{"learning_rate": 1e-2, **optim})
    task = "sequence-classification" if objective is None else "causal-lm"
    objective = objective or SequenceClassification(get_task("sst2"))
    spec = RunSpec(mesh, model.config, task, objective, config, optimizer, lora=lora, dtype=dtype)
    return Trainer(spec, model, train, {"": dev})


def host(tree):
    return {name: np.asarray(x) for name, x in partition.named_leaves(partition.gather(tree))}


def lora_logits(trainer, batch):
    """The LoRA model as it trains (adapters as their own branch, no dropout), not the folded weights."""
    model = trainer.training.lora.training_model(trainer.graphdef, trainer.state.params, trainer.frozen)
    out = model(jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]))
    return np.asarray(getattr(out, "logits", out))


def test_lora_trains_only_adapters_and_the_base_stays_bitwise_frozen(tmp_path):
    mesh = make_mesh("dp=2,mp=4")
    model = tiny(mesh=mesh, dropout=0.1)
    before = host(nnx.state(model))
    trainer = make_trainer(tmp_path, model, mesh, lora=LoraConfig(lora_rank=RANK, lora_dropout=0.1))
    trained = host(trainer.state.params)
    adapters = [n for n in trained if n.endswith(("lora_A", "lora_B"))]
    assert len(adapters) == 2 * 2 * 2  # layers x (query, value) x (A, B)
    assert all("/query/" in n or "/value/" in n for n in adapters)
    assert sorted(set(trained) - set(adapters)) == ["classifier/bias", "classifier/kernel"]
    query = trainer.state.params["bert"]["encoder"]["layer"]["0"]["attention"]["self"]["query"]
    assert query["lora_A"].sharding.spec == P("fsdp", None) and query["lora_B"].sharding.spec == P(None, "mp")
    assert not trained["bert/encoder/layer/0/attention/self/query/lora_B"].any()  # B starts at zero
    sizes = trainer.sizes()
    assert sizes["trainable_parameters"] == 4 * (HIDDEN * RANK + RANK * HIDDEN) + HIDDEN * 2 + 2
    # Adam's two moments of the trainable parameters, plus step counters: nothing of the frozen base
    moments = 2 * 4 * sizes["trainable_parameters"]
    assert moments <= sizes["optimizer_state_bytes"] < moments + 64

    results = trainer.train()
    trainer.close()
    assert results["trainable_parameters"] == sizes["trainable_parameters"]
    after = host(trainer.frozen)
    assert after.keys() == before.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    moved = host(trainer.state.params)
    assert moved["bert/encoder/layer/1/attention/self/value/lora_B"].any()
    assert not np.array_equal(moved["classifier/kernel"], trained["classifier/kernel"])
    batch = arrays(4, seed=5)  # in training, --lora_dropout drops the adapters' input (and nothing else here)
    model = trainer.training.lora.training_model(
        trainer.graphdef, trainer.state.params, trainer.frozen, jax.random.key(1)
    )
    dropped = np.asarray(model(batch["input_ids"], batch["attention_mask"]))
    assert np.abs(dropped - lora_logits(trainer, batch)).max() > 1e-5


def test_merged_export_gives_the_lora_models_logits(tmp_path):
    torch = pytest.importorskip("torch")
    mesh = make_mesh("dp=8")
    trainer = make_trainer(tmp_path / "run", tiny(mesh=mesh), mesh, lora=LoraConfig(lora_rank=RANK), steps=3)
    base = arrays(6, seed=2)
    plain = np.asarray(nnx.merge(trainer.graphdef, trainer.frozen)(base["input_ids"], base["attention_mask"]))
    trainer.train()
    trainer.close()
    want = lora_logits(trainer, base)
    assert np.abs(want - plain).max() > 1e-3  # the adapters and head changed the model

    export_model(trainer, tmp_path / "merged")
    ours = load_pretrained(tmp_path / "merged", "sequence-classification")(base["input_ids"], base["attention_mask"])
    np.testing.assert_allclose(np.asarray(ours), want, atol=1e-5)
    theirs = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        logits = theirs(
            input_ids=torch.as_tensor(base["input_ids"]).long(),
            attention_mask=torch.as_tensor(base["attention_mask"]).long(),
        ).logits.numpy()
    np.testing.assert_allclose(logits, want, atol=1e-4)


PEFT_TARGETS = {"bert": ["query", "value"], "gpt2": ["c_attn"], "llama": ["q_proj", "k_proj", "down_proj"]}


@pytest.mark.parametrize("family", list(PEFT_TARGETS))
def test_peft_adapter_loads_in_peft_with_the_same_logits(tmp_path, family):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    mesh = make_mesh("dp=8")
    task = "sequence-classification" if family == "bert" else "causal-lm"
    model = tiny(task, family, mesh=mesh)
    save_pretrained(model, tmp_path / "base")
    trainer = make_trainer(
        tmp_path / "run",
        model,
        mesh,
        lora=LoraConfig(
            lora_rank=RANK, lora_alpha=8.0, lora_export="adapter", lora_targets=",".join(PEFT_TARGETS[family])
        ),
        objective=None if family == "bert" else CausalLM(),
    )
    # random adapters and head (B too, which starts at zero), so every exported tensor matters
    leaves, treedef = jax.tree.flatten(trainer.state.params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    randomized = [x + 0.2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    trainer.state = dataclasses.replace(trainer.state, params=jax.tree.unflatten(treedef, randomized))
    export_model(trainer, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    trainer.close()
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}

    batch = arrays(5, seed=4)
    want = lora_logits(trainer, batch)
    auto = transformers.AutoModelForSequenceClassification if family == "bert" else transformers.AutoModelForCausalLM
    loaded = peft.PeftModel.from_pretrained(auto.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    with torch.no_grad():
        logits = loaded(
            input_ids=torch.as_tensor(batch["input_ids"]).long(),
            attention_mask=torch.as_tensor(batch["attention_mask"]).long(),
        ).logits.numpy()
    mask = batch["attention_mask"].astype(bool)
    if family != "bert":  # compare real positions only
        logits, want = logits[mask], want[mask]
    np.testing.assert_allclose(logits, want, atol=1e-4)

    # the same tensor names and shapes PEFT itself saves for such a model
    from safetensors.numpy import load_file

    reference = peft.get_peft_model(
        auto.from_pretrained(tmp_path / "base"),
        peft.LoraConfig(
            r=RANK,
            lora_alpha=8,
            target_modules=PEFT_TARGETS[family],
            task_type="SEQ_CLS" if family == "bert" else "CAUSAL_LM",
            fan_in_fan_out=family == "gpt2",
        ),
    )
    expected = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(reference).items()}
    saved = {k: v.shape for k, v in load_file(tmp_path / "adapter" / "adapter_model.safetensors").items()}
    assert saved == expected


def test_a_half_precision_run_stores_the_frozen_base_in_its_compute_dtype(tmp_path):
    """As PEFT users load a bf16 base: a bf16 LoRA run stores its frozen weights in bf16 (half the bytes) and its
    adapters in float32, and trains bit for bit as a float32-stored base holding the same values."""
    mesh = make_mesh("dp=2,fsdp=2,mp=2")
    model = tiny("causal-lm", "llama", mesh=mesh)
    leaves, treedef = jax.tree.flatten(nnx.state(model))
    keys = jax.random.split(jax.random.key(7), len(leaves))
    perturbed = [(x + 0.05 * jax.random.normal(k, x.shape)).astype(jnp.bfloat16) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(treedef, [x.astype(jnp.float32) for x in perturbed]))
    save_pretrained(model, tmp_path / "base")
    lora = LoraConfig(lora_rank=RANK, lora_targets="q_proj,v_proj,down_proj", lora_trainable="lm_head")
    runs = {}
    for stored in ("bfloat16", "float32"):
        loaded = load_pretrained(tmp_path / "base", "causal-lm", mesh=mesh, dtype=jnp.bfloat16, param_dtype=stored)
        trainer = make_trainer(tmp_path / stored, loaded, mesh, lora=lora, objective=CausalLM(), dtype="bfloat16")
        trainer.train()
        trainer.close()
        runs[stored] = trainer
    half = runs["bfloat16"]
    assert half.spec.param_dtype == jnp.bfloat16  # what the run itself builds, and what a plan counts
    assert {x.dtype for x in jax.tree.leaves(nnx.state(half.spec.abstract_model()))} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(half.frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(half.state.params)} == {jnp.dtype(jnp.float32)}
    trained = host(half.state.params)
    assert trained["lm_head/kernel"].dtype == np.float32 and trained["model/layers/0/mlp/down_proj/lora_B"].any()
    plain = host(runs["float32"].state.params)
    assert trained.keys() == plain.keys()
    for name in trained:
        np.testing.assert_array_equal(trained[name], plain[name], err_msg=name)


def test_ema_update_on_a_known_sequence():
    ema = jnp.zeros(())
    for value, want in zip((1.0, 2.0, 3.0), (0.5, 1.25, 2.125)):
        ema = ema_update(ema, jnp.float32(value), 0.5)
        assert float(ema) == want


def test_ema_in_training_follows_its_definition_and_is_what_evaluates(tmp_path):
    mesh = make_mesh("dp=2,mp=4")
    trainer = make_trainer(
        tmp_path,
        tiny(mesh=mesh),
        mesh,
        optimizer="sgd",
        momentum=0.0,
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        ema_decay=0.75,
    )
    spec = lambda tree: [x.sharding.spec for x in jax.tree.leaves(tree)]
    assert spec(trainer.state.ema) == spec(trainer.state.params)
    expected = {k: v.astype(np.float64) for k, v in host(trainer.state.params).items()}
    batches = trainer.feed.batches()
    for _ in range(4):
        trainer.state, _ = trainer._train_step(trainer.state, next(batches))
        params = host(trainer.state.params)
        expected = {k: 0.75 * expected[k] + 0.25 * params[k] for k in expected}
    ema = host(trainer.state.ema)
    assert any(np.abs(ema[k] - params[k]).max() > 1e-4 for k in ema)  # the average lags the parameters
    for name in expected:
        np.testing.assert_allclose(ema[name], expected[name], atol=2e-6, err_msg=name)
    exported = host(nnx.state(trainer.model()))
    for name in ema:
        np.testing.assert_array_equal(exported[name], ema[name])
    trainer.close()


def test_a_learning_rate_group_moves_by_its_factor(tmp_path):
    mesh = make_mesh("dp=8")
    kw = dict(
        optimizer="sgd", momentum=0.0, learning_rate=0.05, lr_scheduler_type="constant", max_grad_norm=0.0, steps=1
    )
    deltas = []
    for groups in (None, "classifier=10"):
        trainer = make_trainer(tmp_path / str(groups), tiny(mesh=mesh), mesh, lr_groups=groups, **kw)
        start = host(trainer.state.params)
        trainer.state, _ = trainer._train_step(trainer.state, next(trainer.feed.batches()))
        deltas.append({k: v - start[k] for k, v in host(trainer.state.params).items()})
        trainer.close()
    plain, grouped = deltas
    for name in plain:
        factor = 10.0 if name.startswith("classifier/") else 1.0
        assert np.abs(plain[name]).max() > 0, name
        np.testing.assert_allclose(grouped[name], factor * plain[name], rtol=1e-4, atol=1e-8, err_msg=name)

    with pytest.raises(JaxseqError, match="match no trained parameter"):
        make_trainer(tmp_path / "typo", tiny(mesh=mesh), mesh, lr_groups="clasifier=10", **kw)


FAMILY_CONFIGS = {
    "bert": (
        "sequence-classification",
        lambda: tiny_config(
            "bert", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, max_position_embeddings=DEFAULT
        ),
    ),
    "gpt2": ("causal-lm", lambda: tiny_config("gpt2", vocab_size=VOCAB, n_embd=HIDDEN, n_positions=DEFAULT)),
    "gptj": (
        "causal-lm",
        lambda: tiny_config("gptj", vocab_size=VOCAB, n_embd=HIDDEN, rotary_dim=8, n_positions=DEFAULT),
    ),
    "t5": (
        "seq2seq-lm",
        lambda: tiny_config("t5", vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=128, num_decoder_layers=2),
    ),
    **{
        family: (
            "causal-lm",
            lambda family=family: tiny_config(
                family, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, max_position_embeddings=64
            ),
        )
        for family in ("llama", "mistral", "qwen2")
    },
}


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_default_targets_are_peft_defaults(family):
    """Without --lora_targets, each family adapts the modules PEFT adapts by default; the task head of a
    classifier trains in full, a language model's head does not."""
    constants = pytest.importorskip("peft.utils.constants")
    from jaxseq.partition import get_partition_rules, match_partition_rules
    from jaxseq.train.lora import Lora

    task, config = FAMILY_CONFIGS[family]
    model = nnx.eval_shape(lambda: from_config(config(), task))
    lora = Lora(LoraConfig(lora_rank=RANK), model, match_partition_rules(get_partition_rules(family), nnx.state(model)))
    names = {lora.layout[(*path, "kernel")][0].removesuffix(".weight") for path in lora.targets}
    wanted = constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[family]
    assert {name.rsplit(".", 1)[-1] for name in names} == set(wanted)
    layers = 2 if family != "t5" else 2 + 2 * 2  # T5: encoder self-attention, decoder self- and cross-attention
    assert len(names) == layers * len(wanted)
    assert sorted("/".join(map(str, p)) for p in lora.full) == (
        ["classifier/bias", "classifier/kernel"] if family == "bert" else []
    )
