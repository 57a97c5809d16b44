"""Every training job's stage flags, one definition as transformers' TrainingArguments gives every run_* script:
each job's --help lists --do_train and --do_eval (and --do_predict where it predicts) saying what they do; run
in this process on tiny models, --do_train --do_eval trains then evaluates, --do_eval alone evaluates the given
model (no step, nothing exported, the figures of the run that trained it), --do_train alone evaluates nothing,
--do_predict writes the job's predictions; a stage without its data, flags that ask for nothing and grpo's
--do_eval (it has no evaluation) each end in one line."""

import copy
import hashlib
import json
import math
import random

import pytest

from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")

from jaxseq.commands import COMMANDS, chat, clm, distill, dpo, glue, grpo, kto, mlm, ner, qa, reward, seq2seq, t5_mlm  # noqa: E402
from jaxseq.commands import main as jaxseq  # noqa: E402
from jaxseq.config import stage_flags  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from tests.test_qa import SQUAD  # noqa: E402

TRAINING = [job for job in COMMANDS if job not in ("generate", "serve", "eval", "push")]
PREDICTING = ("glue", "ner", "qa", "seq2seq")
QUIET = ("--report_to", "none", "--compilation_cache_dir", "", "--logging_steps", 1, "--save_strategy", "no")
"""Appended to every run: no TensorBoard, the suite's compilation cache, every step logged, no checkpoints."""
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
REWARD = (
    "def length(prompts, completions, completion_ids, **kwargs):\n    return [float(len(c)) for c in completion_ids]\n"
)


def run(job, *flags) -> int:
    """``job``'s main in this process (8 CPU devices), quiet."""
    return job.main([str(flag) for flag in (*flags, *QUIET)])


def train_steps(out) -> list[int]:
    path = out / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r["step"] for r in records if "train/loss" in r or "train/reward" in r]


def results(out, name="eval_results.json") -> dict:
    return json.loads((out / name).read_text())


def digest(folder) -> str:
    """One hash of a model folder's files."""
    sha = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        sha.update(path.name.encode() + path.read_bytes())
    return sha.hexdigest()


def assert_evaluated_alone(out, model, before: str) -> None:
    """``out`` holds an evaluation of ``model`` alone: no step, nothing exported, the model's folder as it was."""
    assert train_steps(out) == []
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    assert digest(model) == before
    assert results(out)["eval_samples"] > 0


def trained_then_alone(job, model, out, train, evaluate, *both, same=None) -> tuple[dict, dict]:
    """``job`` with --do_train --do_eval (and ``both``) from ``model``, then with --do_eval alone from its
    export; each run's eval_results.json: the second has the first's figures (those named in ``same``, default
    all) and ``assert_evaluated_alone``."""
    assert run(job, "--model_name_or_path", model, *train, *evaluate, "--do_train", "--do_eval", *both,
               "--output_dir", out / "both") == 0  # fmt: skip
    assert train_steps(out / "both") == [1, 2] and (out / "both" / "model.safetensors").exists()
    trained, before = results(out / "both"), digest(out / "both")
    assert run(job, "--model_name_or_path", out / "both", *evaluate, "--do_eval", "--output_dir", out / "alone") == 0
    assert_evaluated_alone(out / "alone", out / "both", before)
    alone = results(out / "alone")
    figures = {k: trained[k] for k in (same if same is not None else trained)}
    assert {k: alone[k] for k in figures} == pytest.approx(figures, rel=1e-4, abs=1e-6)
    return trained, alone


TRAIN = ("--max_steps", 2, "--per_device_train_batch_size", 1, "--learning_rate", 1e-3)
EVAL = ("--per_device_eval_batch_size", 1)


# --------------------------------------------------------------------------- tiny models and data


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2 with GPT-2's tokenizer and a chat template (clm, chat, dpo, kto, reward, grpo)."""
    folder = tmp_path_factory.mktemp("gpt2")
    files = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(files / "vocab.json"), merges=str(files / "merges.txt"))
    tokenizer.chat_template = TEMPLATE
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=len(tokenizer), resid_pdrop=0, embd_pdrop=0,
        attn_pdrop=0,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny BERT with MiniLM's tokenizer (mlm, ner, qa, glue: each job's head starts fresh)."""
    folder = tmp_path_factory.mktemp("bert")
    tokenizer = transformers.AutoTokenizer.from_pretrained(shared_asset("models/all-MiniLM-L6-v2"))
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    transformers.BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    """A tiny T5 with a SentencePiece tokenizer and its 100 sentinels (t5-mlm, seq2seq)."""
    folder = tmp_path_factory.mktemp("t5")
    raw = tmp_path_factory.mktemp("spm")
    (raw / "spiece.model").write_bytes(
        shared_asset("data/tokenizers/sentencepiece/botchan_en_unigram_1000.model").read_bytes()
    )
    tokenizer = transformers.T5Tokenizer.from_pretrained(raw, extra_ids=100)
    config = transformers.T5Config(
        vocab_size=-(-len(tokenizer) // 16) * 16, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    transformers.T5ForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """Training and validation text (Tiny Shakespeare)."""
    root = tmp_path_factory.mktemp("text")
    shakespeare = shared_asset("data/text/tinyshakespeare.txt").read_text()
    (root / "train.txt").write_text(shakespeare[:12_000])
    (root / "valid.txt").write_text(shakespeare[12_000:16_000])
    return root


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    pool = shared_asset("data/text/tinyshakespeare.txt").read_text().split()[:2000]
    return " ".join(rng.choice(pool) for _ in range(n))


def jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# --------------------------------------------------------------------------- --help


@pytest.mark.parametrize("job", TRAINING)
def test_every_training_jobs_help_lists_its_stage_flags_and_what_they_do(job, capsys):
    with pytest.raises(SystemExit) as exited:
        jaxseq([job, "--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "--do_train [BOOL] train on the training data; given neither --do_train nor --do_eval a run does" in shown
    if job == "grpo":
        assert "--do_eval [BOOL] not available, an error: jaxseq grpo has no evaluation" in shown
    else:
        assert "--do_eval [BOOL] evaluate on the validation data: after training, or without --do_train" in shown
    assert ("--do_predict [BOOL] predict the test data: " in shown) == (job in PREDICTING)


def test_the_stage_rule_is_transformers_with_each_jobs_default():
    """Given --do_train or --do_eval, only what they name; given neither, the job's default (less a stage turned
    off), or with --do_predict alone what the job does then (run_glue's: nothing else; seq2seq's: its files)."""
    stages = stage_flags("train and evaluate", "predictions")
    rule = {
        (): (True, True, False),
        ("do_train",): (True, False, False),
        ("do_eval",): (False, True, False),
        ("do_train", "do_eval", "do_predict"): (True, True, True),
        ("do_eval", "do_predict"): (False, True, True),
        ("do_predict",): (False, False, True),
    }
    for given, asked in rule.items():
        assert stages(**dict.fromkeys(given, True)).stages() == asked, given
    assert stages(do_eval=False).stages() == (True, False, False)
    assert stages(do_train=False).stages() == (False, True, False)
    assert stages(do_predict=False).stages() == (True, True, False)
    assert stages(do_predict=True).stages((True, False), alone=(True, False)) == (True, False, True)
    assert stages().stages((False, True)) == (False, True, False)  # seq2seq with only --validation_file
    with pytest.raises(JaxseqError, match="nothing to do: pass --do_train or --do_eval or --do_predict"):
        stages(do_train=False, do_eval=False).stages()
    assert stages is stage_flags("train and evaluate", "predictions")  # one class: parsed configs compare equal


# --------------------------------------------------------------------------- each job's stages, run


@pytest.mark.slow
def test_clm_stages(gpt2, text, tmp_path):
    train = ("--train_file", text / "train.txt", *TRAIN)
    evaluate = ("--validation_file", text / "valid.txt", "--block_size", 32, *EVAL, "--data_cache_dir", tmp_path)
    _, alone = trained_then_alone(clm, gpt2, tmp_path, train, evaluate)  # alone: no --train_file
    assert alone["perplexity"] == pytest.approx(math.exp(alone["eval_loss"]), rel=1e-6)
    only = tmp_path / "only"
    assert run(clm, "--model_name_or_path", gpt2, *train, *evaluate, "--do_train", "--output_dir", only) == 0
    assert train_steps(only) == [1, 2] and (only / "model.safetensors").exists()
    assert not [k for k in results(only, "all_results.json") if k.startswith("eval_") and k != "eval_samples"]


@pytest.mark.slow
def test_mlm_stages(bert, text, tmp_path):
    train = ("--train_file", text / "train.txt", *TRAIN)
    evaluate = ("--validation_file", text / "valid.txt", "--max_seq_length", 32, *EVAL, "--data_cache_dir", tmp_path)
    _, alone = trained_then_alone(mlm, bert, tmp_path, train, evaluate)  # the same fixed masks
    assert "perplexity" in alone and alone["eval_loss"] > 0


@pytest.mark.slow
def test_t5_mlm_stages(t5, tmp_path):
    (tmp_path / "train.txt").write_text(shared_asset("data/text/botchan.txt").read_text()[:12_000])
    (tmp_path / "valid.txt").write_text(shared_asset("data/text/botchan.txt").read_text()[12_000:16_000])
    train = ("--train_file", tmp_path / "train.txt", *TRAIN)
    evaluate = ("--validation_file", tmp_path / "valid.txt", "--max_seq_length", 32, *EVAL, "--max_eval_samples", 8,
                "--data_cache_dir", tmp_path)  # fmt: skip
    trained_then_alone(t5_mlm, t5, tmp_path, train, evaluate)  # the same corrupted validation blocks


@pytest.mark.slow
def test_chat_stages(gpt2, tmp_path):
    chats = [
        {"messages": [{"role": "user", "content": words(8, i)}, {"role": "assistant", "content": words(4, -i)}]}
        for i in range(48)
    ]
    train = ("--train_file", jsonl(tmp_path / "train.jsonl", chats[:40]), *TRAIN)
    evaluate = ("--validation_file", jsonl(tmp_path / "valid.jsonl", chats[40:]), "--max_seq_length", 64, *EVAL)
    trained_then_alone(chat, gpt2, tmp_path, train, evaluate)


@pytest.mark.slow
def test_dpo_stages(gpt2, tmp_path):
    """Evaluated alone, the model is its own reference (TRL's DPOTrainer.evaluate before training): rewards 0,
    loss log 2."""
    pairs = [{"prompt": words(6, i), "chosen": words(3, 100 + i), "rejected": words(5, 200 + i)} for i in range(16)]
    train = ("--train_file", jsonl(tmp_path / "train.jsonl", pairs[:8]), *TRAIN)
    evaluate = ("--validation_file", jsonl(tmp_path / "valid.jsonl", pairs[8:]), "--max_length", 32, *EVAL)
    trained, alone = trained_then_alone(dpo, gpt2, tmp_path, train, evaluate, same=["eval_samples"])
    assert trained["eval_rewards/margins"] != 0 and trained["eval_loss"] != pytest.approx(math.log(2))
    assert alone["eval_loss"] == pytest.approx(math.log(2), rel=1e-6) and alone["eval_rewards/margins"] == 0


@pytest.mark.slow
def test_kto_stages(gpt2, tmp_path):
    """Trained with apo_zero_unpaired against reference log-probs computed before training; evaluated alone
    (kto), the model is its own reference: rewards and KL 0, each row's loss 1 - sigmoid(0)."""
    rows = [{"prompt": words(6, i), "completion": words(3 + i % 3, 100 + i), "label": i % 3 != 0} for i in range(24)]
    train = ("--train_file", jsonl(tmp_path / "train.jsonl", rows[:16]), *TRAIN, "--per_device_train_batch_size", 2,
             "--loss_type", "apo_zero_unpaired", "--precompute_ref_log_probs")  # fmt: skip
    evaluate = ("--validation_file", jsonl(tmp_path / "valid.jsonl", rows[16:]), "--max_length", 32, *EVAL)
    trained, alone = trained_then_alone(kto, gpt2, tmp_path, train, evaluate, same=["eval_samples"])
    assert trained["eval_rewards/margins"] != 0 and trained["eval_loss"] != pytest.approx(0.5)
    assert alone["eval_loss"] == pytest.approx(0.5, rel=1e-6) and alone["eval_rewards/margins"] == 0
    assert alone["eval_kl"] == 0 and alone["eval_logps/chosen"] < 0


@pytest.mark.slow
def test_reward_stages(gpt2, tmp_path):
    """The reward model trained from the causal LM's checkpoint (a fresh score head) and evaluated alone from
    its export scores the pairs alike."""
    pairs = [{"prompt": words(6, i), "chosen": words(3, 100 + i), "rejected": words(5, 200 + i)} for i in range(16)]
    train = ("--train_file", jsonl(tmp_path / "train.jsonl", pairs[:8]), *TRAIN)
    evaluate = ("--validation_file", jsonl(tmp_path / "valid.jsonl", pairs[8:]), "--max_length", 64, *EVAL)
    trained, _ = trained_then_alone(reward, gpt2, tmp_path, train, evaluate)
    assert trained["eval_margin"] != 0 and trained["eval_min_reward"] < trained["eval_max_reward"]


@pytest.mark.slow
def test_distill_stages(gpt2, tmp_path):
    """Trained on its own samples of the training prompts (--lmbda 1, DistillationTrainer's reverse KL) against
    its starting weights as the teacher, evaluated on the validation conversations' completions; evaluated
    alone from its export against the same teacher, the same figures."""
    prompts = [{"prompt": words(6, i)} for i in range(8)]
    chats = [
        {"messages": [{"role": "user", "content": words(6, i)}, {"role": "assistant", "content": words(4, -i)}]}
        for i in range(4)
    ]
    train = ("--train_file", jsonl(tmp_path / "train.jsonl", prompts), *TRAIN, "--max_new_tokens", 4)
    evaluate = ("--validation_file", jsonl(tmp_path / "valid.jsonl", chats), "--teacher_model_name_or_path", gpt2,
                "--lmbda", 1, "--max_length", 64, *EVAL)  # fmt: skip
    trained, _ = trained_then_alone(distill, gpt2, tmp_path, train, evaluate)
    assert trained["eval_loss"] > 0


@pytest.mark.slow
def test_grpo_trains_with_do_train(gpt2, tmp_path):
    (tmp_path / "rewards.py").write_text(REWARD)
    prompts = jsonl(tmp_path / "prompts.jsonl", [{"prompt": words(4, i)} for i in range(8)])
    out = tmp_path / "out"
    assert run(grpo, "--model_name_or_path", gpt2, "--train_file", prompts, "--reward_funcs",
               f"{tmp_path / 'rewards.py'}:length", "--num_generations", 2, "--max_completion_length", 4,
               *TRAIN, "--do_train", "--output_dir", out) == 0  # fmt: skip
    assert train_steps(out) == [1, 2] and (out / "model.safetensors").exists()


def seq2seq_pairs(n: int, seed: int) -> list[dict]:
    """'copy: w1 w2' -> 'w1 w2' and 'reverse: w1 w2' -> 'w2 w1', botchan's words."""
    rng, pool = random.Random(seed), ["tree", "fish", "house", "water", "stone", "boat", "desk", "eggs"]
    pairs = []
    for _ in range(n):
        chosen, op = rng.sample(pool, 3), rng.choice(["copy", "reverse"])
        pairs.append({"source": f"{op}: {' '.join(chosen)}", "target": " ".join(chosen[:: 1 if op == "copy" else -1])})
    return pairs


@pytest.mark.slow
def test_seq2seq_stages(t5, tmp_path):
    """--do_predict generates for --test_file; alone, with --validation_file, it evaluates too (the files given
    choose the stages when neither --do_train nor --do_eval is)."""
    train = ("--train_file", jsonl(tmp_path / "train.jsonl", seq2seq_pairs(16, 0)), *TRAIN)
    evaluate = ("--validation_file", jsonl(tmp_path / "valid.jsonl", seq2seq_pairs(8, 1)), "--max_source_length",
                16, "--max_target_length", 8, "--predict_with_generate", "false", *EVAL)  # fmt: skip
    test = ("--test_file", jsonl(tmp_path / "test.jsonl", seq2seq_pairs(4, 2)))
    trained, _ = trained_then_alone(seq2seq, t5, tmp_path, train, evaluate, *test, "--do_predict", same=["eval_loss"])
    assert len((tmp_path / "both" / "generated_predictions.txt").read_text().splitlines()) == 4
    assert not (tmp_path / "alone" / "generated_predictions.txt").exists()
    files = tmp_path / "files"
    assert run(seq2seq, "--model_name_or_path", tmp_path / "both", *evaluate, *test, "--do_predict",
               "--output_dir", files) == 0  # fmt: skip
    assert results(files)["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-4)
    assert results(files, "predict_results.json")["predict_samples"] == 4 and train_steps(files) == []


@pytest.mark.slow
def test_ner_stages(bert, tmp_path):
    conll = shared_asset("data/ner/conll2003-test.json").read_text().splitlines()
    (tmp_path / "train.json").write_text("\n".join(conll[:16]) + "\n")
    (tmp_path / "valid.json").write_text("\n".join(conll[16:24]) + "\n")
    train = ("--train_file", tmp_path / "train.json", *TRAIN)
    evaluate = ("--validation_file", tmp_path / "valid.json", "--max_seq_length", 64, *EVAL)
    test = ("--test_file", tmp_path / "valid.json", "--do_predict")
    trained_then_alone(ner, bert, tmp_path, train, evaluate, *test)
    assert len((tmp_path / "both" / "predictions.txt").read_text().splitlines()) == 8


@pytest.mark.slow
def test_qa_stages(bert, tmp_path):
    (tmp_path / "squad.json").write_text(json.dumps(SQUAD))
    twice = copy.deepcopy(SQUAD)  # 14 questions: more windows than a global batch of 8
    for article in twice["data"][:]:
        again = copy.deepcopy(article)
        for qa_ in (q for paragraph in again["paragraphs"] for q in paragraph["qas"]):
            qa_["id"] += "-again"
        twice["data"].append(again)
    (tmp_path / "train.json").write_text(json.dumps(twice))
    train = ("--train_file", tmp_path / "train.json", *TRAIN)
    evaluate = ("--validation_file", tmp_path / "squad.json", "--version_2_with_negative", "--max_seq_length", 64,
                "--doc_stride", 24, *EVAL)  # fmt: skip
    test = ("--test_file", tmp_path / "squad.json", "--do_predict")
    trained_then_alone(qa, bert, tmp_path, train, evaluate, *test)
    assert len(json.loads((tmp_path / "both" / "predict_predictions.json").read_text())) == 7


@pytest.mark.slow
def test_glue_stages(bert, tmp_path):
    data = shared_asset("data/glue")
    rows = [row.split("\t") for row in (data / "MRPC" / "dev.tsv").read_text(encoding="utf-8-sig").splitlines()[1:5]]
    jsonl(tmp_path / "test.jsonl", [{"sentence1": row[3], "sentence2": row[4]} for row in rows])
    train = ("--max_train_samples", 16, *TRAIN)
    evaluate = ("--task_name", "mrpc", "--data_dir", data, "--max_eval_samples", 8, "--max_seq_length", 64, *EVAL)
    test = ("--test_file", tmp_path / "test.jsonl", "--do_predict")
    trained_then_alone(glue, bert, tmp_path, train, evaluate, *test)
    assert len((tmp_path / "both" / "predict_results_mrpc.txt").read_text().splitlines()) == 5


# --------------------------------------------------------------------------- one-line errors

ERRORS = {
    "clm --do_eval, no text": (clm, "gpt2", ["--do_eval"], "no validation text for --do_eval: pass --validation_file"),
    "clm --do_train, validation text only": (
        clm, "gpt2", ["--do_train", "--validation_file", "{text}/valid.txt"], "no training text: pass --train_file",
    ),
    "mlm --do_eval, no text": (mlm, "bert", ["--do_eval"], "no validation text for --do_eval"),
    "t5-mlm --do_eval, no text": (t5_mlm, "t5", ["--do_eval"], "no validation text for --do_eval"),
    "chat --do_eval, no chats": (chat, "gpt2", ["--do_eval"], "no validation conversations for --do_eval"),
    "dpo --do_eval, no validation pairs": (
        dpo, "gpt2", ["--do_eval", "--train_file", "{pairs}"], "--do_eval needs validation pairs",
    ),
    "kto --do_eval, no validation rows": (
        kto, "gpt2", ["--do_eval", "--train_file", "{pairs}"], "--do_eval needs validation rows",
    ),
    "reward --do_eval, no validation pairs": (
        reward, "gpt2", ["--do_eval", "--train_file", "{pairs}"], "--do_eval needs validation pairs",
    ),
    "distill --do_eval, no validation rows": (
        distill, "gpt2", ["--do_eval", "--train_file", "{chats}", "--teacher_model_name_or_path", "{gpt2}"],
        "--do_eval needs validation rows",
    ),
    "grpo --do_eval": (grpo, "gpt2", ["--do_eval"], "--do_eval: jaxseq grpo has no evaluation"),
    "grpo --no_do_train": (grpo, "gpt2", ["--no_do_train"], "nothing to do: pass --do_train or --do_eval"),
    "seq2seq --do_eval, no validation file": (
        seq2seq, "t5", ["--do_eval", "--train_file", "{pairs}"], "--do_eval needs --validation_file",
    ),
    "seq2seq --do_train, no training file": (seq2seq, "t5", ["--do_train"], "--do_train needs --train_file"),
    "seq2seq --do_predict, no test file": (seq2seq, "t5", ["--do_predict"], "--do_predict needs --test_file"),
    "ner --do_predict, no test file": (
        ner, "bert", ["--do_predict"], "prediction (--do_predict) needs --test_file",
    ),
    "qa --do_eval, no validation file": (qa, "bert", ["--do_eval"], "evaluation (--do_eval) needs --validation_file"),
    "glue --do_train false": (
        glue, "bert", ["--do_train", "false", "--no_do_eval", "--no_do_predict", "--max_seq_length", "64"],
        "nothing to do: pass --do_train or --do_eval or --do_predict",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", ERRORS)
def test_a_stage_without_its_data_ends_in_one_line(case, request, text, tmp_path, capsys):
    job, model, flags, message = ERRORS[case]
    pairs = jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": " b", "rejected": " c"}])
    chats = jsonl(tmp_path / "chats.jsonl", [{"prompt": "a", "completion": " b"}])
    gpt2 = request.getfixturevalue("gpt2") if "{gpt2}" in flags else None
    flags = [f.format(text=text, pairs=pairs, chats=chats, gpt2=gpt2) for f in flags]
    out = tmp_path / "out"
    code = run(job, "--model_name_or_path", request.getfixturevalue(model), *flags, "--output_dir", out)
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and error and message in error[-1], error
    assert error[-1].startswith("error: ") and not any("Traceback" in line for line in error)
    assert not (out / "eval_results.json").exists()
