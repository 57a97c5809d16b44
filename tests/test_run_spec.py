"""One run spec for a run and its plan: the train step a plan compiles is the run's own. For a packed GLUE
run, a causal-LM run and a chat run, the step lowered from the run's path (the model built with its weights,
the Trainer's state, the feeder's first real batch) and from the plan's path (abstract weights, the batch
the plan derives) on the same mesh give the same StableHLO text, for every row count the run steps on."""

import itertools
import json

import jax
import pytest
import transformers

from jaxseq.commands import chat, clm, glue, ner, qa
from jaxseq.mesh import make_mesh
from jaxseq.runner import Setup, parse_job, plan_programs, spec_of
from jaxseq.train.trainer import Trainer
from tests.conftest import shared_asset

COMMON = ["--max_steps", "6", "--per_device_train_batch_size", "2", "--report_to", "none", "--seed", "3"]


def lowered_texts(job, argv, mesh):
    """(run path's StableHLO per row count, plan path's, the run's batch names)."""
    args = parse_job(job, argv)
    setup = Setup(job, args, mesh=mesh)
    prepared = job.prepare(setup)
    spec = spec_of(setup, prepared)
    trainer = Trainer(spec, spec.build_model(setup.checkpoint, setup.overrides), prepared.train, prepared.evals)
    try:
        run = {}
        for batch in itertools.islice(trainer.feed.batches(), trainer.total_steps):
            rows = batch["input_ids"].shape[-2]
            if rows not in run:
                run[rows] = trainer.program.step.lower(trainer.state, trainer.frozen, batch).as_text()
        names = set(batch)
    finally:
        trainer.close()
    planning = Setup(job, args, planning=True, mesh=mesh)
    planned = job.prepare(planning)
    program, batches = plan_programs(spec_of(planning, planned), planned)
    plan = {
        b["input_ids"].shape[-2]: program.step.lower(program.abstract_state, program.abstract_frozen, b).as_text()
        for b in batches
    }
    return run, plan, names


def test_a_packed_glue_plan_compiles_the_runs_own_steps(tmp_path):
    argv = [
        "--model_name_or_path", shared_asset("models/all-MiniLM-L6-v2"), "--data_dir", shared_asset("data/glue"),
        "--task_name", "sst2", "--max_train_samples", "48", "--max_eval_samples", "8", "--max_seq_length", "64",
        "--output_dir", tmp_path, *COMMON,
    ]  # fmt: skip
    run, plan, names = lowered_texts(glue.JOB, list(map(str, argv)), make_mesh("dp=4,fsdp=2"))
    assert {"pool_index", "position_ids"} <= names  # packed: segment ids in attention_mask
    assert run.keys() == plan.keys() and len(run) >= 1
    for rows in run:
        assert run[rows] == plan[rows]


def test_a_causal_lm_plan_compiles_the_runs_own_step(tmp_path):
    root = tmp_path / "assets"
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.save_pretrained(root / "tokenizer")
    transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2).save_pretrained(root / "config")
    argv = [
        "--config_name", root / "config", "--tokenizer_name", root / "tokenizer", "--block_size", "32",
        "--train_file", shared_asset("data/text/tinyshakespeare.txt"), "--max_eval_samples", "4",
        "--output_dir", tmp_path / "out", "--remat", "--gradient_accumulation_steps", "2", *COMMON,
    ]  # fmt: skip
    run, plan, _ = lowered_texts(clm.JOB, list(map(str, argv)), make_mesh("dp=2,fsdp=2,mp=2"))
    assert run == plan


def test_a_chat_plan_compiles_the_runs_own_step(tmp_path):
    root = tmp_path / "model"
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer.save_pretrained(root)
    transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=50257, max_position_embeddings=128,
    ).save_pretrained(root)  # fmt: skip
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Question {i}?"},
                        {"role": "assistant", "content": "No." * i},
                    ]
                }
            )
            + "\n"
            for i in range(40)
        )
    )
    argv = [
        "--config_name", root, "--tokenizer_name", root, "--train_file", chats, "--max_seq_length", "64",
        "--output_dir", tmp_path / "out", *COMMON,
    ]  # fmt: skip
    run, plan, names = lowered_texts(chat.JOB, list(map(str, argv)), make_mesh("dp=8"))
    assert "loss_mask" in names
    assert run == plan


def test_ner_and_qa_plans_compile_the_runs_own_steps(tmp_path):
    """Token classification (CoNLL-2003 sentences) and question answering (windows of a SQuAD file): one
    example or window a row, the plan's step is the run's."""
    from tests.test_qa import SQUAD

    conll = shared_asset("data/ner/conll2003-test.json").read_text().splitlines()
    (tmp_path / "ner.json").write_text("\n".join(conll[:16]) + "\n")
    (tmp_path / "squad.json").write_text(json.dumps(SQUAD))
    model = ["--model_name_or_path", shared_asset("models/all-MiniLM-L6-v2"), "--do_train", "--max_seq_length", "32"]
    for job, data in (
        (ner.JOB, ["--train_file", tmp_path / "ner.json"]),
        (qa.JOB, ["--train_file", tmp_path / "squad.json", "--doc_stride", "12"]),
    ):
        argv = [*model, *data, "--output_dir", tmp_path / job.task, *COMMON]
        run, plan, names = lowered_texts(job, list(map(str, argv)), make_mesh("dp=4,fsdp=2"))
        assert "labels" in names or "start_positions" in names
        assert run == plan


@pytest.fixture(autouse=True)
def _cpu():
    assert jax.device_count() == 8
