"""User code inside jaxseq runs as in plain Python: the process the user started is the one that runs (no
re-execution, no environment variables set for the job), libraries import as their authors intend (transformers
sees torch; seqeval, matplotlib and tensorboardX import normally, on the thread that uses them), the backend and
warning filters a script chose stay its own, and the process exits as Python does (atexit handlers run,
buffered files of user code are flushed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import shared_asset
from tests.tiny import LETTERS, letters_gpt2

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

JAXSEQ = Path(sys.executable).with_name("jaxseq")  # the installed console command
STEPS = 3

REWARDS = """
import atexit, json, os

import torch
import transformers

SEEN = {seen!r}
LOG = open({log!r}, "a")  # never closed: Python's own exit flushes it
atexit.register(lambda: open({atexit_mark!r}, "w").write("ran"))
with open(SEEN, "w") as f:
    json.dump({{"pid": os.getpid(), "environ": dict(os.environ), "torch": transformers.utils.is_torch_available()}}, f)
SCORER = transformers.AutoModelForSequenceClassification.from_pretrained({scorer!r}).eval()


def scored(prompts, completions, completion_ids, **kwargs):
    width = max(len(ids) for ids in completion_ids) or 1
    ids = torch.tensor([list(ids) + [1] * (width - len(ids)) for ids in completion_ids])
    with torch.no_grad():
        scores = SCORER(input_ids=ids).logits[:, 0]
    LOG.write(json.dumps([float(s) for s in scores]) + "\\n")
    return [float(s) for s in scores]
"""


def reward_model(policy: Path, root: Path) -> None:
    """A PyTorch reward model (one score) on the policy's vocabulary, saved to ``root``."""
    config = transformers.GPT2Config.from_pretrained(policy, num_labels=1, pad_token_id=1)
    transformers.GPT2ForSequenceClassification(config).save_pretrained(root)


def plain_env() -> dict[str, str]:
    """The environment of a user's shell: one CPU device, offline; none of the suite's XLA_FLAGS."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GLIBC_TUNABLES")}
    env.update(HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu", JAXSEQ_TEST_MARK="kept")
    return env


@pytest.mark.slow
def test_grpo_reward_functions_run_as_in_plain_python(tmp_path):
    """`jaxseq grpo` with a reward module that scores completions with a transformers PyTorch model, records
    its process and writes to a file it never closes: exit 0, a reward at every step, the process and the
    environment the user started (nothing added, the same process id as the command's), transformers seeing
    torch, every line written kept, the module's atexit handler run."""
    letters_gpt2(tmp_path / "policy")
    reward_model(tmp_path / "policy", tmp_path / "scorer")
    seen, log, mark = tmp_path / "seen.json", tmp_path / "scores.jsonl", tmp_path / "atexit"
    module = REWARDS.format(seen=str(seen), log=str(log), atexit_mark=str(mark), scorer=str(tmp_path / "scorer"))
    (tmp_path / "rewards.py").write_text(module)
    prompts = [{"prompt": " ".join(LETTERS[i : i + 3])} for i in range(8)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(map(json.dumps, prompts)) + "\n")
    flags = [
        "--model_name_or_path", tmp_path / "policy", "--train_file", tmp_path / "prompts.jsonl",
        "--reward_funcs", f"{tmp_path / 'rewards.py'}:scored", "--num_generations", 4,
        "--max_completion_length", 4, "--per_device_train_batch_size", 8, "--max_steps", STEPS,
        "--logging_steps", 1, "--output_dir", tmp_path / "out", "--report_to", "none", "--save_strategy", "no",
    ]  # fmt: skip
    env = plain_env()
    process = subprocess.Popen(
        [str(JAXSEQ), "grpo", *map(str, flags)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    rewards = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rewards if "train/reward" in r] == list(range(1, STEPS + 1))
    record = json.loads(seen.read_text())
    assert record["pid"] == process.pid  # the process the user started, not a re-executed one
    assert record["environ"] == env  # nothing set for the job, nothing taken away
    assert record["torch"] is True
    scores = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(scores) == STEPS and all(len(s) == 8 for s in scores)  # the buffered lines, flushed at exit
    assert mark.read_text() == "ran"


SCRIPT = """
import json, sys, warnings

import matplotlib

matplotlib.use("svg")
warnings.filterwarnings("ignore", message="a filter of the user's own")
filters = list(warnings.filters)
argv = list(sys.argv)

from jaxseq.commands import main

returned = []
returned.append(main(["glue", *{flags!r}]))

import matplotlib.pyplot as plt
import torch
import transformers

fig, ax = plt.subplots()
ax.plot([1, 2, 3])
fig.savefig({svg!r})
model = transformers.BertForSequenceClassification(
    transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
)
logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
print(json.dumps({{
    "returned": returned,
    "backend": matplotlib.get_backend(),
    "filters_kept": all(f in warnings.filters for f in filters),  # libraries imported may add their own
    "argv_kept": sys.argv == argv,
    "torch": transformers.utils.is_torch_available(),
    "logits": list(logits.shape),
}}))
"""


@pytest.mark.slow
def test_a_script_calling_main_goes_on_as_in_plain_python(tmp_path):
    """A script that sets its own matplotlib backend and warning filters, calls
    ``jaxseq.commands.main(["glue", ...])`` (MiniLM on 32 SST-2 sentences, two steps), then goes on with torch,
    transformers and matplotlib: ``main`` returns 0 once, the backend is still svg, the script's warning
    filters and ``sys.argv`` are in place, transformers sees torch and runs a PyTorch model, the svg is
    written; the run's plot is a PNG, drawn without touching the backend."""
    flags = [
        "--model_name_or_path", str(shared_asset("models/all-MiniLM-L6-v2")), "--task_name", "sst2",
        "--data_dir", str(shared_asset("data/glue")), "--max_train_samples", "32", "--max_eval_samples", "32",
        "--max_seq_length", "32", "--per_device_train_batch_size", "16", "--max_steps", "2",
        "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--save_strategy", "no",
    ]  # fmt: skip
    script = SCRIPT.format(flags=flags, svg=str(tmp_path / "user.svg"))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=plain_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "returned": [0],
        "backend": "svg",
        "filters_kept": True,
        "argv_kept": True,
        "torch": True,
        "logits": [1, 2],
    }
    assert (tmp_path / "user.svg").read_text().lstrip().startswith("<?xml")
    assert (tmp_path / "out" / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
