"""Tool-calling data (a row's ``tools``, assistant ``tool_calls``, ``tool`` turns) in ``chat``, ``dpo``, ``grpo``
and ``kto``, against TRL's own data code (its trainers' ``_prepare_dataset`` and GRPO's ``_tokenize_prompts``,
called on stand-ins for the trainers): the same token ids, and chat's loss mask TRL's assistant mask from a
template's ``{% generation %}`` markers (its completion mask too, for prompt-completion rows). The tool calls
are learned, the tools' results are not. The installed ``jaxseq chat`` trains on tool-calling chats in a fresh
one-device process."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from jaxseq.commands.grpo import prompt_rows  # noqa: E402
from jaxseq.data.chat import conversation, encode_chat, template_kwargs  # noqa: E402
from jaxseq.data.kto import encode_unpaired  # noqa: E402
from jaxseq.data.preference import encode_pair  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from tests.reference import perturb  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

# Qwen's style: the tools' schemas in the system turn, calls as <tool_call> JSON, results in tool turns; the
# assistant's output (after the generation prompt, to its end of turn) between {% generation %} markers
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{%- if m.content %}{{ m.content }}{% endif %}"
    "{%- for call in m.tool_calls or [] %}{% set f = call.function or call %}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}</tool_call>{% endfor %}'
    "<|im_end|>\n{% endgeneration %}"
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [WEATHER, TIME]


def call(name, city):
    return {"type": "function", "function": {"name": name, "arguments": {"city": city}}}


def turn(role, content=None, calls=None):
    return {
        "role": role,
        **({"content": content} if content is not None else {}),
        **({"tool_calls": calls} if calls else {}),
    }


ASK = [turn("system", "Use the tools."), turn("user", "Weather in Paris?")]
CALL = turn("assistant", calls=[call("get_weather", "Paris")])
RESULT = turn("tool", "18 C, sunny")
ANSWER = turn("assistant", "It is 18 C and sunny in Paris.")
CHATS = [
    {"messages": [*ASK, CALL, RESULT, ANSWER], "tools": TOOLS},
    {
        "messages": [
            turn("user", "Time and weather in Rome?"),
            turn("assistant", "Checking both.", [call("get_time", "Rome"), call("get_weather", "Rome")]),
            turn("tool", "09:30"),
            turn("tool", "25 C"),
            turn("assistant", "It is 09:30 and 25 C in Rome."),
        ],
        "tools": json.dumps(TOOLS),  # as datasets often store it
    },
]
PROMPT_COMPLETION = [{"prompt": [*ASK, CALL, RESULT], "completion": [ANSWER], "tools": json.dumps(TOOLS)}]
PAIRS = [
    {"prompt": ASK, "chosen": [CALL], "rejected": [turn("assistant", "I cannot know that.")], "tools": TOOLS},
    {"prompt": [*ASK, CALL, RESULT], "chosen": [ANSWER], "rejected": [turn("assistant", "Rain.")], "tools": TOOLS},
]
UNPAIRED = [
    {"prompt": ASK, "completion": [CALL], "label": True, "tools": TOOLS},
    {"prompt": [*ASK, CALL, RESULT], "completion": [turn("assistant", "Rain.")], "label": False, "tools": TOOLS},
]


def as_dataset(records):
    """TRL's input: ``tools`` as a JSON string in every row (an Arrow column holds one type)."""
    rows = [{**r, "tools": r["tools"] if isinstance(r["tools"], str) else json.dumps(r["tools"])} for r in records]
    return datasets.Dataset.from_list(rows)


@pytest.fixture(scope="module")
def tok():
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def trl_config(cls, **fields):
    return cls(output_dir="unused", bf16=False, use_cpu=True, report_to=[], dataset_num_proc=None, **fields)


def trl_sft(tok, records):
    """TRL's SFT rows: ids and labels (-100 off the assistant's tokens, and off the prompt of prompt-completion)."""
    prompt_completion = "prompt" in records[0]
    trainer = types.SimpleNamespace(_tokenizer=tok, chat_template=None, completion_only_loss=prompt_completion)
    args = trl_config(trl.SFTConfig, assistant_only_loss=True, max_length=None)
    out = trl.SFTTrainer._prepare_dataset(trainer, as_dataset(records), tok, args, False, None, "x")
    return [(row["input_ids"], [label != -100 for label in row["labels"]]) for row in out]


def test_chat_ids_and_loss_mask_are_trls_with_assistant_masks(tok):
    for records in (CHATS, PROMPT_COMPLETION):
        expected = trl_sft(tok, records)
        hub_rows = [dict(row) for row in as_dataset(records)]  # a Hub dataset's: absent fields None
        for record, hub_row, (ids, learned) in zip(records, hub_rows, expected, strict=True):
            for row in (record, hub_row):
                got_ids, mask = encode_chat(tok, conversation(row, "a record"))
                assert got_ids.tolist() == ids
                assert mask.astype(bool).tolist() == learned


def test_the_calls_are_learned_and_the_results_are_not(tok):
    ids, mask = encode_chat(tok, conversation(CHATS[1], "a record"))
    learned = tok.decode(ids[mask == 1])
    assert learned.count("<tool_call>") == 2 and "Checking both." in learned and "09:30 and 25 C" in learned
    assert "<tool_response>" not in learned and "<tools>" not in learned
    assert '"get_time"' in tok.decode(ids)  # the schemas are in the rendered chat
    ids, mask = encode_chat(tok, conversation(PROMPT_COMPLETION[0], "a record"))
    assert tok.decode(ids[mask == 1]) == "It is 18 C and sunny in Paris.<|im_end|>\n"  # the completion's only


def test_dpo_pairs_are_trls(tok):
    trainer = types.SimpleNamespace(_tokenizer=tok)
    args = trl_config(trl.DPOConfig)
    out = trl.DPOTrainer._prepare_dataset(trainer, as_dataset(PAIRS), tok, args, "x")
    for record, row in zip(PAIRS, out, strict=True):
        assert encode_pair(tok, record) == (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])
        assert "<tools>" in tok.decode(row["prompt_ids"])


def test_kto_rows_are_trls(tok):
    trainer = types.SimpleNamespace(_tokenizer=tok, calculate_KL=False)
    args = trl_config(trl.KTOConfig)
    out = trl.KTOTrainer._prepare_dataset(trainer, as_dataset(UNPAIRED), tok, args, "x")
    for record, row in zip(UNPAIRED, out, strict=True):
        assert encode_unpaired(tok, record) == (row["prompt_ids"], row["completion_ids"])


def test_grpo_prompts_are_trls_with_the_tools(tok):
    """A row's tools where TRL's GRPOTrainer gives its own (``tools=``) to every prompt."""
    records = [{"prompt": p["prompt"], "tools": TOOLS} for p in PAIRS]
    trainer = types.SimpleNamespace(
        _is_vlm=False, environment_factories=None, tools=TOOLS, chat_template=None, chat_template_kwargs={},
        processing_class=tok,
    )  # fmt: skip
    prompts = [[{"content": None, **m} for m in r["prompt"]] for r in records]  # as a dataset gives them to TRL
    expected, _, _ = trl.GRPOTrainer._tokenize_prompts(trainer, prompts)
    rows = prompt_rows(tok, records, None, tok.eos_token_id)
    got = [ids[mask == 1].tolist() for ids, mask in zip(rows["input_ids"], rows["attention_mask"], strict=True)]
    assert got == [list(ids) for ids in expected]


def test_bad_tools_end_in_one_line():
    assert template_kwargs({"tools": ""})["tools"] is None and template_kwargs({})["tools"] is None
    for tools, match in (("[{", "is not valid JSON"), ({"name": "f"}, "must be a list"), (["f"], "must be a list")):
        with pytest.raises(JaxseqError, match=f"row 3: 'tools' {match}"):
            template_kwargs({"tools": tools}, "row 3")
    with pytest.raises(JaxseqError, match="message 2 must be"):
        conversation({"messages": [turn("user", "hi"), turn("tool", calls=[call("f", "x")])]}, "row 1")
    with pytest.raises(JaxseqError, match="no assistant message in its completion"):
        conversation({"prompt": [turn("user", "hi"), CALL], "completion": [RESULT]}, "row 1")


# --------------------------------------------------------------------------- the installed command, one device

JAXSEQ = Path(sys.executable).with_name("jaxseq")


def test_the_chat_command_trains_on_tool_calls(tok, tmp_path):
    config = tiny_config("llama", vocab_size=len(tok), max_position_embeddings=256, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    perturb(transformers.LlamaForCausalLM(config), std=0.05).save_pretrained(tmp_path / "llama")
    tok.save_pretrained(tmp_path / "llama")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS * 4))
    out = tmp_path / "out"
    args = [
        "--model_name_or_path", tmp_path / "llama", "--train_file", tmp_path / "train.jsonl", "--output_dir", out,
        "--do_train", "--max_steps", 2, "--per_device_train_batch_size", 2, "--max_seq_length", 256,
        "--learning_rate", 1e-3, "--logging_steps", 1, "--report_to", "none", "--save_strategy", "no",
        "--validation_split_percentage", 25,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    result = subprocess.run([str(JAXSEQ), "chat", *map(str, args)], capture_output=True, text=True, env=env,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2] and all(np.isfinite(r["train/loss"]) for r in train)
