"""``jaxseq grpo --reward_funcs`` with a reward model (a sequence classifier with one label, what ``jaxseq reward``
writes), against TRL 1.16's GRPOTrainer: on a tiny Llama classifier with perturbed weights, the scores jaxseq's
rollout computes on a mesh for plain and conversational prompts equal those of TRL's own ``_calculate_rewards``
(its texts, its tokenisation, its ``logits[:, 0]``) with the model and tokenizer TRL's ``__init__`` prepares,
under TRL's name, from one compiled program; ``jaxseq grpo`` as a fresh process raises a reward model's score;
a model and a Python function mix with --reward_weights, each logged under its name; a spec that is neither a
function nor a model ends in one line."""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.conftest import shared_asset
from tests.tiny import LETTERS, letters_gpt2, tiny_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

from transformers.trainer_callback import TrainerState  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import get_config_model_id  # noqa: E402

from jaxseq.commands import grpo  # noqa: E402
from jaxseq.commands.grpo import load_reward_funcs  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.train.rl import RewardModel  # noqa: E402
from tests.reference import perturb  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PLAIN = [
    ("The sky on a clear day is", " blue."),
    ("Two plus two is", " four, as everyone knows!"),
    ("Water boils at", " 100 degrees"),
    ("Hi", "!"),
    ("The opposite of hot is", " cold, or perhaps chilly, depending on whom you ask!"),
]
CONVERSATIONS = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}], "Paris!"),
    ([{"role": "user", "content": "Say hi"}], "Hi there, how are you today?"),
    ([{"role": "user", "content": "Count to three."}], "1, 2, 3"),
]


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    """A tiny Llama reward model (one label; its config's pad token 0, "!", which TRL replaces by the tokenizer's
    EOS), every weight perturbed, saved with the GPT-2 tokenizer (no pad token) and a chat template."""
    gpt2 = shared_asset("data/tokenizers/gpt2")
    tok = transformers.GPT2TokenizerFast(vocab=str(gpt2 / "vocab.json"), merges=str(gpt2 / "merges.txt"))
    tok.chat_template = TEMPLATE
    root = tmp_path_factory.mktemp("reward") / "tiny-rm"
    config = tiny_config("llama", vocab_size=len(tok), max_position_embeddings=128, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    perturb(transformers.LlamaForSequenceClassification(config), std=0.05, seed=1).save_pretrained(root)
    tok.save_pretrained(root)
    return root


class OneProcess:
    """The accelerator as TRL's ``_calculate_rewards`` reads it, on one CPU process."""

    device, is_main_process, num_processes = torch.device("cpu"), True, 1


def trl_rewards(folder, tmp_path, prompts, completions):
    """TRL's own ``GRPOTrainer._calculate_rewards`` on a trainer holding what it reads, the reward model and its
    tokenizer prepared as TRL's ``__init__`` prepares them (grpo_trainer.py: ``AutoModelForSequenceClassification
    .from_pretrained(reward_func, num_labels=1)``, the name ``get_config_model_id(config).split("/")[-1]``, the
    processing class ``AutoTokenizer.from_pretrained(get_config_model_id(config))`` with ``pad_token = eos_token``
    where it has none, and ``config.get_text_config().pad_token_id`` set to it)."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=1).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(get_config_model_id(model.config))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    trainer = object.__new__(GRPOTrainer)
    trainer.__dict__.update(
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], bf16=False),
        accelerator=OneProcess(),
        state=TrainerState(),
        reward_funcs=[model],
        reward_processing_classes=[tokenizer],
        reward_func_names=[get_config_model_id(model.config).split("/")[-1]],
        environments=None,
        chat_template_kwargs={},
        is_deepspeed_enabled=False,
    )
    inputs = [{"prompt": p} for p in prompts]
    rewards = trainer._calculate_rewards(inputs, prompts, completions, [[0]] * len(prompts))
    return rewards[:, 0].numpy(), trainer.reward_func_names[0]


def test_reward_model_scores_equal_trls(reward_folder, tmp_path):
    """Plain and conversational prompts (the completions of the latter as the rollout gives them), scored on a
    dp=4 x mp=2 mesh, 4 texts at a time (a call's texts in slices), by one program for both sets."""
    mesh = make_mesh("dp=4,mp=2")
    ((name, scorer),) = load_reward_funcs([str(reward_folder)], mesh=mesh, dtype="float32")
    assert isinstance(scorer, RewardModel) and scorer.tokenizer.pad_token == scorer.tokenizer.eos_token
    prompts = [p for p, _ in PLAIN] + [p for p, _ in CONVERSATIONS]
    scorer.size(2, prompts, max_completion_length=16)  # rounded up to the 4 data-parallel devices
    assert scorer.rows == 4
    kernel = scorer.state["model"]["embed_tokens"]["embedding"].get_value()
    assert kernel.sharding.mesh.shape == mesh.shape  # the weights live on the run's mesh
    for records in (PLAIN, CONVERSATIONS):
        prompts = [p for p, _ in records]
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": c}] if conversational else c for _, c in records]
        got = np.asarray(scorer(prompts=prompts, completions=completions, completion_ids=[[0]] * len(prompts)))
        want, trl_name = trl_rewards(reward_folder, tmp_path, prompts, completions)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        assert np.ptp(want) > 1e-3  # the texts score apart: a wrong token or padding would show
        assert name == trl_name == "tiny-rm"
    assert scorer.program._cache_size() == 1
    ((_, half),) = load_reward_funcs([str(reward_folder)], mesh=mesh, dtype="bfloat16")  # the run's --dtype
    prompts, completions = zip(*PLAIN)
    got = np.asarray(half(prompts=prompts, completions=completions))
    want, _ = trl_rewards(reward_folder, tmp_path, list(prompts), list(completions))
    assert 1e-5 < np.abs(got - want).max() < 5e-2, got - want  # bfloat16's rounding, no more


def letters_reward_model(root, vocab):
    """A one-layer Llama reward model over the letters' vocabulary whose score grows with the share of "a" in
    the text: queries and keys 0 (attention averages every token so far), "a" alone writes a value that the
    output projection puts on a hidden axis the score reads; no MLP. Saved with the letters' tokenizer."""
    config = tiny_config(
        "llama", vocab_size=len(vocab), num_hidden_layers=1, num_key_value_heads=4, max_position_embeddings=64,
        num_labels=1, pad_token_id=vocab["<pad>"], rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(config)
    a = vocab["a"]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        embed = torch.randn(len(vocab), config.hidden_size)
        embed[:, :2] = 0
        embed[a] = 0
        embed[a, 1] = 1.0
        model.model.embed_tokens.weight.copy_(embed)
        layer = model.model.layers[0]
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        layer.self_attn.v_proj.weight[0, 1] = config.hidden_size**-0.5  # 1 for "a", else 0
        layer.self_attn.o_proj.weight[0, 0] = 4.0
        model.model.norm.weight.fill_(1.0)
        model.score.weight[0, 0] = 1.0
    model.save_pretrained(root)
    transformers.AutoTokenizer.from_pretrained(root.parent / "model").save_pretrained(root)
    return model


def run_grpo(args, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, "-m", "jaxseq", "grpo", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def test_jaxseq_grpo_raises_a_reward_models_score(tmp_path):
    """A fresh process on one CPU device: the reward, the letters reward model's score of prompt + completion
    (it grows with the share of "a"), climbs within 30 steps, logged under the model's name."""
    vocab = letters_gpt2(tmp_path / "model")
    rm = letters_reward_model(tmp_path / "rm", vocab)
    with torch.no_grad():  # the score does grow with the share of "a": more "a", a higher score
        ids = lambda text: torch.tensor([[vocab[w] for w in text.split()]])
        scores = [rm(ids(t)).logits[0, 0].item() for t in ("b c d e f", "b a d e f", "a a d a f", "a a a a a")]
    assert np.all(np.diff(scores) > 0.2), scores
    rng = np.random.default_rng(0)
    prompts = [{"prompt": " ".join(rng.choice(LETTERS, 4))} for _ in range(32)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(map(json.dumps, prompts)) + "\n")
    steps = 30
    started = time.perf_counter()
    result = run_grpo([
        "--model_name_or_path", tmp_path / "model", "--train_file", tmp_path / "prompts.jsonl",
        "--reward_funcs", tmp_path / "rm", "--num_generations", 8, "--max_completion_length", 8,
        "--per_device_train_batch_size", 32, "--max_steps", steps, "--learning_rate", 5e-3,
        "--lr_scheduler_type", "constant", "--logging_steps", 1, "--output_dir", tmp_path / "out",
        "--report_to", "none", "--save_strategy", "no", "--seed", 0,
    ])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reward functions: rm" in result.stdout and "widens" not in result.stdout  # one scoring program
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if "train/reward" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    rewards = np.array([r["train/reward"] for r in train])
    np.testing.assert_allclose(rewards, [r["train/rewards/rm/mean"] for r in train], rtol=1e-5)
    first, last = rewards[:5].mean(), rewards[-5:].mean()
    assert last > first + 2, (rewards.round(3).tolist(), time.perf_counter() - started)


LENGTH = """
def length(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]
"""


def test_a_reward_model_mixes_with_functions_and_weights(tmp_path):
    """--reward_funcs MODEL rewards.py:length --reward_weights 0.5 -1.0: both figures logged by their names, the
    reward their weighted sum, 2 steps in this process (8 CPU devices, the scorer's batch split over them)."""
    vocab = letters_gpt2(tmp_path / "model")
    letters_reward_model(tmp_path / "rm", vocab)
    (tmp_path / "rewards.py").write_text(LENGTH)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"a b {x}"}) + "\n" for x in LETTERS))
    args = [
        "--model_name_or_path", tmp_path / "model", "--train_file", tmp_path / "prompts.jsonl",
        "--reward_funcs", tmp_path / "rm", f"{tmp_path / 'rewards.py'}:length", "--reward_weights", 0.5, -1.0,
        "--num_generations", 4, "--max_completion_length", 6, "--per_device_train_batch_size", 1,
        "--max_steps", 2, "--logging_steps", 1, "--output_dir", tmp_path / "out", "--report_to", "none",
        "--save_strategy", "no", "--compilation_cache_dir", "",
    ]  # fmt: skip
    assert jax.device_count() == 8
    assert grpo.main([str(a) for a in args]) == 0
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if "train/reward" in r]
    assert len(train) == 2
    for r in train:
        model, length = r["train/rewards/rm/mean"], r["train/rewards/length/mean"]
        assert {"train/rewards/rm/std", "train/rewards/length/std"} <= set(r)
        assert 1 <= length <= 6 and model != 0
        np.testing.assert_allclose(r["train/reward"], 0.5 * model - 1.0 * length, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "spec, says",
    [
        ("{tmp}/empty", "is a folder without config.json"),
        ("{tmp}/rewards.py", "neither path/to/file.py:function nor a reward model"),
        ("{tmp}/nowhere/rm", "neither path/to/file.py:function nor a reward model"),
        ("{tmp}/model", "is a GPT2LMHeadModel, not a reward model"),
    ],
)
def test_a_bad_reward_spec_ends_in_one_line(tmp_path, capsys, spec, says):
    """A folder without config.json, a .py without its function, a path that is nothing, a causal LM: one line
    on stderr naming the spec, a non-zero exit."""
    letters_gpt2(tmp_path / "model")
    (tmp_path / "empty").mkdir()
    (tmp_path / "rewards.py").write_text(LENGTH)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a b"}\n')
    spec = spec.format(tmp=tmp_path)
    capsys.readouterr()  # what saving the model printed
    args = [
        "--model_name_or_path", tmp_path / "model", "--train_file", tmp_path / "prompts.jsonl",
        "--reward_funcs", spec, "--num_generations", 2, "--per_device_train_batch_size", 2, "--max_steps", 1,
        "--output_dir", tmp_path / "out", "--report_to", "none", "--compilation_cache_dir", "",
    ]  # fmt: skip
    assert grpo.main([str(a) for a in args]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and spec in err, err
    with pytest.raises(JaxseqError, match=says):
        load_reward_funcs([spec])
