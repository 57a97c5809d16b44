"""Flags no end-to-end run needs, run through their job: parsed by the job's own parser (``parse_job``), then what
the run would build from them (the optimizer, the data and objective of the job's ``prepare``) is checked against
what each flag says; the ``--no_X`` switches against the YAML value they override."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxseq.cli import parse
from jaxseq.commands import clm, generate, mlm, t5_mlm
from jaxseq.runner import Setup, parse_job
from jaxseq.train.optim import decay_mask, make_optimizer
from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")


def prepare_job(module, argv):
    """What ``module``'s job prepares from the command line ``argv`` (its ``prepare`` given a run's ``Setup``)."""
    return module.prepare(Setup(module.JOB, parse_job(module.JOB, argv)))


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """A fresh cache for `datasets`: it keys a local folder's cache by the folder's name, not its content."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


# --------------------------------------------------------------------------- the optimizer


def updates(tx, params, grads, steps=3):
    state, out = tx.init(params), []
    for _ in range(steps):
        update, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, update)
        out.append(params)
    return out


def test_optimizer_flags_make_the_optimizer_they_name(tmp_path):
    """AdamW's betas, weight decay (matrices only), clipping and warmup as the flags give them equal optax's
    own chain; --momentum is SGD's; --lr_groups scales its group's steps."""
    params = {"dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones(4)}, "head": {"kernel": jnp.ones((4, 2))}}
    grads = jax.tree.map(lambda p: 3.0 * jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape) / p.size, params)
    base = ["--model_type", "gpt2", "--learning_rate", "0.1"]
    args = parse_job(
        clm.JOB,
        [*base, "--adam_beta1", "0.5", "--adam_beta2", "0.75", "--weight_decay", "0.2", "--max_grad_norm", "0.5",
         "--warmup_ratio", "0.5", "--lr_scheduler_type", "constant"],
    )  # fmt: skip
    tx, schedule = make_optimizer(args.optimizer, 4)
    assert [float(schedule(s)) for s in range(4)] == pytest.approx([0.0, 0.05, 0.1, 0.1])
    want = optax.chain(
        optax.clip_by_global_norm(0.5),
        optax.adamw(schedule, 0.5, 0.75, 1e-8, weight_decay=0.2, mask=decay_mask),
    )
    for got, expected in zip(updates(tx, params, grads), updates(want, params, grads)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6), got, expected)
    default = updates(make_optimizer(parse_job(clm.JOB, base).optimizer, 4)[0], params, grads)[-1]
    assert not np.allclose(default["dense"]["kernel"], got["dense"]["kernel"])  # the flags changed the steps
    sgd = parse_job(clm.JOB, [*base, "--optimizer", "sgd", "--momentum", "0.5", "--max_grad_norm", "0"])
    want = optax.sgd(make_optimizer(sgd.optimizer, 4)[1], momentum=0.5)
    for got, expected in zip(updates(make_optimizer(sgd.optimizer, 4)[0], params, grads), updates(want, params, grads)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)
    grouped = parse_job(clm.JOB, [*base, "--lr_groups", "head=10", "--optimizer", "sgd", "--momentum", "0"])
    plain = parse_job(clm.JOB, [*base, "--optimizer", "sgd", "--momentum", "0"])
    moved = {
        name: jax.tree.map(lambda a, p: a - p, updates(make_optimizer(c.optimizer, 4)[0], params, grads, 1)[0], params)
        for name, c in (("grouped", grouped), ("plain", plain))
    }
    np.testing.assert_allclose(moved["grouped"]["head"]["kernel"], 10 * moved["plain"]["head"]["kernel"], rtol=1e-5)
    np.testing.assert_allclose(moved["grouped"]["dense"]["kernel"], moved["plain"]["dense"]["kernel"], rtol=1e-5)


# --------------------------------------------------------------------------- the --no_X switches

NEGATIONS = {  # job -> its --no_X switches; each is checked against the job's YAML turning X on
    "glue": ["--no_do_train", "--no_do_eval", "--no_do_predict", "--no_push_to_hub", "--no_hub_dry_run",
             "--no_hub_private_repo", "--no_plan_search", "--no_load_best_model_at_end", "--no_greater_is_better",
             "--no_skip_nonfinite_updates", "--no_eval_with_ema"],
    "mlm": ["--no_line_by_line", "--no_overwrite_cache", "--no_streaming"],
    "ner": ["--no_label_all_tokens", "--no_return_entity_level_metrics"],
    "qa": ["--no_version_2_with_negative"],
    "seq2seq": ["--no_predict_with_generate"],
    "dpo": ["--no_precompute_ref_log_probs"],
    "grpo": ["--no_mask_truncated_completions", "--no_use_bias_correction_kl"],
    "generate": ["--no_do_sample"],
}  # fmt: skip


def parsed_values(job: str, argv: list[str]) -> dict:
    """Every field of ``job``'s config sections, as its ``main`` parses ``argv``."""
    import importlib

    from jaxseq.commands import COMMANDS

    module = importlib.import_module(f"jaxseq.commands.{COMMANDS[job][0]}")
    if module is generate:
        sections = parse(module.__doc__, module.SECTIONS, argv)
    else:
        sections = vars(parse_job(module.JOB, ["--model_type", "gpt2", *argv])).values()
    return {k: v for section in sections for k, v in vars(section).items()}


@pytest.mark.parametrize("job", list(NEGATIONS))
def test_each_no_switch_turns_off_what_the_yaml_turned_on(job, tmp_path):
    names = [flag.removeprefix("--no_") for flag in NEGATIONS[job]]
    config = tmp_path / "on.yaml"
    config.write_text("".join(f"{name}: true\n" for name in names))
    on = parsed_values(job, ["--config", str(config)])
    off = parsed_values(job, ["--config", str(config), *NEGATIONS[job]])
    assert [on[name] for name in names] == [True] * len(names)
    assert [off[name] for name in names] == [False] * len(names)


# --------------------------------------------------------------------------- text data (clm, mlm, t5-mlm)


@pytest.fixture(scope="module")
def text_dataset(tmp_path_factory):
    """A local dataset folder with two configs (`datasets.load_dataset(folder, name)`): `novel` (Botchan) and
    `plays` (Shakespeare), each a train split of records with the text under `body`."""
    root = tmp_path_factory.mktemp("text-dataset")
    sources = {"novel": "data/text/botchan.txt", "plays": "data/text/tinyshakespeare.txt"}
    for name, asset in sources.items():
        lines = [line for line in shared_asset(asset).read_text().splitlines() if line.strip()][:400]
        (root / name).mkdir()
        records = [{"body": " ".join(lines[i : i + 10]), "title": name} for i in range(0, len(lines), 10)]
        (root / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    configs = "".join(
        f"- config_name: {name}\n  data_files:\n  - split: train\n    path: {name}/*.jsonl\n" for name in sources
    )
    (root / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Folders of a tiny GPT-2, a tiny BERT (MiniLM's tokenizer) and a tiny T5 (SentencePiece), configs and
    tokenizers only: ``prepare`` reads no weights."""
    root = tmp_path_factory.mktemp("models")
    gpt2 = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(gpt2 / "vocab.json"), merges=str(gpt2 / "merges.txt"))
    tokenizer.save_pretrained(root / "gpt2")
    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=64).save_pretrained(root / "gpt2")
    minilm = transformers.AutoTokenizer.from_pretrained(shared_asset("models/all-MiniLM-L6-v2"))
    minilm.save_pretrained(root / "bert")
    transformers.BertConfig(
        vocab_size=len(minilm), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=64,
    ).save_pretrained(root / "bert")  # fmt: skip
    (root / "t5").mkdir()
    spm = shared_asset("data/tokenizers/sentencepiece/botchan_en_unigram_1000.model")
    (root / "t5" / "spiece.model").write_bytes(spm.read_bytes())
    t5 = transformers.T5Tokenizer.from_pretrained(root / "t5", extra_ids=100)
    t5.save_pretrained(root / "t5")
    transformers.T5Config(
        vocab_size=len(t5), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, pad_token_id=t5.pad_token_id,
        eos_token_id=t5.eos_token_id, decoder_start_token_id=t5.pad_token_id,
    ).save_pretrained(root / "t5")  # fmt: skip
    return root


TEXT_JOBS = {  # job -> (its module, its flags beyond the dataset's); tokens per block, blocks kept
    "clm": (clm, ["--block_size", "32", "--loss_chunk_tokens", "16"]),
    "mlm": (mlm, ["--block_size", "32", "--mlm_probability", "0.25"]),
    "t5-mlm": (t5_mlm, ["--block_size", "32", "--mlm_probability", "0.25", "--mean_noise_span_length", "2"]),
}


@pytest.mark.parametrize("job", list(TEXT_JOBS))
def test_text_jobs_read_the_dataset_config_column_and_share_the_flags_name(job, text_dataset, models, tmp_path, capsys):
    """--dataset_name a local dataset, --dataset_config_name its `plays` config, --text_column `body`: the
    training blocks are that config's text, tokenized as the model's tokenizer does; without a validation
    split, --validation_split_percentage of the blocks are held out; --max_train_samples and
    --max_eval_samples cut them; --overwrite_cache tokenizes again where the cache had the text; --streaming
    gives the same blocks; each job's own flags shape its objective."""
    module, extra = TEXT_JOBS[job]
    folder = models / {"clm": "gpt2", "mlm": "bert", "t5-mlm": "t5"}[job]
    argv = [
        "--config_name", folder, "--tokenizer_name", folder, "--dataset_name", text_dataset,
        "--dataset_config_name", "plays", "--text_column", "body", "--validation_split_percentage", "25",
        "--data_cache_dir", tmp_path / "cache", "--output_dir", tmp_path / "out", *extra,
    ]  # fmt: skip
    argv = [str(a) for a in argv]
    whole = prepare_job(module, argv)
    train, valid = whole.train["input_ids"], whole.evals[""]["input_ids"]
    blocks = len(train) + len(valid)
    assert len(valid) == max(1, int(blocks * 0.25)) or abs(len(valid) - blocks * 0.25) <= 1
    assert "cached in" in capsys.readouterr().out
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    records = [json.loads(line) for line in (text_dataset / "plays" / "train.jsonl").read_text().splitlines()]
    first = tokenizer(records[0]["body"], add_special_tokens=False)["input_ids"]
    width = 8 if job != "t5-mlm" else 6  # T5's blocks are raw tokens a little longer than --block_size
    assert train[0][:width].tolist() == first[:width]  # plays, not the novel
    cut = prepare_job(module, [*argv, "--max_train_samples", "3", "--max_eval_samples", "2"])
    assert len(cut.train["input_ids"]) == 3 and len(cut.evals[""]["input_ids"]) == 2
    np.testing.assert_array_equal(cut.train["input_ids"], train[:3])
    assert "from the cache" in capsys.readouterr().out
    prepare_job(module, [*argv, "--overwrite_cache"])
    out = capsys.readouterr().out
    assert "cached in" in out and "from the cache" not in out
    if job != "clm":
        streamed = prepare_job(module, [*argv, "--streaming"])
        np.testing.assert_array_equal(streamed.train["input_ids"], train)
    (tmp_path / "valid.txt").write_text(shared_asset("data/text/botchan.txt").read_text()[:4000])
    given = prepare_job(module, [*argv, "--validation_file", str(tmp_path / "valid.txt")])
    assert len(given.train["input_ids"]) == blocks  # none held out: the validation file's blocks evaluate
    assert 0 < len(given.evals[""]["input_ids"]) != len(valid)
    objective = whole.objective
    if job == "clm":
        assert objective.chunk_tokens == 16
    elif job == "mlm":
        assert train.shape[1] == 32 and objective.probability == 0.25
    else:
        corruption = objective.corruption
        assert corruption.lengths[0] == 32 and corruption.noise_density == 0.25
        assert corruption.mean_noise_span_length == 2 and train.shape[1] == corruption.tokens > 32


# --------------------------------------------------------------------------- chat, dpo, grpo

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def gpt2_model(tmp_path_factory):
    """A tiny GPT-2 folder (weights, and the GPT-2 tokenizer without a chat template)."""
    torch = pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("gpt2")
    gpt2 = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(gpt2 / "vocab.json"), merges=str(gpt2 / "merges.txt"))
    tokenizer.save_pretrained(root)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=128, vocab_size=len(tokenizer))
    transformers.GPT2LMHeadModel(config).save_pretrained(root)
    return root, tokenizer


def dataset(root, configs: dict[str, list[dict]]):
    """A local dataset folder, one train split per config."""
    for name, records in configs.items():
        (root / name).mkdir(parents=True)
        (root / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    listed = "".join(f"- config_name: {n}\n  data_files:\n  - split: train\n    path: {n}/*.jsonl\n" for n in configs)
    (root / "README.md").write_text(f"---\nconfigs:\n{listed}---\n")
    return root


def chats(count: int, words: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"question {i} " + "word " * words},
                      {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(count)
    ]  # fmt: skip


def test_chat_flags_pick_the_data_template_and_rows(gpt2_model, tmp_path):
    """--dataset_name/--dataset_config_name (`long`: 20 chats), --chat_template (the GPT-2 tokenizer has none),
    --no_pack_sequences (one chat a row) against --pack_sequences (several), --validation_split_percentage,
    --max_train_samples, --max_eval_samples; --loss_chunk_tokens and --peak_flops reach the run."""
    from jaxseq.commands import chat
    from jaxseq.train.throughput import peak_flops

    folder, tokenizer = gpt2_model
    data = dataset(tmp_path / "chats", {"short": chats(4, 1), "long": chats(20, 6)})
    argv = [
        "--model_name_or_path", folder, "--dataset_name", data, "--dataset_config_name", "long",
        "--chat_template", TEMPLATE, "--max_seq_length", "64", "--validation_split_percentage", "20",
        "--loss_chunk_tokens", "32", "--peak_flops", "2e12", "--output_dir", tmp_path / "out",
    ]  # fmt: skip
    argv = [str(a) for a in argv]
    rows = prepare_job(chat, [*argv, "--no_pack_sequences"])
    train, valid = rows.train, rows.evals[""]
    assert (len(train["input_ids"]), len(valid["input_ids"])) == (16, 4)  # one chat a row, 20% held out
    text = tokenizer.decode(train["input_ids"][0][train["attention_mask"][0] > 0])
    assert text.startswith("<|user|>\nquestion") and "word word word" in text  # the long config, the template
    packed = prepare_job(chat, [*argv, "--pack_sequences"])
    assert len(packed.train["input_ids"]) < 16 and packed.train["attention_mask"].max() > 1
    cut = prepare_job(chat, [*argv, "--no_pack_sequences", "--max_train_samples", "5", "--max_eval_samples", "2"])
    assert (len(cut.train["input_ids"]), len(cut.evals[""]["input_ids"])) == (5, 2)
    assert rows.objective.chunk_tokens == 32
    args = parse_job(chat.JOB, argv)
    assert peak_flops(jax.devices(), "float32", args.speed.peak_flops)[0] == 2e12


PAIRS = [
    {"prompt": f"Number {i} is the question asked", "chosen": f" a good answer {i} here", "rejected": f" bad {i}"}
    for i in range(12)
]


def test_dpo_flags_shape_the_pairs_and_the_loss(gpt2_model, tmp_path):
    """--dataset_name/--dataset_config_name, --validation_split_percentage, --max_train_samples,
    --max_eval_samples pick the pairs; --max_prompt_length keeps a prompt's last tokens and
    --max_completion_length a completion's first, --truncation_mode keep_start cuts a long pair's end; the
    loss is the one --loss_type, --beta, --label_smoothing, --simpo_gamma, --cpo_alpha and --loss_chunk_tokens
    name; conversations need --chat_template."""
    from jaxseq.commands import dpo

    folder, tokenizer = gpt2_model
    conversations = [
        {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
         "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go away"}]}
    ] * 4  # fmt: skip
    data = dataset(tmp_path / "pairs", {"plain": PAIRS, "chats": conversations})
    base = ["--model_name_or_path", str(folder), "--dataset_name", str(data), "--output_dir", str(tmp_path / "o")]
    argv = [*base, "--dataset_config_name", "plain", "--validation_split_percentage", "25"]
    whole = prepare_job(dpo, argv)
    assert (len(whole.train["input_ids"]), len(whole.evals[""]["input_ids"])) == (9, 3)
    cut = prepare_job(
        dpo,
        [*argv, "--max_train_samples", "4", "--max_eval_samples", "2", "--max_prompt_length", "2",
         "--max_completion_length", "3"],
    )  # fmt: skip
    assert (len(cut.train["input_ids"]), len(cut.evals[""]["input_ids"])) == (4, 2)
    prompt = tokenizer(PAIRS[0]["prompt"])["input_ids"]
    chosen = tokenizer(PAIRS[0]["chosen"])["input_ids"]
    row, completion = cut.train["input_ids"][0, 0], cut.train["completion_mask"][0, 0] > 0
    assert row[cut.train["pair_mask"][0, 0] > 0][:2].tolist() == prompt[-2:]  # the prompt's last 2 tokens
    assert row[completion].tolist()[:3] == chosen[:3] and completion.sum() <= 4  # 3 (and EOS, if TRL adds one)
    start = prepare_job(
        dpo, [*argv, "--max_prompt_length", "3", "--max_length", "5", "--truncation_mode", "keep_start"]
    )
    assert start.train["input_ids"][0, 0][:5].tolist() == prompt[-3:] + chosen[:2]  # the pair's end cut
    loss = parse_job(
        dpo.JOB,
        [*argv, "--loss_type", "simpo", "--beta", "2.5", "--label_smoothing", "0.1", "--simpo_gamma", "0.7",
         "--cpo_alpha", "0.3", "--loss_chunk_tokens", "64"],
    )  # fmt: skip
    objective = dpo.prepare(Setup(dpo.JOB, loss)).objective
    assert (objective.loss_type, objective.beta, objective.label_smoothing) == ("simpo", 2.5, 0.1)
    assert (objective.simpo_gamma, objective.nll_weight, objective.lm.chunk_tokens) == (0.7, 0.3, 64)
    assert not objective.needs_reference  # SimPO needs no reference model
    chats_argv = [*base, "--dataset_config_name", "chats", "--validation_split_percentage", "25"]
    with pytest.raises(Exception, match="--chat_template"):
        prepare_job(dpo, chats_argv)
    rendered = prepare_job(dpo, [*chats_argv, "--chat_template", TEMPLATE])
    assert "<|assistant|>" in tokenizer.decode(rendered.train["input_ids"][0, 0])


def test_grpo_flags_reach_the_prompts_the_sampling_and_the_loss(gpt2_model, tmp_path):
    """--dataset_name/--dataset_config_name, --chat_template (conversations), --max_prompt_length (a prompt's
    last tokens), --max_train_samples; the sampling (--temperature, --top_p, --top_k) and loss settings
    (--beta, --use_bias_correction_kl, --epsilon, --epsilon_high, --num_iterations, --loss_type,
    --scale_rewards, --mask_truncated_completions) are the run's objective's."""
    from jaxseq.commands import grpo

    folder, tokenizer = gpt2_model
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    prompts = [{"prompt": [{"role": "user", "content": f"Tell me about the number {i} please"}]} for i in range(16)]
    data = dataset(tmp_path / "prompts", {"other": [{"prompt": "x"}] * 16, "chats": prompts})
    argv = [
        "--model_name_or_path", folder, "--dataset_name", data, "--dataset_config_name", "chats",
        "--chat_template", TEMPLATE, "--max_prompt_length", "5", "--max_train_samples", "12",
        "--reward_funcs", f"{rewards}:length", "--num_generations", "2", "--per_device_train_batch_size", "2",
        "--max_completion_length", "4", "--output_dir", tmp_path / "out",
        "--temperature", "0.7", "--top_p", "0.9", "--top_k", "20", "--beta", "0.05", "--use_bias_correction_kl",
        "--epsilon", "0.1", "--epsilon_high", "0.3", "--num_iterations", "2", "--loss_type", "dr_grpo",
        "--scale_rewards", "batch", "--mask_truncated_completions",
    ]  # fmt: skip
    prepared = prepare_job(grpo, [str(a) for a in argv])
    rollout = prepared.objective.rollout_source
    assert len(rollout.prompts["input_ids"]) == 12 and rollout.prompts["input_ids"].shape[1] == 5
    rendered = tokenizer.apply_chat_template(prompts[0]["prompt"], chat_template=TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    assert rollout.prompts["input_ids"][0].tolist() == tokenizer(rendered)["input_ids"][-5:]
    config = prepared.objective.config
    assert (config.temperature, config.top_p, config.top_k, config.beta) == (0.7, 0.9, 20, 0.05)
    assert (config.epsilon, config.epsilon_high, config.num_iterations) == (0.1, 0.3, 2)
    assert (config.loss_type, config.scale_rewards) == ("dr_grpo", "batch")
    assert config.use_bias_correction_kl and config.mask_truncated_completions and prepared.objective.needs_reference


# --------------------------------------------------------------------------- ner, qa


def split_dataset(root, name: str, splits: dict[str, list[dict]]):
    """A local dataset folder with one config ``name`` of these splits."""
    for split, records in splits.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    files = "".join(f"  - split: {s}\n    path: {name}/{s}.jsonl\n" for s in splits)
    (root / "README.md").write_text(f"---\nconfigs:\n- config_name: {name}\n  data_files:\n{files}---\n")
    return root


SENTENCES = [
    {"words": ["Kenshiro", "visited", "Yokohama", "yesterday"], "tags": ["B-PER", "O", "B-LOC", "O"]},
    {"words": ["Botchan", "taught", "in", "Matsuyama"], "tags": ["B-PER", "O", "O", "B-LOC"]},
    {"words": ["Nothing", "here"], "tags": ["O", "O"]},
] * 3


def test_ner_flags_pick_columns_samples_sub_token_tags_packing_and_metrics(tmp_path):
    """--dataset_config_name's splits with --text_column_name/--label_column_name (neither the default name),
    each cut by --max_train_samples, --max_eval_samples, --max_predict_samples; --label_all_tokens tags every
    sub-token; --no_pack_sequences/--pack_sequences; --return_entity_level_metrics adds each entity's scores."""
    from jaxseq.commands import ner

    data = split_dataset(tmp_path / "ner", "words", {"train": SENTENCES, "validation": SENTENCES, "test": SENTENCES})
    argv = [
        "--model_name_or_path", shared_asset("models/all-MiniLM-L6-v2"), "--dataset_name", data,
        "--dataset_config_name", "words", "--text_column_name", "words", "--label_column_name", "tags",
        "--do_train", "--do_eval", "--do_predict", "--max_train_samples", "5", "--max_eval_samples", "4",
        "--max_predict_samples", "2", "--max_seq_length", "16", "--output_dir", tmp_path / "out",
    ]  # fmt: skip
    argv = [str(a) for a in argv]
    setup = Setup(ner.JOB, parse_job(ner.JOB, [*argv, "--no_pack_sequences"]))
    first = ner.prepare(setup)
    every = prepare_job(ner, [*argv, "--label_all_tokens", "--pack_sequences"])
    sizes = (len(first.train), len(first.evals[""]), len(first.predicts[""]))
    assert sizes == (5, 4, 2)
    assert first.pack is None and every.pack is not None
    tagged = [(rows.train.take(np.arange(5))["labels"] >= 0).sum() for rows in (first, every)]
    assert tagged[0] == sum(len(s["words"]) for s in SENTENCES[:5]) < tagged[1]  # sub-tokens of Kenshiro, ...
    names = setup.config.id2label  # the run's model config: the tags' names
    assert sorted(names.values()) == ["B-LOC", "B-PER", "O"]  # the tags column's names
    labels = first.evals[""].take(np.arange(4))["labels"]
    outputs = {"loss_sum": np.ones(4), "tokens": np.ones(4), "prediction": labels, "labels": labels}
    entity = prepare_job(ner, [*argv, "--return_entity_level_metrics"]).objective
    assert "PER_f1" in entity.metrics(outputs) and "PER_f1" not in first.objective.metrics(outputs)


CONTEXT = "Botchan was a teacher who moved from Tokyo to Matsuyama to teach mathematics at the middle school there."
QUESTIONS = [
    {"id": f"q{i}", "title": "botchan", "context": CONTEXT, "question": question,
     "answers": {"text": [text], "answer_start": [CONTEXT.index(text)]}}
    for i, (question, text) in enumerate(
        [("Where did he move to?", "Matsuyama"), ("What did he teach?", "mathematics"),
         ("Where did he move from?", "Tokyo"), ("Who was a teacher?", "Botchan")] * 2
    )
]  # fmt: skip


def test_qa_flags_pick_the_questions_and_shape_the_answers(tmp_path):
    """--dataset_name/--dataset_config_name's splits (or --test_file's questions), cut by --max_train_samples,
    --max_eval_samples, --max_predict_samples; --no_pack_sequences/--pack_sequences; from the same logits,
    --n_best_size bounds each question's n-best list, --max_answer_length each answer, and
    --null_score_diff_threshold decides between an answer and none (--version_2_with_negative)."""
    from jaxseq.commands import qa

    data = split_dataset(tmp_path / "squad", "tiny", {"train": QUESTIONS, "validation": QUESTIONS, "test": QUESTIONS})
    out = tmp_path / "out"
    argv = [
        "--model_name_or_path", shared_asset("models/all-MiniLM-L6-v2"), "--dataset_name", data,
        "--dataset_config_name", "tiny", "--do_train", "--do_eval", "--do_predict", "--max_train_samples", "6",
        "--max_eval_samples", "4", "--max_predict_samples", "3", "--max_seq_length", "48", "--doc_stride", "16",
        "--output_dir", out,
    ]  # fmt: skip
    argv = [str(a) for a in argv]
    unpacked = prepare_job(qa, [*argv, "--no_pack_sequences"])
    assert unpacked.pack is None and prepare_job(qa, [*argv, "--pack_sequences"]).pack
    windows = len(unpacked.evals[""])
    assert len(unpacked.predicts[""]) < windows < len(unpacked.train)  # 3, 4 and 6 questions' windows
    files = [a for a in argv if a not in ("--dataset_name", str(data), "--dataset_config_name", "tiny")]
    test_file = str(data / "tiny" / "test.jsonl")
    predicting = prepare_job(qa, [*files, "--test_file", test_file, "--no_do_train", "--no_do_eval"])
    assert predicting.train is None and not predicting.evals
    np.testing.assert_array_equal(
        predicting.predicts[""].take(np.arange(3))["input_ids"], unpacked.predicts[""].take(np.arange(3))["input_ids"]
    )
    logits = np.random.default_rng(0).normal(size=(windows, 48, 2)).astype(np.float32)

    def answers(*flags):
        prepared = prepare_job(qa, [*argv, *flags])
        prepared.objective.score(logits)
        predicted = json.loads((out / "eval_predictions.json").read_text())
        return predicted, json.loads((out / "eval_nbest_predictions.json").read_text())

    predicted, nbest = answers("--n_best_size", "2", "--max_answer_length", "2")
    assert len(predicted) == 4 and all(1 <= len(n) <= 2 for n in nbest.values())
    assert all(len(text.split()) <= 2 for text in predicted.values())  # at most 2 tokens, at most 2 words
    longer, nbest = answers("--n_best_size", "5", "--max_answer_length", "30")
    assert max(len(n) for n in nbest.values()) > 2 and longer != predicted
    never, _ = answers("--version_2_with_negative", "--null_score_diff_threshold", "1e9")
    always, _ = answers("--version_2_with_negative", "--null_score_diff_threshold=-1e9")
    assert all(never.values()) and not any(always.values())


# --------------------------------------------------------------------------- glue, seq2seq


def test_glue_reads_its_validation_file_and_cuts_the_test_set(tmp_path):
    """--validation_file is what evaluates (not the training file's sentences); --max_predict_samples cuts
    --test_file's."""
    from jaxseq.commands import glue

    def csv(name, sentences):
        (tmp_path / name).write_text("sentence,label\n" + "".join(f"{s},{i % 2}\n" for i, s in enumerate(sentences)))
        return str(tmp_path / name)

    argv = [
        "--model_name_or_path", str(shared_asset("models/all-MiniLM-L6-v2")), "--task_name", "sst2",
        "--train_file", csv("train.csv", [f"a fine film {i}" for i in range(8)]),
        "--validation_file", csv("dev.csv", [f"a dull film {i}" for i in range(5)]),
        "--test_file", csv("test.csv", [f"a new film {i}" for i in range(6)]), "--max_predict_samples", "4",
        "--do_train", "--do_eval", "--do_predict", "--output_dir", str(tmp_path / "out"),
    ]  # fmt: skip
    prepared = prepare_job(glue, argv)
    (valid,) = prepared.evals.values()
    (test,) = prepared.predicts.values()
    assert (len(prepared.train), len(valid), len(test)) == (8, 5, 4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(shared_asset("models/all-MiniLM-L6-v2"))
    ids = valid.take(np.arange(1))["input_ids"][0]
    assert tokenizer.decode(ids[ids != tokenizer.pad_token_id], skip_special_tokens=True).startswith("a dull film")


def test_seq2seq_reads_its_columns_and_generates_as_long_as_asked(models, tmp_path):
    """--source_column/--target_column name the pair's columns, --max_eval_samples and --max_predict_samples cut
    the evaluation and test pairs, --generation_max_length bounds the generated answers, which evaluation
    generates with --predict_with_generate only."""
    from jaxseq.commands import seq2seq

    pairs = [{"question": f"copy {i} {i}", "answer": f"{i} {i}"} for i in range(6)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    path = str(tmp_path / "pairs.jsonl")
    argv = [
        "--config_name", str(models / "t5"), "--tokenizer_name", str(models / "t5"), "--train_file", path,
        "--validation_file", path, "--test_file", path, "--do_train", "--do_eval", "--do_predict",
        "--source_column", "question", "--target_column", "answer", "--max_predict_samples", "2",
        "--max_eval_samples", "3", "--generation_max_length", "7", "--output_dir", str(tmp_path / "out"),
    ]  # fmt: skip
    prepared = prepare_job(seq2seq, argv)
    assert (len(prepared.train), len(prepared.evals[""]), len(prepared.predicts[""])) == (6, 3, 2)
    assert "generating up to 7 tokens" in prepared.summary(None)
    no_test = [  # training and evaluation, no --test_file
        *argv[:4], "--train_file", path, "--validation_file", path, "--source_column", "question",
        "--target_column", "answer", "--generation_max_length", "7", "--output_dir", str(tmp_path / "out"),
    ]  # fmt: skip
    for flag, generates in (("--predict_with_generate", True), ("--no_predict_with_generate", False)):
        summary = prepare_job(seq2seq, [*no_test, flag]).summary(None)
        assert ("generating up to 7 tokens" in summary) == generates
    tokenizer = transformers.AutoTokenizer.from_pretrained(models / "t5")
    row = prepared.train.take(np.arange(1))
    assert tokenizer.decode(row["input_ids"][0], skip_special_tokens=True) == "copy 0 0"
    assert tokenizer.decode(row["labels"][0][row["labels"][0] >= 0], skip_special_tokens=True) == "0 0"


# --------------------------------------------------------------------------- generate


def test_generate_sampling_flags_and_min_new_tokens(gpt2_model, tmp_path):
    """Sampling at --temperature near 0, or with a --top_p nucleus of one token, gives the greedy completion
    where plain sampling at a high temperature does not; --config_overrides changes the model; with the first
    greedy token made the tokenizer's EOS, a completion ends there unless --min_new_tokens holds it off."""
    folder, tokenizer = gpt2_model
    prompts = ["The quick brown fox", "In 1905, Einstein published"]

    def run(model, *flags):
        out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}.jsonl"
        argv = ["--model_name_or_path", str(model), "--output_file", str(out), "--max_new_tokens", "6", "--seed", "3"]
        assert generate.main([*argv, *(a for p in prompts for a in ("--prompt", p)), *flags]) == 0
        return [json.loads(line) for line in out.read_text().splitlines()]

    greedy = run(folder)
    assert [r["completion"] for r in run(folder, "--do_sample", "--temperature", "1e-4")] == [
        r["completion"] for r in greedy
    ]
    hot = ["--do_sample", "--temperature", "50"]
    assert [r["completion"] for r in run(folder, *hot)] != [r["completion"] for r in greedy]
    assert [r["completion"] for r in run(folder, *hot, "--top_p", "1e-6")] == [r["completion"] for r in greedy]
    overridden = run(folder, "--config_overrides", "layer_norm_epsilon=100.0")  # the model's norms all but off
    assert [r["completion"] for r in overridden] != [r["completion"] for r in greedy]
    first = tokenizer(greedy[0]["completion"])["input_ids"][0]
    stops = tmp_path / "stops"
    tokenizer.save_pretrained(stops)
    for name in ("config.json", "model.safetensors"):
        (stops / name).write_bytes((folder / name).read_bytes())
    config = json.loads((stops / "tokenizer_config.json").read_text())
    (stops / "tokenizer_config.json").write_text(
        json.dumps({**config, "eos_token": tokenizer.convert_ids_to_tokens(first)})
    )
    assert run(stops)[0]["completion_tokens"] == 1
    assert run(stops, "--min_new_tokens", "4")[0]["completion_tokens"] >= 4


# --------------------------------------------------------------------------- training runs and the Hub


def train_clm(models, tmp_path, name, *flags):
    """A tiny in-process `jaxseq clm` run on Botchan's first lines; its output folder."""
    text = tmp_path / "botchan.txt"
    if not text.exists():
        lines = shared_asset("data/text/botchan.txt").read_text().splitlines()[:300]
        text.write_text("\n".join(lines) + "\n")
    out = tmp_path / name
    argv = [
        "--config_name", models / "gpt2", "--tokenizer_name", models / "gpt2", "--train_file", text,
        "--block_size", "32", "--max_eval_samples", "8", "--per_device_train_batch_size", "2",
        "--per_device_eval_batch_size", "1", "--logging_steps", "1", "--learning_rate", "1e-2",
        "--data_cache_dir", tmp_path / "cache", "--output_dir", out, *flags,
    ]  # fmt: skip
    assert clm.main([str(a) for a in argv]) == 0
    return out


def logged(out, key):
    return [r[key] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if key in r]


@pytest.mark.slow
def test_epochs_checkpoints_kept_lora_export_and_hub_flags(models, tmp_path, capsys, monkeypatch):
    """--num_train_epochs sets the run's steps; --save_total_limit 1 keeps the last checkpoint only;
    --lora_alpha, --lora_dropout and --lora_trainable are the exported adapter's; the push (a stand-in Hub API)
    creates --hub_model_id's repo private with --hub_private_repo, from the job and from `jaxseq push`."""
    from jaxseq.commands import push
    from jaxseq.hub_push import push_run

    out = train_clm(
        models, tmp_path, "run", "--num_train_epochs", "2", "--save_steps", "1", "--save_total_limit", "1",
        "--lora_rank", "2", "--lora_alpha", "4", "--lora_dropout", "0.1", "--lora_trainable", "ln_f",
        "--lora_export", "adapter",
    )  # fmt: skip
    printed = capsys.readouterr().out
    blocks = int(printed.split(" training / ")[0].split()[-1].replace(",", ""))
    steps = 2 * (blocks // 16)  # 8 devices x 2 a device: whole batches an epoch
    assert f"{steps} steps of global batch 16" in printed and len(logged(out, "train/loss")) == steps
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [str(steps)]
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (2, 4.0, 0.1)
    assert adapter["modules_to_save"] == ["transformer.ln_f"]
    created = []

    class Hub:  # the part of huggingface_hub.HfApi a push uses
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=False, exist_ok=False):
            created.append((repo_id, private))
            return type("Url", (), {"repo_id": repo_id, "__str__": lambda self: f"https://hf.co/{repo_id}"})()

        def upload_folder(self, repo_id, folder_path, commit_message):
            assert (Path(folder_path) / "adapter_config.json").is_file()

    monkeypatch.setattr("huggingface_hub.HfApi", Hub)
    base = ["--config_name", str(models / "gpt2"), "--output_dir", str(out), "--push_to_hub"]
    for flags in (["--hub_model_id", "someone/private", "--hub_private_repo"], ["--no_hub_private_repo"]):
        push_run(parse_job(clm.JOB, [*base, *flags]).hub, out)
    assert push.main([str(out), "someone/pushed", "--hub_private_repo", "--hub_token", "hf_x"]) == 0
    assert created == [("someone/private", True), (out.name, False), ("someone/pushed", True)]


@pytest.mark.slow
def test_best_checkpoint_by_greater_is_better_and_evaluation_with_ema(models, tmp_path):
    """--load_best_model_at_end with --greater_is_better on the loss keeps the worst evaluation's weights (the
    final eval_loss is the highest logged); --ema_decay's average evaluates unless --no_eval_with_ema, which
    evaluates the trained weights: the same training, other evaluations."""
    flags = ["--max_steps", "3", "--eval_steps", "1", "--save_steps", "1", "--ema_decay", "0.5"]
    best = ["--load_best_model_at_end", "--metric_for_best_model", "loss", "--greater_is_better"]
    averaged = train_clm(models, tmp_path, "ema", *flags, *best, "--eval_with_ema")
    trained = train_clm(models, tmp_path, "trained", *flags, "--no_eval_with_ema")
    losses = logged(averaged, "eval/loss")
    assert len(losses) == 3 and len(set(losses)) == 3
    results = json.loads((averaged / "eval_results.json").read_text())
    assert results["eval_loss"] == pytest.approx(max(losses), rel=1e-6)
    assert logged(averaged, "train/loss") == pytest.approx(logged(trained, "train/loss"), rel=1e-6)
    assert logged(trained, "eval/loss")[0] != pytest.approx(losses[0], rel=1e-4)
