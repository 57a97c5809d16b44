"""`jaxseq eval` against lm-evaluation-harness's own Hugging Face backend (`lm_eval --model hf`): the same tiny
GPT-2 and Llama checkpoints (weights perturbed away from their initialisation, a real GPT-2 tokenizer), the
same local tasks (multiple choice with acc and acc_norm, one-token answers to a two-sentence inference
question, a last word's perplexity and whether it is the greedy guess, generation scored by exact_match and
cut at stop strings, rolling perplexity of documents longer than the model's context), lm-eval's PyTorch run
in this process and jaxseq's as a user runs it: the installed command, one CPU device, a fresh process. Every
number lm-eval reports is in jaxseq's results under the same key, accuracies and exact matches equal,
log-likelihood figures within 1e-4 (relative); every logged sample's generation is the same text and every
request's log-likelihood within 1e-4."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxseq.commands import eval as eval_job
from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
lm_eval = pytest.importorskip("lm_eval")

JAXSEQ = Path(sys.executable).with_name("jaxseq")  # the console command of the environment running the suite
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TASKS = ["mc_colors", "mc_letters", "pairs", "last_word", "completion", "perplexity"]
RTOL = 1e-4


def perturbed(model, seed: int):
    """``model`` with every parameter moved by noise: nothing is left at its initialisation (zeros, ones)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    return model.eval()


def gpt2_tokenizer(**kwargs):
    folder = shared_asset("data/tokenizers/gpt2")
    return transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"), **kwargs)


COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
THINGS = ["apple", "sky", "grass", "sun", "plum", "carrot", "night", "snow", "lemon", "leaf", "sea", "coal"]


def write_tasks(root: Path, model, tokenizer) -> Path:
    """Six task YAMLs and their local data (JSON lines) in ``root``; some last words are ``model``'s own greedy
    guesses, so that its ``acc`` (every continuation token the most likely one) is not 0."""
    rng = np.random.default_rng(0)
    text = shared_asset("data/text/tinyshakespeare.txt").read_text()
    data = root / "data"
    data.mkdir(parents=True)

    def rows(name, split, records):
        (data / f"{name}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def colors(n):
        out = []
        for _ in range(n):
            thing = str(rng.choice(THINGS))
            choices = [str(c) for c in rng.choice(COLORS, 4, replace=False)]
            choices[1] = f"dark {choices[1]}"  # answers of one and of several tokens
            out.append({"thing": thing, "choices": choices, "answer": int(rng.integers(4))})
        return out

    rows("mc_colors", "train", colors(4))
    rows("mc_colors", "test", colors(10))
    letters = [
        {"question": f"Which color is the {t}?", "options": [str(c) for c in rng.choice(COLORS, 4, replace=False)],
         "answer": int(rng.integers(4))}
        for t in THINGS
    ]  # fmt: skip
    rows("mc_letters", "train", letters[:3])
    rows("mc_letters", "test", letters[3:])
    words = text.split()
    pairs = []
    for k in range(12):
        first = " ".join(words[k * 40 : k * 40 + int(rng.integers(8, 30))])
        second = " ".join(words[k * 40 + 50 : k * 40 + 50 + int(rng.integers(4, 10))])
        pairs.append({"sentence1": first, "sentence2": second, "label": int(rng.integers(2))})
    rows("pairs", "train", pairs[:3])
    rows("pairs", "test", pairs[3:])
    sentences = [line.split() for line in text.splitlines() if len(line.split()) >= 6]
    last = [{"context": " ".join(words[:-1]), "word": " " + words[-1]} for words in sentences[:16]]
    for doc in last[::2]:
        with torch.no_grad():
            logits = model(tokenizer(doc["context"], return_tensors="pt")["input_ids"]).logits
        guess = tokenizer.decode(int(logits[0, -1].argmax()))
        if guess.startswith(" ") and guess.strip().isalpha():
            doc["word"] = guess
    rows("last_word", "train", last[:3])
    rows("last_word", "test", last[3:])
    questions = [{"question": f"What color is the {t}", "answer": str(rng.choice(COLORS))} for t in THINGS]
    rows("completion", "train", questions[:3])
    rows("completion", "test", questions[3:])
    lines = [line for line in text.split("\n\n") if len(line) > 40]
    documents = [{"text": "\n\n".join(lines[k * 9 : k * 9 + 9])} for k in range(5)]  # 150-300 tokens each
    rows("perplexity", "train", documents[:1])
    rows("perplexity", "test", documents[1:])

    def dataset(name):
        return (
            f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    train: {data}/{name}_train.jsonl\n"
            f"    test: {data}/{name}_test.jsonl\ntraining_split: train\ntest_split: test\nfewshot_split: train\n"
        )

    accuracy = "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    (root / "mc_colors.yaml").write_text(
        "task: mc_colors\n" + dataset("mc_colors") + "output_type: multiple_choice\n"
        'doc_to_text: "Of all the colors, the color of the {{thing}} is"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "target_delimiter: ' '\n" + accuracy
    )
    (root / "mc_letters.yaml").write_text(
        "task: mc_letters\n" + dataset("mc_letters") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}\\nA. {{options[0]}}\\nB. {{options[1]}}\\nC. {{options[2]}}\\n'
        'D. {{options[3]}}\\nAnswer:"\ndoc_to_choice: ["A", "B", "C", "D"]\ndoc_to_target: answer\n' + accuracy
    )
    (root / "pairs.yaml").write_text(
        "task: pairs\n" + dataset("pairs") + "output_type: multiple_choice\n"
        'doc_to_text: "{{sentence1}}\\nQuestion: {{sentence2}} True or False?\\nAnswer:"\n'
        'doc_to_choice: ["True", "False"]\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n'
    )
    (root / "last_word.yaml").write_text(
        "task: last_word\n" + dataset("last_word") + "output_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{word}}"\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n"
    )
    (root / "completion.yaml").write_text(
        "task: completion\n" + dataset("completion") + "output_type: generate_until\n"
        'doc_to_text: "Q: {{question}}?\\nA:"\ndoc_to_target: " {{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n\\n", "e", "Q:"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n    ignore_punctuation: true\n"
    )
    (root / "perplexity.yaml").write_text(
        "task: perplexity\n" + dataset("perplexity") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
        "  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    return root


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The checkpoints (GPT-2; Llama with a BOS-adding tokenizer, a chat template and a LoRA adapter) and the
    tasks, shared by every test here."""
    root = tmp_path_factory.mktemp("eval")
    tokenizer = gpt2_tokenizer()
    gpt2 = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=len(tokenizer), initializer_range=0.3,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = perturbed(transformers.GPT2LMHeadModel(gpt2), 1)
    model.save_pretrained(root / "gpt2")
    tokenizer.save_pretrained(root / "gpt2")

    chat = gpt2_tokenizer(add_bos_token=True)
    chat.chat_template = TEMPLATE
    llama = transformers.LlamaConfig(
        vocab_size=len(chat), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
        bos_token_id=chat.bos_token_id, eos_token_id=chat.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(1)
    base = perturbed(transformers.LlamaForCausalLM(llama), 2)
    base.save_pretrained(root / "llama")
    chat.save_pretrained(root / "llama")

    import peft

    adapter = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    perturbed(adapter, 3)
    adapter.save_pretrained(root / "llama-lora")
    return {"root": root, "gpt2": root / "gpt2", "llama": root / "llama", "lora": root / "llama-lora",
            "tasks": write_tasks(root / "tasks", model, tokenizer)}  # fmt: skip


def reference(model_args: str, tasks: list[str], include_path: Path, **kwargs) -> dict:
    """lm-eval's own results with its Hugging Face backend, in this process."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include_path), include_defaults=False)
    return lm_eval.simple_evaluate(
        model="hf", model_args=model_args, tasks=tasks, task_manager=manager, device="cpu", **kwargs
    )


def run_command(world, *flags) -> subprocess.CompletedProcess:
    """``jaxseq eval`` as a user runs it: the installed command, one CPU device, a fresh process."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = subprocess.run(
        [str(JAXSEQ), "eval", *map(str, flags)],
        cwd=world["root"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Traceback" not in result.stderr
    return result


def numbers(results: dict) -> dict[tuple[str, str], float]:
    """Every numeric figure of lm-eval's results: (task, metric key) -> value."""
    return {
        (task, key): value
        for task, figures in results["results"].items()
        for key, value in figures.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def exact(key: str) -> bool:
    return key.split(",")[0] in ("acc", "acc_norm", "exact_match")


def compare(ours: dict, theirs: dict, samples: dict[str, list[dict]], their_samples: dict[str, list[dict]]):
    mine, want = numbers(ours), numbers(theirs)
    assert set(want) <= set(mine), sorted(set(want) - set(mine))
    for key, value in want.items():
        if exact(key[1]):
            assert mine[key] == value, (key, mine[key], value)
        else:
            assert math.isclose(mine[key], value, rel_tol=RTOL, abs_tol=1e-9), (key, mine[key], value)
    for field in ("n-shot", "versions", "higher_is_better", "n-samples"):
        assert ours[field] == theirs[field], field
    assert set(samples) == set(their_samples)
    for task, rows in their_samples.items():
        mine_rows = {row["doc_id"]: row for row in samples[task]}
        assert sorted(mine_rows) == sorted(row["doc_id"] for row in rows)
        for row in rows:
            got = mine_rows[row["doc_id"]]
            assert got["arguments"] == {
                f"gen_args_{i}": {f"arg_{j}": a for j, a in enumerate(args)} for i, args in enumerate(row["arguments"])
            }, task  # the same requests: lm-eval built them the same way
            for theirs_resp, mine_resp in zip(row["resps"], got["resps"]):
                if isinstance(theirs_resp[0], str):  # a generation: the same text
                    assert mine_resp == theirs_resp, (task, row["doc_id"])
                    continue
                theirs_lp = theirs_resp[0][0] if isinstance(theirs_resp[0], (tuple, list)) else theirs_resp[0]
                mine_lp = mine_resp[0][0] if isinstance(mine_resp[0], list) else mine_resp[0]
                assert math.isclose(float(mine_lp), float(theirs_lp), rel_tol=RTOL, abs_tol=1e-5), (task, row)
                if isinstance(theirs_resp[0], (tuple, list)):  # (log-likelihood, is greedy)
                    assert mine_resp[0][1] == str(theirs_resp[0][1]), (task, row["doc_id"])


def read_output(out: Path) -> tuple[dict, dict[str, list[dict]]]:
    results = json.loads((out / "results.json").read_text())
    samples = {
        path.name.removeprefix("samples_").removesuffix(".jsonl"): [json.loads(line) for line in path.open()]
        for path in out.glob("samples_*.jsonl")
    }
    return results, samples


@pytest.fixture(scope="module")
def gpt2_run(world):
    """GPT-2 through every task, jaxseq's command with its default flags (and --log_samples)."""
    out = world["root"] / "out-gpt2"
    result = run_command(
        world, "--model_name_or_path", world["gpt2"], "--tasks", ",".join(TASKS), "--include_path", world["tasks"],
        "--log_samples", "--output_dir", out,
    )  # fmt: skip
    return result, *read_output(out)


def test_gpt2_with_default_flags_answers_as_lm_eval_hf(world, gpt2_run):
    result, ours, samples = gpt2_run
    theirs = reference(f"pretrained={world['gpt2']},dtype=float32", TASKS, world["tasks"], batch_size=4)
    compare(ours, theirs, samples, theirs["samples"])
    assert "|mc_colors " in result.stdout and "acc_norm" in result.stdout  # lm-eval's table
    assert "\n|  Tasks   |Version|Filter|n-shot|" in result.stdout
    assert ours["config"]["model"] == "jaxseq" and ours["model_name"] == str(world["gpt2"])
    assert ours["task_hashes"].keys() == set(TASKS)
    assert sum(row["acc"] for row in samples["last_word"]) >= 1  # some last words are the greedy guess
    assert all(len(row["doc"]["text"]) > 4 * 64 for row in samples["perplexity"])  # longer than the context
    assert "Warning" not in result.stderr and "fork" not in result.stderr


def test_llama_with_lora_chat_template_and_few_shots_answers_as_lm_eval_hf(world):
    """A BOS-adding tokenizer, a PEFT adapter merged in, prompts in a chat template with a system instruction and
    a one-shot example in the same turn, --max_length below the model's positions (contexts cut from the left,
    shorter rolling windows), batches of 3, 6 examples a task."""
    out = world["root"] / "out-llama"
    run_command(
        world, "--model_name_or_path", world["llama"], "--tokenizer_name", world["llama"], "--lora_adapter",
        world["lora"], "--tasks", ",".join(TASKS), "--include_path", world["tasks"], "--num_fewshot", "1",
        "--apply_chat_template", "--no_fewshot_as_multiturn", "--system_instruction", "Answer briefly.",
        "--max_length", "48", "--per_device_eval_batch_size", "3", "--limit", "6", "--log_samples",
        "--output_dir", out,
    )  # fmt: skip
    ours, samples = read_output(out)
    theirs = reference(
        f"pretrained={world['llama']},peft={world['lora']},dtype=float32,max_length=48", TASKS, world["tasks"],
        batch_size=3, num_fewshot=1, apply_chat_template=True, fewshot_as_multiturn=False,
        system_instruction="Answer briefly.", limit=6,
    )  # fmt: skip
    compare(ours, theirs, samples, theirs["samples"])
    prompt = samples["completion"][0]["arguments"]["gen_args_0"]["arg_0"]
    assert prompt.startswith("<|system|>\nAnswer briefly.") and prompt.endswith("<|assistant|>\n")
    assert ours["chat_template"] == TEMPLATE and ours["model_name"] == str(world["lora"])


def test_a_sharded_run_in_process_gives_the_same_answers(world, gpt2_run, capsys):
    """On 8 devices split dp=4, mp=2 (rows over dp, heads over mp): the one-device run's answers."""
    _, _, samples = gpt2_run
    out = world["root"] / "out-sharded"
    code = eval_job.main(
        [
            "--model_name_or_path", str(world["gpt2"]), "--config_overrides", "n_positions=64", "--tasks",
            ",".join(TASKS), "--include_path", str(world["tasks"]), "--mesh", "dp=4,mp=2",
            "--per_device_eval_batch_size", "1", "--limit", "4", "--log_samples", "--output_dir", str(out),
            "--compilation_cache_dir", "",
        ]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    sharded, sharded_samples = read_output(out)
    assert sharded["config"]["batch_size"] == 4 and sharded["config"]["device"].startswith("8 x ")
    for task, rows in sharded_samples.items():
        whole = {row["doc_id"]: row for row in samples[task]}
        assert len(rows) == 4
        for row in rows:
            for got, want in zip(row["resps"], whole[row["doc_id"]]["resps"]):
                if task == "completion":
                    assert got == want
                else:
                    assert math.isclose(float(np.ravel(got)[0]), float(np.ravel(want)[0]), rel_tol=RTOL), task


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "pass --tasks"),
        (["--tasks", "pairs,no_such_task"], "no lm-eval task named no_such_task"),
        (["--tasks", "pairs", "--log_samples"], "--log_samples writes files: pass --output_dir too"),
        (["--tasks", "pairs", "--include_path", "missing"], "--include_path missing is not a folder"),
        (["--tasks", "pairs", "--fewshot_as_multiturn"], "--fewshot_as_multiturn needs --apply_chat_template"),
        (
            [
                "--tasks",
                "pairs",
                "--log_samples",
                "--no_log_samples",
                "--apply_chat_template",
                "--no_apply_chat_template",
                "--fewshot_as_multiturn",
            ],
            "--fewshot_as_multiturn needs --apply_chat_template",
        ),
        (["--tasks", "pairs", "--limit", "0"], "--limit must be positive"),
        (["--tasks", "pairs", "--per_device_eval_batch_size", "0"], "--per_device_eval_batch_size must be at least 1"),
        (["--tasks", "pairs", "--max_length", "65"], "--max_length 65 exceeds the model's 64 positions"),
        (["--tasks", "pairs", "--config_overrides", "bogus=1"], "GPT2Config has no field 'bogus'"),
        (["--tasks", "pairs", "--tokenizer_name", "missing"], "cannot load a tokenizer from missing"),
        (["--tasks", "sampled"], "generation setting(s) repetition_penalty of a task are not supported"),
        (["--tasks", "long", "--max_length", "16"], "leaves no room for its prompt in --max_length 16"),
        (["--tasks", "pairs", "--apply_chat_template"], "--apply_chat_template: the tokenizer has no chat template"),
    ],
)
def test_mistakes_stop_in_one_line(world, tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for path in world["tasks"].glob("*.yaml"):
        (tasks / path.name).write_text(path.read_text())
    generation = (world["tasks"] / "completion.yaml").read_text()
    (tasks / "sampled.yaml").write_text(
        generation.replace("task: completion", "task: sampled").replace("do_sample: false", "repetition_penalty: 1.1")
    )
    (tasks / "long.yaml").write_text(
        generation.replace("task: completion", "task: long").replace("max_gen_toks: 12", "max_gen_toks: 16")
    )
    if "--include_path" not in flags:
        flags = [*flags, "--include_path", str(tasks)]
    code = eval_job.main(["--model_name_or_path", str(world["gpt2"]), "--compilation_cache_dir", "", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: ") and message in err[-1], err


def test_a_missing_model_folder_stops_in_one_line(capsys, tmp_path):
    code = eval_job.main(["--model_name_or_path", str(tmp_path / "nope"), "--tasks", "pairs"])
    err = capsys.readouterr().err.strip()
    assert (
        code == 1
        and err
        == f"error: model path '{tmp_path / 'nope'}' is not a folder; pass a folder holding config.json and weights"
    )


def test_shared_contexts_and_packed_rows_give_the_same_answers(world, monkeypatch):
    """Requests of every shape (contexts shared by answers of several tokens or one, of different lengths, cut
    from the left, alone) scored with contexts shared and with every sequence packed whole: the same answers."""
    import jaxseq.harness as harness
    from jaxseq.models import load_pretrained

    tokenizer = transformers.AutoTokenizer.from_pretrained(world["gpt2"])
    lm = harness.JaxseqLM(load_pretrained(world["gpt2"], "causal-lm"), tokenizer, batch_size=2)
    rng = np.random.default_rng(0)
    words = shared_asset("data/text/tinyshakespeare.txt").read_text().split()[:2000]
    requests = []
    for _ in range(12):
        context = tokenizer.encode(" ".join(rng.choice(words, int(rng.integers(3, 70)))))
        for _ in range(int(rng.integers(1, 5))):
            requests.append(
                (None, context, tokenizer.encode(" " + " ".join(rng.choice(words, int(rng.integers(1, 4))))))
            )
        requests.append((None, context, requests[-1][2][:1]))  # a one-token answer beside them
    shared = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert harness.split_shared([harness.Sequence(list(c + a[:-1]), (c + a)[1:], [(0, len(a), a[-1])])
                                 for _, c, a in requests])[1], "no request shares its context"  # fmt: skip
    monkeypatch.setattr(harness, "SHARED_CONTEXT", 10**9)
    packed = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    for (got, greedy), (want, want_greedy) in zip(shared, packed):
        assert math.isclose(got, want, rel_tol=RTOL) and greedy == want_greedy


# --------------------------------------------------------------------------- --eval_tasks while training

EVAL_TASKS = ("--eval_tasks", "pairs,mc_colors", "--eval_tasks_limit", "3", "--eval_tasks_num_fewshot", "1")
"""lm-eval's tasks at the end of a training run (their folder follows: --eval_tasks_include_path)."""
STEP = ("--max_steps", "1", "--per_device_train_batch_size", "1", "--learning_rate", "1e-3", "--report_to", "none",
        "--save_strategy", "no", "--compilation_cache_dir", "")  # fmt: skip


@pytest.fixture(scope="module")
def training_data(world):
    root = world["root"] / "training"
    root.mkdir()
    text = shared_asset("data/text/tinyshakespeare.txt").read_text()
    (root / "train.txt").write_text(text[:8000])
    sentences = [" ".join(line.split()[:8]) for line in text.splitlines() if len(line.split()) >= 8][:64]
    turns = lambda i: [{"role": "user", "content": sentences[i]}, {"role": "assistant", "content": sentences[i + 1]}]
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": turns(i)}) + "\n" for i in range(16)))
    pairs = [{"prompt": sentences[i], "chosen": sentences[i + 1][:20], "rejected": sentences[i + 2]} for i in range(8)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": s}) + "\n" for s in sentences[:8]))
    (root / "rewards.py").write_text("def short(completions, **kwargs):\n    return [-len(c) for c in completions]\n")
    return root


TRAINING_RUNS = {
    "clm": lambda data: ["--train_file", data / "train.txt", "--block_size", "32"],
    "chat": lambda data: ["--train_file", data / "chats.jsonl", "--max_seq_length", "64", "--chat_template", TEMPLATE],
    "dpo": lambda data: ["--train_file", data / "pairs.jsonl", "--max_length", "48"],
    "grpo": lambda data: ["--train_file", data / "prompts.jsonl", "--reward_funcs", f"{data / 'rewards.py'}:short",
                          "--num_generations", "2", "--max_completion_length", "4"],
}  # fmt: skip


@pytest.mark.parametrize(
    "job", [pytest.param(job, marks=pytest.mark.slow if job != "clm" else ()) for job in TRAINING_RUNS]
)
def test_eval_tasks_while_training(world, training_data, job, tmp_path):
    """--eval_tasks runs lm-eval's tasks with the trained weights (here at the end): their figures join the eval
    results and lm-eval's results file is written; for clm, they are what `jaxseq eval` gives the exported model."""
    from jaxseq.commands import main as jaxseq

    out = tmp_path / "out"
    flags = [
        *map(str, TRAINING_RUNS[job](training_data)),
        *EVAL_TASKS,
        "--eval_tasks_include_path",
        str(world["tasks"]),
    ]
    code = jaxseq([job, "--model_name_or_path", str(world["gpt2"]), *flags, *STEP, "--output_dir", str(out)])
    assert code == 0
    results = json.loads((out / "all_results.json").read_text())
    assert {"eval_pairs_acc", "eval_mc_colors_acc", "eval_mc_colors_acc_norm"} <= set(results), sorted(results)
    harness = json.loads((out / "lm_eval" / "results.json").read_text())
    assert harness["results"]["pairs"]["acc,none"] == results["eval_pairs_acc"] and harness["n-shot"]["pairs"] == 1
    if job == "clm":
        again = tmp_path / "again"
        assert eval_job.main(["--model_name_or_path", str(out), "--tasks", "pairs,mc_colors", "--include_path",
                              str(world["tasks"]), "--limit", "3", "--num_fewshot", "1", "--output_dir", str(again),
                              "--compilation_cache_dir", ""]) == 0  # fmt: skip
        exported = json.loads((again / "results.json").read_text())
        for key, value in numbers(harness).items():
            assert math.isclose(numbers(exported)[key], value, rel_tol=RTOL), key
