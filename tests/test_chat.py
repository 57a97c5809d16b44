"""Chat fine-tuning (jaxseq/data/chat.py, scripts/finetune_chat.py): the loss covers exactly the assistant's
tokens of every turn, equals transformers' loss with the other labels set to -100, packed rows give the same
loss as one conversation per row (attention and positions never cross), bad records end in one line, and a
run on chats whose user turns are random words learns the assistant's reply to a loss that only masking
allows; transformers' generate then chats with the exported folder and its template."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from jaxseq.data.chat import chat_rows, encode_chat, encode_chats, read_chats, use_chat_template  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.models import load_pretrained  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import perturb  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "finetune_chat.py"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHATS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, since 1871."},
    ],
    [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there!"}],
    [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two, three."}],
]


@pytest.fixture(scope="module")
def tokenizer():
    folder = shared_asset("data/tokenizers/gpt2")
    tok = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    use_chat_template(tok, TEMPLATE)
    return tok


def test_the_loss_mask_covers_exactly_every_assistant_turn(tokenizer):
    ids, mask = encode_chat(tokenizer, CHATS[0])
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CHATS[0], tokenize=False)
    assistant = [m["content"] for m in CHATS[0] if m["role"] == "assistant"]
    assert tokenizer.decode(ids[mask == 1]) == "".join(f"{a}<|endoftext|>\n" for a in assistant)
    assert np.count_nonzero(np.diff(mask) == 1) == 2  # two separate runs: one per assistant turn


def test_records_are_read_in_every_format_and_bad_ones_end_in_one_line(tmp_path):
    path = tmp_path / "chats.jsonl"
    records = [
        {"messages": CHATS[1]},
        {"prompt": "Say hi", "completion": "Hi there!"},
        {
            "prompt": [{"role": "user", "content": "Say hi"}],
            "completion": [{"role": "assistant", "content": "Hi there!"}],
        },
    ]
    path.write_text("\n".join(map(json.dumps, records)) + "\n")
    assert [chat.messages for chat in read_chats(path)] == [CHATS[1]] * 3
    bad = {
        "no assistant message": {"messages": [{"role": "user", "content": "hello?"}]},
        "message 1 must be": {"messages": [{"role": "bot", "content": "hi"}]},
        "neither 'messages'": {"text": "hello"},
    }
    for match, record in bad.items():
        path.write_text(json.dumps(record) + "\n")
        with pytest.raises(JaxseqError, match=f"chats.jsonl:1.*{match}"):
            read_chats(path)
    with pytest.raises(JaxseqError, match="does not exist"):
        read_chats(tmp_path / "missing.jsonl")


def test_a_template_that_renders_turns_out_of_order_is_refused(tokenizer):
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = "{% for m in messages|reverse %}{{ m['content'] }}\n{% endfor %}"
        with pytest.raises(JaxseqError, match="renders turn 2 differently"):
            encode_chat(tokenizer, CHATS[1])
    finally:
        tokenizer.chat_template = saved


def test_loss_is_transformers_with_other_labels_ignored_packed_or_not(tokenizer, tmp_path):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=len(tokenizer))
    torch_model = perturb(transformers.GPT2LMHeadModel(config).eval())
    torch_model.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "causal-lm")
    encoded = encode_chats(tokenizer, CHATS, 64, progress=False)

    total, count = 0.0, 0
    for ids, mask in encoded:
        labels = torch.as_tensor(np.where(mask == 1, ids, -100)[None], dtype=torch.long)
        with torch.no_grad():
            loss = torch_model(input_ids=torch.as_tensor(ids[None], dtype=torch.long), labels=labels).loss
        n = int(mask[1:].sum())
        total, count = total + float(loss) * n, count + n

    results = {}
    for pack in (False, True):
        rows = chat_rows(encoded, 64, pack)
        out = CausalLM(chunk_tokens=16).predict(model, {k: jnp.asarray(v) for k, v in rows.items()})
        results[pack] = (float(out["loss_sum"].sum()), float(out["tokens"].sum()), len(rows["input_ids"]))
    assert results[False][2] == 3 and results[True][2] == 2  # packed: two of the three chats share a row
    for loss_sum, tokens, _ in results.values():
        assert tokens == count
        assert abs(loss_sum / tokens - total / count) <= 1e-5 * total / count


def test_packed_rows_keep_each_conversation_apart(tokenizer):
    encoded = encode_chats(tokenizer, CHATS, 64, progress=False)
    rows = chat_rows(encoded, 64, pack=True)
    found = []
    for r, segments in enumerate(rows["attention_mask"]):
        for segment in range(1, segments.max() + 1):
            where = np.flatnonzero(segments == segment)
            assert np.array_equal(where, np.arange(where[0], where[-1] + 1))  # one contiguous span
            np.testing.assert_array_equal(rows["position_ids"][r][where], np.arange(len(where)))
            found.append((tuple(rows["input_ids"][r][where]), tuple(rows["loss_mask"][r][where])))
    assert sorted(found) == sorted((tuple(ids), tuple(mask)) for ids, mask in encoded)


@pytest.fixture(scope="module")
def chat_run(tokenizer, tmp_path_factory):
    """scripts/finetune_chat.py on 96 chats: user turns of 12 random words, the same reply to each."""
    root = tmp_path_factory.mktemp("chat")
    tokenizer.save_pretrained(root / "tokenizer")
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128).save_pretrained(root / "config")
    words = [w for w in shared_asset("data/text/tinyshakespeare.txt").read_text().split() if w.isalpha()][:3000]
    rng = np.random.default_rng(0)
    reply = "Noted, thank you."
    chats = [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choice(words, 12))},
                {"role": "assistant", "content": reply},
            ]
        }
        for _ in range(96)
    ]
    (root / "train.jsonl").write_text("\n".join(map(json.dumps, chats[:80])) + "\n")
    (root / "valid.jsonl").write_text("\n".join(map(json.dumps, chats[80:])) + "\n")
    out = root / "out"
    args = [
        "--config_name", root / "config", "--tokenizer_name", root / "tokenizer",
        "--train_file", root / "train.jsonl", "--validation_file", root / "valid.jsonl",
        "--max_seq_length", 128, "--per_device_train_batch_size", 2, "--per_device_eval_batch_size", 4,
        "--max_steps", 120, "--learning_rate", 3e-3, "--logging_steps", 20, "--seed", 0, "--output_dir", out,
        "--compilation_cache_dir", root / "xla-cache",
    ]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, env=env,
                            timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return out, reply, words


def test_chat_fine_tune_learns_the_reply_and_transformers_chats_with_the_export(chat_run):
    out, reply, words = chat_run
    results = json.loads((out / "eval_results.json").read_text())
    # a loss over the user's random words (thousands of choices each) could not fall below ~5 nats a token
    assert results["eval_loss"] < 0.5, results
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": " ".join(words[100:112])}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    generated = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    assert tok.decode(generated[0, ids.shape[1] :]).startswith(reply)


def test_a_tokenizer_without_a_chat_template_stops_in_one_line():
    folder = shared_asset("data/tokenizers/gpt2")
    tok = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    with pytest.raises(JaxseqError, match="--chat_template"):
        use_chat_template(tok, None)
