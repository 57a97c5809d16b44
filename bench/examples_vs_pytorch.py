"""The whole ``jaxseq ner`` / ``jaxseq qa`` / ``jaxseq mlm`` command against transformers PyTorch's training loop,
speed and quality from the same runs.

    python bench/examples_vs_pytorch.py                 # ner, qa and mlm, each job's two sides back to back
    python bench/examples_vs_pytorch.py --jobs ner,qa   # some of them (the others' rows are kept)
    python bench/examples_vs_pytorch.py --markdown      # BENCHMARKS.md's table from bench/results/examples.json

For each job, in turn (jaxseq, then PyTorch, so other load on the machine falls on both):
- ``jaxseq``: the installed ``jaxseq <job>`` command in a fresh process on one CPU device (no XLA_FLAGS device
  count), default flags but for the data, model, output and epochs/steps flags below, with an empty cache folder
  (XDG_CACHE_HOME: a newcomer's first run, no persistent XLA cache, no cached tokens). Its time is the whole
  command's wall time: start-up, data, compilation, training, the final evaluation and writing the model.
- ``pytorch``: transformers' AutoModelFor{TokenClassification, QuestionAnswering, MaskedLM} from the same folder,
  the data prepared as transformers' run_ner.py / run_qa.py / run_mlm.py prepare it (tokenize_and_align_labels;
  prepare_train_features and prepare_validation_features with --pad_to_max_length False; tokenize each line,
  group_texts), batches padded to their longest example (DataCollatorForTokenClassification,
  DataCollatorWithPadding, DataCollatorForLanguageModeling), eager float32, torch.optim.AdamW(fused=True) (the
  Trainer's default adamw_torch_fused; foreach where fused is not supported on the CPU: the JSON says which),
  jaxseq's defaults otherwise: batch 32, lr 5e-5 with linear decay and no warmup, weight decay 0, clip 1.0, seed
  42, the last incomplete batch dropped (jaxseq's step count). Its time is the training loop alone.
Both sides load the pretrained encoder's weights; the heads it lacks (token classifier, span classifier, MLM
head transform; the MLM decoder is tied to the embeddings) are initialised by each framework from its own seed.
Quality, each side scored by the same code: NER seqeval's entity F1 (jaxseq.metrics.seqeval, run_ner's
``evaluate`` seqeval); QA the official SQuAD v2.0 evaluation (tests/test_qa.py's ``official_v2``, the published
evaluate-v2.0.py) of each side's answers, PyTorch's found from its logits by utils_qa's postprocessing
(jaxseq.data.squad.postprocess); MLM the evaluation loss over the masked tokens and its perplexity (each side
masks the validation blocks once with its own draw).

Data (paths are flags; nothing here is required by jaxseq itself):
- ner: CoNLL-2003's English test split (one JSON object a line, words and IOB2 tags), the first 2000 sentences
  to train on, the next 500 to evaluate; 1 epoch, max_seq_length 128 (jaxseq's default).
- qa: a SQuAD v2.0 file written at each run from WikiText-2 (the sentences of glue_vs_pytorch's RTE stand-in):
  each context a run of consecutive sentences (40-300 words), one answerable
  question "Which word comes after X?" (X a word found once in the context, the answer the word after it) and
  one unanswerable of the same form (X a word not in the context); 200 training and 100 dev contexts (400 and
  200 questions); 1 epoch, max_seq_length 384, doc_stride 128 (the defaults), --version_2_with_negative (before
  935fe48, 2026-11-27, the jaxseq command was killed for memory on this 24 GiB box: QA_NOTE).
- mlm: WikiText-2's valid split to train on (the text file as it is), the first 400 lines of its test split to
  evaluate; blocks of 128 tokens (--max_seq_length 128), 1 epoch (63 steps of 32 blocks; until 2026-11-27,
  12 steps, where the fixed costs of a first run outweighed the training: BENCHMARKS.md). jaxseq reads each
  file as one document and cuts it into blocks; run_mlm tokenizes each line with [CLS] and [SEP] and joins
  them, so the PyTorch side has a few more blocks (the step count is jaxseq's on both sides).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import records
from glue_vs_pytorch import SHARED, wikitext_sentences

ROOT = Path(__file__).resolve().parents[1]
JOBS = ("ner", "qa", "mlm")
SEED = 42  # jaxseq's default --seed
BATCH = 32  # jaxseq's default --per_device_train_batch_size
LR = 5e-5  # jaxseq's default --learning_rate (linear decay, no warmup, weight decay 0, clip 1.0)
EVAL_BATCH = 32  # the PyTorch side's evaluation batch (its evaluation is not timed)
QA_NOTE = (  # before 935fe48 (2026-11-27), when the command kept freed host memory in one glibc heap
    "qa: no row. On this 24 GiB box (shared) the jaxseq qa command (batch 32) was killed by the kernel's OOM "
    "killer in every try: 1 epoch at the default 384/128 (anon-rss 20.6 GB, right after the first step, 34.0 s "
    "with compilation), 1 epoch at 256/128 (19.4 GB) and 10 steps at 256/128 (15.1 GB, with more taken by other "
    "processes). A lone 10-step run at 256 (582 windows) finished and peaked at 12.7 GB resident: about 5 GB "
    "during each step up to step 7, then growing by 1-2 GB a step over steps 8-10, back to 1.4 GB in the "
    "evaluation; 3 steps peaked at 5.2 GB. PyTorch's side of the same data ran (a smoke test of one step)."
)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One job's benchmarked run (both sides alike)."""

    job: str
    epochs: int
    max_length: int
    data: str
    quality: str  # the figure compared, from each side's row
    doc_stride: int | None = None
    steps: int | None = None  # --max_steps instead of epochs


SETTINGS = {
    "ner": Setting("ner", 1, 128, "CoNLL-2003 test split: sentences 0-1999 train, 2000-2499 eval", "f1"),
    "qa": Setting(
        "qa",
        1,
        384,
        "SQuAD v2.0 format from WikiText-2: 400 train / 200 dev questions, half unanswerable",
        "f1",
        128,
    ),
    "mlm": Setting("mlm", 1, 128, "WikiText-2 valid split train, first 400 lines of its test split eval", "eval_loss"),
}


# ------------------------------------------------------------------ data
def write_ner(folder: Path, conll: Path) -> dict[str, Path]:
    lines = conll.read_text(encoding="utf-8").splitlines()
    files = {"train": folder / "ner-train.json", "validation": folder / "ner-dev.json"}
    files["train"].write_text("\n".join(lines[:2000]) + "\n", encoding="utf-8")
    files["validation"].write_text("\n".join(lines[2000:2500]) + "\n", encoding="utf-8")
    return files


def write_squad(folder: Path, text_dir: Path, seed: int = 0) -> dict[str, Path]:
    """train-v2.0.json and dev-v2.0.json: "Which word comes after X?" about runs of WikiText-2 sentences."""
    import numpy as np

    rng, sentences = np.random.default_rng(seed), wikitext_sentences(text_dir)
    vocabulary = sorted({w for s in sentences for w in s.split() if w.isalpha() and len(w) > 3})

    def paragraph(k: int) -> dict:
        want, j, words = int(rng.integers(40, 301)), int(rng.integers(0, len(sentences) - 200)), []
        while len(words) < want:
            words, j = words + sentences[j].split(), j + 1
        context = " ".join(words)
        tokens = context.split(" ")
        once = [
            i
            for i in range(len(tokens) - 1)
            if tokens[i].isalpha() and tokens[i + 1].isalpha() and tokens.count(tokens[i]) == 1
        ]
        i = int(rng.choice(once))
        start = len(" ".join(tokens[: i + 1])) + 1
        assert context[start : start + len(tokens[i + 1])] == tokens[i + 1]
        absent = str(rng.choice(vocabulary))
        while re.search(rf"\b{re.escape(absent)}\b", context):
            absent = str(rng.choice(vocabulary))
        qas = [
            {
                "id": f"a{k}",
                "question": f"Which word comes after {tokens[i]}?",
                "is_impossible": False,
                "answers": [{"text": tokens[i + 1], "answer_start": start}],
            },
            {"id": f"n{k}", "question": f"Which word comes after {absent}?", "is_impossible": True, "answers": []},
        ]
        return {"context": context, "qas": qas}

    files = {}
    for split, name, ks in (("train", "train-v2.0.json", range(200)), ("validation", "dev-v2.0.json", range(200, 300))):
        data = {"version": "v2.0", "data": [{"title": "wikitext", "paragraphs": [paragraph(k) for k in ks]}]}
        files[split] = folder / name
        files[split].write_text(json.dumps(data), encoding="utf-8")
    return files


def write_mlm(folder: Path, text_dir: Path) -> dict[str, Path]:
    files = {"train": folder / "mlm-train.txt", "validation": folder / "mlm-valid.txt"}
    files["train"].write_text((text_dir / "wikitext-2.valid.tokens").read_text(encoding="utf-8"), encoding="utf-8")
    test = (text_dir / "wikitext-2.test.tokens").read_text(encoding="utf-8").splitlines(keepends=True)
    files["validation"].write_text("".join(test[:400]), encoding="utf-8")
    return files


# ------------------------------------------------------------------ jaxseq
def jaxseq_executable() -> list[str]:
    installed = Path(sys.executable).parent / "jaxseq"
    return [str(installed)] if installed.is_file() else [sys.executable, "-m", "jaxseq"]


def jaxseq_command(args, setting: Setting, files: dict[str, Path], out: Path) -> list[str]:
    cmd = [*jaxseq_executable(), setting.job, "--model_name_or_path", str(args.model), "--output_dir", str(out)]
    cmd += ["--train_file", str(files["train"]), "--validation_file", str(files["validation"])]
    cmd += ["--max_steps", str(setting.steps)] if setting.steps else ["--num_train_epochs", str(setting.epochs)]
    if setting.job == "qa":
        cmd += ["--version_2_with_negative"]  # the data's format (run_qa's flag for SQuAD v2.0)
        cmd += ["--max_seq_length", str(setting.max_length), "--doc_stride", str(setting.doc_stride)]
    if setting.job == "mlm":
        cmd += ["--max_seq_length", str(setting.max_length)]  # its default is the model's positions (512)
    return cmd


def run_jaxseq(args, setting: Setting, files: dict[str, Path], tmp: Path) -> dict:
    out, cache = tmp / "jaxseq", tmp / "cache"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(cache))
    cmd = jaxseq_command(args, setting, files, out)
    start = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # GiB, the largest child so far
    if result.returncode:
        raise SystemExit(f"jaxseq {setting.job} failed:\n{result.stderr[-3000:]}")
    results = json.loads((out / "all_results.json").read_text())
    log = result.stdout + result.stderr
    row = {
        "seconds": wall,
        "command": " ".join(cmd[len(jaxseq_executable()) - 1 :]),
        "train_seconds": results["train_runtime"],
        "compile_seconds": results["train_compile_seconds"],
        "steps": trained_steps(out),
        "peak_rss_gib_of_largest_child_so_far": peak,
        "log_lines": [
            line.strip()
            for line in re.split(r"[\r\n]", log)
            if re.search(r"first step|examples|windows|blocks|step time|steps/s|tokens/s|train_runtime", line)
        ][-12:],
        "results": {k: v for k, v in results.items() if isinstance(v, (int, float))},
    }
    if setting.job == "ner":
        row.update({k: results[f"eval_{k}"] for k in ("precision", "recall", "f1", "accuracy")})
    elif setting.job == "qa":
        predictions = json.loads((out / "eval_predictions.json").read_text())
        row.update(official_scores(files["validation"], predictions))
        row["jaxseq_reported"] = {k: results[f"eval_{k}"] for k in ("exact", "f1", "HasAns_f1", "NoAns_f1")}
    else:
        row.update(eval_loss=results["eval_loss"], perplexity=results["perplexity"])
    return row


def official_scores(dev_file: Path, predictions: dict[str, str]) -> dict:
    """evaluate-v2.0.py's figures (as tests/test_qa.py reimplements it) of ``predictions``."""
    sys.path.insert(0, str(ROOT))
    from tests.test_qa import official_v2

    scores = official_v2(json.loads(dev_file.read_text())["data"], predictions)
    return {k: scores[k] for k in ("exact", "f1", "HasAns_f1", "NoAns_f1")}


# ------------------------------------------------------------------ PyTorch
OPTIMIZER = {}


def adamw(model):
    """torch.optim.AdamW, fused where the CPU build supports it, else foreach (recorded in OPTIMIZER)."""
    import torch

    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
        OPTIMIZER["name"] = "torch.optim.AdamW(fused=True)"
    except (RuntimeError, TypeError) as error:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=True)
        OPTIMIZER["name"] = f"torch.optim.AdamW(foreach=True) (fused: {error})"
    return optimizer


def train_loop(model, features: list[dict], collate, epochs: int | None = None, steps: int | None = None) -> dict:
    """jaxseq's schedule on PyTorch: full batches of BATCH in a seeded order each epoch, AdamW, linear decay from
    LR to 0 without warmup, clip 1.0; the seconds of the loop alone."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    from jaxseq.data.batches import epoch_order, steps_per_epoch

    per_epoch = steps_per_epoch(len(features), BATCH)
    total = steps or per_epoch * epochs
    optimizer = adamw(model)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, total)
    model.train()
    start, first = time.perf_counter(), None
    for step in range(total):
        epoch, at = divmod(step, per_epoch)
        order = epoch_order(len(features), seed=SEED, epoch=epoch)
        loss = model(**collate([features[i] for i in order[at * BATCH : (at + 1) * BATCH]])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if first is None:
            first = time.perf_counter() - start
    seconds = time.perf_counter() - start
    model.eval()
    return {"seconds": seconds, "steps": total, "first_step_seconds": first, "last_loss": loss.item()}


def pytorch_ner(args, setting: Setting, files: dict[str, Path]) -> dict:
    """run_ner.py: tokenize_and_align_labels (the first sub-token of each word labelled), sorted tag list,
    DataCollatorForTokenClassification; seqeval on the words' first sub-tokens."""
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification

    from jaxseq.metrics import seqeval

    torch.manual_seed(SEED)
    read = {s: [json.loads(line) for line in p.read_text().splitlines() if line.strip()] for s, p in files.items()}
    labels = sorted({tag for split in read.values() for e in split for tag in e["ner_tags"]})
    label_to_id = {label: i for i, label in enumerate(labels)}
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def tokenize_and_align_labels(examples):
        encoded = tokenizer(
            [e["tokens"] for e in examples], truncation=True, max_length=setting.max_length, is_split_into_words=True
        )
        features = []
        for i, example in enumerate(examples):
            previous, ids = None, []
            for word in encoded.word_ids(batch_index=i):
                ids.append(-100 if word is None or word == previous else label_to_id[example["ner_tags"][word]])
                previous = word
            features.append({"input_ids": encoded["input_ids"][i], "attention_mask": encoded["attention_mask"][i],
                             "token_type_ids": encoded["token_type_ids"][i], "labels": ids})  # fmt: skip
        return features

    train, dev = tokenize_and_align_labels(read["train"]), tokenize_and_align_labels(read["validation"])
    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(labels), id2label=dict(enumerate(labels)), label2id=label_to_id
    )
    collate = DataCollatorForTokenClassification(tokenizer, return_tensors="pt")
    row = train_loop(model, train, collate, epochs=setting.epochs, steps=setting.steps)
    predictions, references = [], []
    with torch.no_grad():
        for i in range(0, len(dev), EVAL_BATCH):
            batch = collate(dev[i : i + EVAL_BATCH])
            gold = batch.pop("labels").numpy()
            guess = model(**batch).logits.argmax(-1).numpy()
            for p, g in zip(guess, gold):
                keep = g != -100
                predictions.append([labels[t] for t in p[keep]])
                references.append([labels[t] for t in g[keep]])
    metrics = seqeval(references, predictions)
    scores = {k: metrics[k] for k in ("precision", "recall", "f1", "accuracy")}
    return {**row, **scores, "words": sum(map(len, references))}


def pytorch_qa(args, setting: Setting, files: dict[str, Path]) -> dict:
    """run_qa.py (--pad_to_max_length False): prepare_train_features / prepare_validation_features,
    DataCollatorWithPadding; utils_qa's postprocessing of the logits, the official v2.0 evaluation."""
    import numpy as np
    import torch
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding

    from jaxseq.data.squad import postprocess, read_squad

    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_examples, dev_examples = read_squad(files["train"]), read_squad(files["validation"])

    def tokenized(examples):
        return tokenizer(
            [e["question"].lstrip() for e in examples],
            [e["context"] for e in examples],
            truncation="only_second",
            max_length=setting.max_length,
            stride=setting.doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
        )

    def prepare_train_features(examples):
        encoded, features = tokenized(examples), []
        for i, offsets in enumerate(encoded["offset_mapping"]):
            input_ids = encoded["input_ids"][i]
            cls_index = input_ids.index(tokenizer.cls_token_id)
            sequence_ids = encoded.sequence_ids(i)
            answers = examples[encoded["overflow_to_sample_mapping"][i]]["answers"]
            start = end = cls_index
            if answers["answer_start"]:
                start_char = answers["answer_start"][0]
                end_char = start_char + len(answers["text"][0])
                token_start = 0
                while sequence_ids[token_start] != 1:
                    token_start += 1
                token_end = len(input_ids) - 1
                while sequence_ids[token_end] != 1:
                    token_end -= 1
                if offsets[token_start][0] <= start_char and offsets[token_end][1] >= end_char:
                    while token_start < len(offsets) and offsets[token_start][0] <= start_char:
                        token_start += 1
                    start = token_start - 1
                    while offsets[token_end][1] >= end_char:
                        token_end -= 1
                    end = token_end + 1
            features.append({k: encoded[k][i] for k in ("input_ids", "token_type_ids", "attention_mask")})
            features[-1].update(start_positions=start, end_positions=end)
        return features

    def prepare_validation_features(examples):
        encoded = tokenized(examples)
        width = max(map(len, encoded["input_ids"]))
        offsets = np.full((len(encoded["input_ids"]), width, 2), -1, np.int64)
        features = []
        for i, pairs in enumerate(encoded["offset_mapping"]):
            sequence_ids = encoded.sequence_ids(i)
            for t, pair in enumerate(pairs):
                if sequence_ids[t] == 1:
                    offsets[i, t] = pair
            features.append({k: encoded[k][i] for k in ("input_ids", "token_type_ids", "attention_mask")})
        return features, np.asarray(encoded["overflow_to_sample_mapping"]), offsets

    train = prepare_train_features(train_examples)
    dev, example_index, offsets = prepare_validation_features(dev_examples)
    model = AutoModelForQuestionAnswering.from_pretrained(args.model)
    collate = DataCollatorWithPadding(tokenizer, return_tensors="pt")
    row = train_loop(model, train, collate, epochs=setting.epochs, steps=setting.steps)
    width = offsets.shape[1]
    start_logits = np.full((len(dev), width), -1e4, np.float32)
    end_logits = np.full((len(dev), width), -1e4, np.float32)
    with torch.no_grad():
        for i in range(0, len(dev), EVAL_BATCH):
            out = model(**collate(dev[i : i + EVAL_BATCH]))
            n = out.start_logits.shape[1]
            start_logits[i : i + EVAL_BATCH, :n] = out.start_logits.numpy()
            end_logits[i : i + EVAL_BATCH, :n] = out.end_logits.numpy()
    answers, _, _ = postprocess(
        dev_examples, example_index, offsets, start_logits, end_logits, version_2_with_negative=True
    )
    scores = official_scores(files["validation"], answers)
    return {**row, **scores, "train_windows": len(train), "dev_windows": len(dev)}


def pytorch_mlm(args, setting: Setting, files: dict[str, Path], steps: int) -> dict:
    """run_mlm.py (not --line_by_line): each line tokenized (with [CLS] and [SEP]), joined and cut into blocks
    of max_length, DataCollatorForLanguageModeling(mlm_probability=0.15); the evaluation blocks masked once."""
    import math

    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling

    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def group_texts(path: Path) -> list[dict]:
        encoded = tokenizer(path.read_text(encoding="utf-8").splitlines(), return_special_tokens_mask=True)
        joined = {k: [t for line in encoded[k] for t in line] for k in encoded}
        total = len(joined["input_ids"]) // setting.max_length * setting.max_length
        return [
            {k: v[i : i + setting.max_length] for k, v in joined.items()} for i in range(0, total, setting.max_length)
        ]

    train, dev = group_texts(files["train"]), group_texts(files["validation"])
    model = AutoModelForMaskedLM.from_pretrained(args.model)
    collate = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, return_tensors="pt")
    row = train_loop(model, train, collate, steps=steps)
    torch.manual_seed(SEED)
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(dev), EVAL_BATCH):
            batch = collate(dev[i : i + EVAL_BATCH])
            labels = batch.pop("labels")
            logits = model(**batch).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            loss_sum += float(loss)
            count += int((labels != -100).sum())
    eval_loss = loss_sum / count
    return {**row, "eval_loss": eval_loss, "perplexity": math.exp(eval_loss), "train_blocks": len(train),
            "eval_blocks": len(dev)}  # fmt: skip


# ------------------------------------------------------------------ the rows
def run_job(args, job: str) -> dict:
    import torch

    setting = SETTINGS[job]
    box = {**records.environment(), "matmul_gflops": records.cpu_matmul_gflops()}  # each row's own
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if job == "ner":
            files = write_ner(tmp, args.conll)
        elif job == "qa":
            files = write_squad(tmp, args.text)
        else:
            files = write_mlm(tmp, args.text)
        jaxseq = run_jaxseq(args, setting, files, tmp)
        print(f"{job} jaxseq: {json.dumps(jaxseq)}", file=sys.stderr, flush=True)
        torch.set_num_threads(os.cpu_count() or 1)
        if job == "ner":
            pytorch = pytorch_ner(args, setting, files)
        elif job == "qa":
            pytorch = pytorch_qa(args, setting, files)
        else:
            pytorch = pytorch_mlm(args, setting, files, jaxseq["steps"])
        print(f"{job} pytorch: {json.dumps(pytorch)}", file=sys.stderr, flush=True)
    quality = setting.quality
    row = {
        "environment": box,
        "settings": {
            **dataclasses.asdict(setting),
            "batch": BATCH,
            "lr": LR,
            "seed": SEED,
            "model": "all-MiniLM-L6-v2 (BERT, 22.7M), pretrained encoder; the head initialised by each framework",
            "dtype": "float32",
            "pytorch_optimizer": OPTIMIZER.get("name"),
        },
        "jaxseq": jaxseq,
        "pytorch": pytorch,
        "time_ratio": jaxseq["seconds"] / pytorch["seconds"],
    }
    if quality == "f1":
        row["f1_points"] = 100 * (jaxseq["f1"] - pytorch["f1"]) if job == "ner" else jaxseq["f1"] - pytorch["f1"]
    else:
        row["eval_loss_difference"] = jaxseq["eval_loss"] - pytorch["eval_loss"]
    return row


def trained_steps(out: Path) -> int:
    """The steps the jaxseq run took (its trainer_state or metrics log)."""
    for line in reversed((out / "metrics.jsonl").read_text().splitlines()):
        step = json.loads(line).get("step")
        if step:
            return int(step)
    raise SystemExit(f"no step in {out / 'metrics.jsonl'}")


def length(s: dict) -> str:
    run = f"{s['steps']} steps" if s.get("steps") else f"{s['epochs']} epoch(s)"
    stride = f", stride {s['doc_stride']}" if s.get("doc_stride") else ""
    return f"{run} of batch {s['batch']}, length {s['max_length']}{stride}"


def row_box(env: dict | None) -> str:
    """Where a row ran: date, commit, CPU, its measured matmul rate (rows recorded before these: unknown)."""
    if not env:
        return "not recorded"
    return f"{env['date']}, {env['jaxseq_commit']}, {env['machine'].split(',')[0]}, {env['matmul_gflops']:.0f} GFLOP/s"


def markdown(results: dict) -> str:
    if not results:
        return ""
    env = results["environment"]
    box = "shared with other processes" if results["box"] == BOXES["shared"] else "nothing else running"
    lines = [
        f"{env['date']}, {env['machine']} ({box}), jax {env['versions'].get('jax')}, torch "
        f"{env['versions'].get('torch')}; all-MiniLM-L6-v2, each framework drawing its own head; jaxseq's default "
        "flags (batch 32, lr 5e-5 linear), one CPU device; PyTorch with dynamic padding and "
        f"{results.get('pytorch_optimizer')}. Each row's box: its date, jaxseq commit, CPU and float32 matmul rate "
        "in JAX just before it ran (the ratio moves with the CPU).",
        "",
        "| job | data, run | box | jaxseq (whole command; first step with compile) | PyTorch (training loop) "
        "| ratio | jaxseq | PyTorch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for job in JOBS:
        if job not in results.get("rows", {}):
            continue
        row = results["rows"][job]
        j, p, s = row["jaxseq"], row["pytorch"], row["settings"]
        if job == "ner":
            quality = [f"F1 {100 * r['f1']:.2f}" for r in (j, p)]
        elif job == "qa":
            quality = [f"F1 {r['f1']:.2f} (HasAns {r['HasAns_f1']:.1f}, NoAns {r['NoAns_f1']:.1f})" for r in (j, p)]
        else:
            quality = [f"eval loss {r['eval_loss']:.3f} (ppl {r['perplexity']:.1f})" for r in (j, p)]
        lines.append(
            f"| {job} | {s['data']}; {length(s)} | {row_box(row.get('environment'))} | **{j['seconds']:.1f} s** "
            f"({j['compile_seconds']:.1f} s) | **{p['seconds']:.1f} s** | **{row['time_ratio']:.2f}x** | "
            f"{quality[0]} | {quality[1]} |"
        )
    return "\n".join(lines + ["", *results.get("notes", [])]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of {', '.join(JOBS)}")
    parser.add_argument("--model", type=Path, default=SHARED / "models" / "all-MiniLM-L6-v2")
    parser.add_argument("--conll", type=Path, default=SHARED / "data" / "ner" / "conll2003-test.json")
    parser.add_argument("--text", type=Path, default=SHARED / "data" / "text", help="WikiText-2's .tokens files")
    parser.add_argument("--no_save", action="store_true", help="do not record the run in bench/results/examples.json")
    parser.add_argument(
        "--box", choices=tuple(BOXES), default="shared", help="whether other processes shared the CPU (recorded)"
    )
    parser.add_argument("--markdown", action="store_true", help="run nothing: write BENCHMARKS.md's table")
    args = parser.parse_args()
    if args.markdown:
        return records.write_markdown("examples", markdown)
    jobs = records.chosen_sides(parser, args.jobs, JOBS)
    rows = records.read("examples").get("rows", {})
    for job in jobs:  # recorded after each job, so that a later failure keeps the earlier rows
        rows[job] = run_job(args, job)
        results = entry(rows, args.box)
        if not args.no_save:
            print(f"wrote {records.write('examples', results)}", file=sys.stderr)
    print(markdown(results))
    return 0


BOXES = {
    "shared": "shared: other processes used the same CPU cores during the run; each job's two sides ran back to "
    "back, so the load falls on both, but the timings are noisy",
    "quiet": "quiet: nothing else ran on the machine during the run",
}


def entry(rows: dict, box: str) -> dict:
    import torch

    return {
        "environment": {**records.environment(), "cpu_threads_torch": torch.get_num_threads()},
        "box": BOXES[box],
        "times": {
            "jaxseq": "the whole command's wall time (start-up, data, compilation, training, evaluation, saving)",
            "pytorch": "the training loop alone (no start-up, tokenization, evaluation)",
        },
        "pytorch_optimizer": next((r["settings"]["pytorch_optimizer"] for r in rows.values()), None),
        "notes": [] if "qa" in rows else [QA_NOTE],
        "rows": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
