"""The newcomer stage: every `jaxseq` job run as a new user runs it. The installed `jaxseq` console command,
a fresh process with ONE CPU device (none of the suite's XLA_FLAGS, a fresh home, no cache), default flags,
tiny models saved by transformers. The commands are the text of README and of the docs site's pages, run in
that order (README, then the pages in mkdocs.yml's navigation) in one folder, each distinct command once: the
Hub ids they name (`gpt2`, `bert-base-uncased`, ...) are tiny local folders of those names there, and their
files (`input.txt`, `chats.jsonl`, `glue/`, ...) tiny files of those names. Only a few flags are appended, to
keep runs short (`SHORTER`). So the documentation and this stage cannot drift apart: every `jaxseq` command
in the bash and console blocks of README and the docs runs here unless it elides flags (`...`) or its line
says what it needs that CI lacks (`# needs the Hub`, `# needs 8 devices`, `# not run in CI: why`).
Each must exit 0, print no traceback and no third-party noise, and leave the files it documents."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import shared_asset
from tests.test_docs import nav_pages

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
JAXSEQ = Path(sys.executable).with_name("jaxseq")  # the console command of the environment running the suite
JOB = re.compile(r"(?:^|[\s|\"'])jaxseq\s+(\S+)")
"""A command line that runs `jaxseq` (after a pipe or inside quotes too), and which job."""
EXEMPT = re.compile(r"#.*\b(needs (the Hub|a TPU|\d+ devices|several hosts)|not run in CI)")
SHORTER = {
    "clm": "--max_steps 4 --max_eval_samples 16",
    "ner": "--max_steps 4",
    "qa": "--max_steps 4",
    "distill": "--max_steps 4",
}
"""Flags appended to a job's README commands so that they run in seconds (later flags win)."""
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def pages() -> list[Path]:
    """README, then every page of the docs site in the order of mkdocs.yml's navigation."""
    return [ROOT / "README.md", *(ROOT / "docs" / page for page in nav_pages())]


def page_commands(path: Path) -> list[tuple[str, str, str | None]]:
    """``(where, command, why it is not run or None)`` for every command of a page's bash and console blocks
    that runs `jaxseq`, continuation lines joined; ``where`` is ``README.md:LINE``."""
    out, block = [], None
    lines = path.read_text().splitlines()
    name = path.relative_to(ROOT).as_posix()
    i = 0
    while i < len(lines):
        text = lines[i]
        if text.startswith("```"):
            block = None if block is not None else text[3:].strip()
            i += 1
            continue
        if block not in ("bash", "console") or (block == "console" and not text.startswith("$ ")):
            i += 1
            continue
        line_no, command = i + 1, text.removeprefix("$ ")
        while command.rstrip().endswith("\\"):
            i += 1
            command = command.rstrip()[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        if command.lstrip().startswith("#") or not JOB.search(command):
            continue
        words = shlex.split(command, comments=True)
        why = EXEMPT.search(command)
        why = why.group(1) if why else ("elides flags" if "..." in words or any("..." in w for w in words) else None)
        out.append((f"{name}:{line_no}", command, why))
    return out


def bare(command: str) -> str:
    """A command without its trailing comment, its whitespace collapsed: what makes two commands the same."""
    return " ".join(re.sub(r"\s+#[^'\"]*$", "", command).split())


PAGES = pages()
COMMANDS = [entry for page in PAGES for entry in page_commands(page)]
RUN = []
"""Each distinct command that runs, once, at its first place (README's, else the first page's)."""
for _where, _command, _why in COMMANDS:
    if _why is None and bare(_command) not in {bare(c) for _, c in RUN}:
        RUN.append((_where, _command))


def save_tokenizer_and_model(folder: Path, tokenizer, model) -> None:
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The folder README's commands run in, with its stand-ins, and the environment of a newcomer's shell."""
    root = tmp_path_factory.mktemp("newcomer")
    gpt2_files = shared_asset("data/tokenizers/gpt2")
    gpt2_tok = transformers.GPT2TokenizerFast(
        vocab=str(gpt2_files / "vocab.json"), merges=str(gpt2_files / "merges.txt")
    )
    small = dict(n_layer=2, n_embd=64, n_head=4, n_positions=256)
    save_tokenizer_and_model(root / "gpt2", gpt2_tok, transformers.GPT2LMHeadModel(transformers.GPT2Config(**small)))
    shutil.copytree(root / "gpt2", root / "path/to/gpt2")

    chat_tok = transformers.GPT2TokenizerFast(
        vocab=str(gpt2_files / "vocab.json"), merges=str(gpt2_files / "merges.txt")
    )
    chat_tok.chat_template = TEMPLATE
    llama = transformers.LlamaConfig(
        vocab_size=len(chat_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=chat_tok.bos_token_id, eos_token_id=chat_tok.eos_token_id,
    )  # fmt: skip
    save_tokenizer_and_model(root / "path/to/model", chat_tok, transformers.LlamaForCausalLM(llama))

    minilm = shared_asset("models/all-MiniLM-L6-v2")
    bert_tok = transformers.AutoTokenizer.from_pretrained(minilm)
    bert = transformers.BertConfig(
        vocab_size=len(bert_tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    for name in ("bert-base-uncased", "sentence-transformers/all-MiniLM-L6-v2"):
        save_tokenizer_and_model(root / name, bert_tok, transformers.BertModel(bert))

    spm = tmp_path_factory.mktemp("spm")
    shutil.copy(shared_asset("data/tokenizers/sentencepiece/botchan_en_unigram_1000.model"), spm / "spiece.model")
    t5_tok = transformers.T5Tokenizer.from_pretrained(spm, extra_ids=0)
    t5 = transformers.T5Config(
        vocab_size=-(-len(t5_tok) // 16) * 16, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        pad_token_id=t5_tok.pad_token_id, eos_token_id=t5_tok.eos_token_id, decoder_start_token_id=t5_tok.pad_token_id,
    )  # fmt: skip
    save_tokenizer_and_model(root / "google-t5/t5-small", t5_tok, transformers.T5ForConditionalGeneration(t5))

    text = shared_asset("data/text/tinyshakespeare.txt").read_text()
    (root / "input.txt").write_text(text[:40_000])
    sentences = [
        line.split("\t")[0] for line in shared_asset("data/glue/SST-2/train.tsv").read_text().splitlines()[1:3001]
    ]
    (root / "glue/SST-2").mkdir(parents=True)
    sst2 = shared_asset("data/glue/SST-2/train.tsv").read_text().splitlines()
    (root / "glue/SST-2/train.tsv").write_text("\n".join(sst2[:201]) + "\n")
    (root / "glue/SST-2/dev.tsv").write_text("\n".join([sst2[0], *sst2[201:241]]) + "\n")
    (root / "glue/RTE").mkdir()
    labels = ("entailment", "not_entailment")  # RTE's sizes: README's run reaches its checkpoint at step 200
    for split, (start, n) in {"train": (0, 2490), "dev": (2490, 277), "test": (2767, 233)}.items():
        rows = ["index\tsentence1\tsentence2" + ("" if split == "test" else "\tlabel")]
        for k in range(start, start + n):
            pair = f"{k - start}\t{sentences[k]}\t{sentences[(k * 7 + 3) % 3000]}"
            rows.append(pair if split == "test" else f"{pair}\t{labels[k % 2]}")
        (root / f"glue/RTE/{split}.tsv").write_text("\n".join(rows) + "\n")

    words = [w for w in text.split() if w.isalpha()][:2000]
    rng = np.random.default_rng(0)

    def chat():
        turns = [" ".join(rng.choice(words, n)) for n in (40, 20)]
        return {"messages": [{"role": role, "content": t} for role, t in zip(("user", "assistant"), turns)]}

    # enough chats of about 80 tokens to fill one default global batch (32 packed rows of 1024 tokens)
    (root / "chats.jsonl").write_text("".join(json.dumps(chat()) + "\n" for _ in range(480)))
    (root / "chats-dev.jsonl").write_text("".join(json.dumps(chat()) + "\n" for _ in range(16)))
    for name, n in (("train.jsonl", 64), ("dev.jsonl", 16), ("test.jsonl", 8)):  # a text and its summary
        texts = [" ".join(rng.choice(words, 12)) for _ in range(n)]
        (root / name).write_text("".join(json.dumps({"text": t, "summary": t.split()[0]}) + "\n" for t in texts))
    for name, n in (("pairs.jsonl", 32), ("pairs-dev.jsonl", 8)):  # preference pairs as strings
        rows = [{"prompt": " ".join(rng.choice(words, 8)), "chosen": " ".join(rng.choice(words, 4)),
                 "rejected": " ".join(rng.choice(words, 6))} for _ in range(n)]  # fmt: skip
        (root / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Once upon", "To be")))
    (root / "prompts.txt").write_text("translate: a house\nsummarize: the long day\n")
    conll = shared_asset("data/ner/conll2003-test.json").read_text().splitlines()
    (root / "ner-train.json").write_text("\n".join(conll[:64]) + "\n")
    (root / "ner-dev.json").write_text("\n".join(conll[64:80]) + "\n")
    for name, ks in (("train-v2.0.json", range(20)), ("dev-v2.0.json", range(40, 48))):  # SQuAD v2.0: a word's place
        paragraphs = []
        for k in ks:
            context = " ".join(words[k * 30 : k * 30 + 120])
            word = words[k * 30 + 7]
            qas = [{"id": f"q{k}", "question": f"Which word comes after {words[k * 30 + 6]}?", "is_impossible": False,
                    "answers": [{"text": word, "answer_start": context.index(" " + word + " ") + 1}]},
                   {"id": f"n{k}", "question": "Who wrote it?", "is_impossible": True, "answers": []}]  # fmt: skip
            paragraphs.append({"context": context, "qas": qas})
        (root / name).write_text(json.dumps({"version": "v2.0", "data": [{"title": "t", "paragraphs": paragraphs}]}))

    (root / "my_tasks").mkdir()  # jaxseq eval's task of your own: docs/jobs/eval.md's YAML and its data
    (root / "my_tasks/capitals.yaml").write_text(
        re.search(r"```yaml\n(.*?)```", (ROOT / "docs/jobs/eval.md").read_text(), re.S)[1]
    )
    capitals = [("France", ["Paris", "Rome", "Madrid"], 0), ("Italy", ["Paris", "Rome", "Madrid"], 1),
                ("Spain", ["Lisbon", "Madrid", "Paris"], 1), ("Japan", ["Tokyo", "Seoul", "Beijing"], 0)]  # fmt: skip
    (root / "my_tasks/capitals.jsonl").write_text(
        "".join(json.dumps({"country": c, "choices": choices, "answer": a}) + "\n" for c, choices, a in capitals)
    )

    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), HF_HOME=str(home / ".cache/huggingface"))
    env.update(HF_HUB_OFFLINE="1", PATH=f"{JAXSEQ.parent}{os.pathsep}{env.get('PATH', '')}")
    return root, env


# What a clean run must not print to stderr (where tqdm's bars and jaxseq's errors go) or, for a traceback, anywhere.
NOISE = re.compile(r"Traceback|Warning|WARNING(?!:jaxseq:)|warn\(|^[EWI]\d{4} |libtpu|absl|tracked_metric")


def run(world, command: str) -> subprocess.CompletedProcess:
    root, env = world
    job = JOB.search(command).group(1)
    command = re.sub(r"\s+#[^'\"]*$", "", command)  # a trailing comment
    full = f"{command} {SHORTER.get(job, '')}".strip()
    result = subprocess.run(["bash", "-c", full], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    lines = [part for line in result.stderr.splitlines() for part in line.split("\r")]
    noisy = [line for line in lines if NOISE.search(line)] + ["Traceback"] * ("Traceback" in result.stdout)
    assert result.returncode == 0 and not noisy, (
        f"`{full}` exited {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )
    return result


def documented_files(root: Path, command: str) -> list[Path]:
    """The files a command's README paragraph promises, by what it was asked to do."""
    words = shlex.split(re.sub(r"\s+#[^'\"]*$", "", command))
    flags = {w: words[i + 1] if i + 1 < len(words) else "" for i, w in enumerate(words) if w.startswith("--")}
    job = words[words.index("jaxseq") + 1]
    out = root / flags.get("--output_dir", "")
    if job == "push":
        return [root / words[words.index("push") + 1] / "hub_dry_run" / "README.md"]
    if job == "generate":
        return [root / flags["--output_file"]] if "--output_file" in flags else []
    if job == "eval":
        tasks = flags["--tasks"].split(",") if "--log_samples" in flags else []
        return [out / "results.json", *(out / f"samples_{task}.jsonl" for task in tasks)]
    if job not in ("glue", "clm", "chat", "seq2seq") or "--help" in words:
        return []
    files = [out / "all_results.json", out / "config.yaml"]
    trains = "--do_train" in flags or not {"--do_eval", "--do_predict"} & set(flags)
    if trains or "--resume_from_checkpoint" in flags:
        exported = "adapter_config.json" if flags.get("--lora_export") == "adapter" else "config.json"
        files.append(out / exported)
    if trains:
        files += [out / "metrics.jsonl", out / "training_curves.png"]
    if job != "glue" or "--do_eval" in flags or trains:
        files.append(out / "eval_results.json")
    if "--do_predict" in flags and job == "glue":
        files.append(out / f"predict_results_{flags['--task_name']}.txt")
    if "--do_predict" in flags and job == "seq2seq":
        files += [out / "generated_predictions.txt", out / "predict_results.json"]
    return files


@pytest.mark.parametrize(("where", "command"), RUN, ids=[where for where, _ in RUN])
def test_documented_command_runs_as_a_newcomer_runs_it(world, where, command):
    result = run(world, command)
    missing = [str(p.relative_to(world[0])) for p in documented_files(world[0], command) if not p.exists()]
    assert not missing, f"{where} `{command}` left no {missing}\n{result.stdout[-2000:]}"
    if "--help" in command.split():
        assert result.stdout.startswith("usage: jaxseq"), result.stdout[:300]
        job = JOB.search(command).group(1)
        if job != "--help":  # a job's examples keep their own lines (not reflowed into the paragraph)
            assert re.search(rf"^ +jaxseq {job} --", result.stdout, re.M), result.stdout[:2000]


def test_the_demo_config_runs_as_a_newcomer_runs_it(world):
    """`make demo`'s job (`jaxseq glue --config glue_sst2_quick`) with the demo's local data folder."""
    run(world, "jaxseq glue --config glue_sst2_quick --data_dir glue --output_dir out/demo")
    results = json.loads((world[0] / "out/demo/eval_results.json").read_text())
    assert 0.0 <= results["eval_accuracy"] <= 1.0


def test_the_docs_and_the_stage_cannot_drift_apart():
    """README shows every job; every job has a command that this stage runs; an exempt command says why; two
    commands never share an output folder; the parser sees every `jaxseq` line of the command blocks."""
    from jaxseq.commands import COMMANDS as JOBS

    readme = {JOB.search(command).group(1) for where, command, _ in COMMANDS if where.startswith("README.md:")}
    assert readme >= set(JOBS), f"README shows no example of {sorted(set(JOBS) - readme)}"
    jobs = {JOB.search(command).group(1) for _, command in RUN}
    assert jobs >= set(JOBS), f"no command of {sorted(set(JOBS) - jobs)} runs here"
    runs_from_checkpoint = [c for _, c in RUN if "jaxseq clm" in c and "--model_name_or_path" in c]
    assert runs_from_checkpoint, "README should show (and this stage run) clm from a checkpoint"
    outputs = [shlex.split(bare(c)) for _, c in RUN]
    outputs = [w[w.index("--output_dir") + 1] for w in outputs if "--output_dir" in w]
    assert len(outputs) == len(set(outputs)), sorted(o for o in outputs if outputs.count(o) > 1)
    for page in PAGES:
        text = page.read_text()
        in_blocks = re.findall(r"```(?:bash|console)\n(.*?)```", text, re.S)
        lines = [ln for block in in_blocks for ln in block.splitlines() if JOB.search(ln) and not ln.startswith("#")]
        assert len(lines) == len(page_commands(page)), (page.name, len(lines), len(page_commands(page)))
    distinct = {bare(command) for _, command, _ in COMMANDS}
    assert len(RUN) >= len(distinct) // 2, [(where, why) for where, _, why in COMMANDS if why]
