"""``jaxseq serve``, the installed command as a fresh process on one CPU device, answering the official
``openai`` client: greedy completions and chat answers (through the chat template of --chat_template) equal
transformers' ``generate``; streamed answers are the whole ones in pieces, with usage; a seed repeats a
sampled answer; ``n`` choices; a wrong model, a negative ``max_tokens`` and a prompt past the context get a
4xx with OpenAI's error body and the server goes on; a 1536-token answer fits the model's 2048 positions, and
a short request sent while it runs ends long before it (continuous batching). In the same process:
--lora_adapter serves the base with a PEFT adapter merged (PEFT's own greedy answers) and --config_overrides
reaches the model."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")

from jaxseq.cli import parse  # noqa: E402
from jaxseq.commands import serve  # noqa: E402
from jaxseq.engine import SamplingParams  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from tests.reference import perturb  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

JAXSEQ = Path(sys.executable).with_name("jaxseq")
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "To be"]


def tokenizer():
    folder = shared_asset("data/tokenizers/gpt2")
    return transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny perturbed Llama of 2048 positions (its tokenizer without a chat template), and the template's
    file."""
    root = tmp_path_factory.mktemp("serve")
    tok = tokenizer()
    config = tiny_config("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = perturb(transformers.LlamaForCausalLM(config), std=0.05).eval()
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "template.jinja").write_text(TEMPLATE)
    return root, model, tok


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(world):
    root, _, _ = world
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    args = ["--model_name_or_path", root / "model", "--tokenizer_name", root / "model", "--chat_template",
            root / "template.jinja", "--served_model_name", "tiny", "--host", "127.0.0.1", "--port", port,
            "--max_batch_size", 16, "--compilation_cache_dir", ""]  # fmt: skip
    log = open(root / "serve.log", "w")  # noqa: SIM115 (open while the server runs)
    process = subprocess.Popen([str(JAXSEQ), "serve", *map(str, args)], stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 600
    while True:
        try:
            with urllib.request.urlopen(f"{base}/models", timeout=5) as answer:
                models = json.loads(answer.read())
            break
        except OSError:
            assert process.poll() is None, (root / "serve.log").read_text()[-3000:]
            assert time.time() < deadline, "the server did not come up"
            time.sleep(1)
    yield openai.OpenAI(base_url=base, api_key="none", max_retries=0), models, process
    process.terminate()
    process.wait(timeout=60)
    log.close()
    text = (root / "serve.log").read_text()
    assert "Traceback" not in text, text[-3000:]


def greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def test_models_lists_the_served_name(server):
    _, models, _ = server
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"


def test_greedy_completions_equal_transformers(server, world):
    client, _, _ = server
    _, model, tok = world
    answer = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, answer.choices):
        want = greedy(model, tok(prompt)["input_ids"], 12)
        assert choice.text == tok.decode(want, skip_special_tokens=True) and choice.finish_reason == "length"
    prompt_tokens = sum(len(tok(p)["input_ids"]) for p in PROMPTS)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, 36)
    two = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0, n=2)
    assert len(two.choices) == 2 and two.choices[0].text == two.choices[1].text


def test_chat_answers_through_the_template_equal_transformers(server, world):
    client, _, _ = server
    _, model, tok = world
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the sky?"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    tok.chat_template = TEMPLATE
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert answer.choices[0].message.content == tok.decode(greedy(model, ids, 10), skip_special_tokens=True)
    assert answer.choices[0].message.role == "assistant" and answer.usage.prompt_tokens == len(ids)


def test_streams_are_the_whole_answers_in_pieces(server):
    client, _, _ = server
    whole = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len(pieces) > 2 and "".join(pieces) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-2].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Hi"}]
    said = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed)
    assert text == said.choices[0].message.content


def test_a_seed_repeats_a_sampled_answer(server):
    client, _, _ = server
    ask = lambda seed: client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0.9,
                                                 top_p=0.95, seed=seed).choices[0].text  # fmt: skip
    assert ask(11) == ask(11) != ask(12)


def test_bad_requests_get_openai_errors_and_the_server_goes_on(server):
    client, _, _ = server
    with pytest.raises(openai.NotFoundError) as wrong:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=4)
    assert "no-such-model" in wrong.value.body["message"]
    with pytest.raises(openai.BadRequestError) as negative:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=-1)
    assert "max_tokens" in negative.value.body["message"]
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=4000)
    assert long.value.body["code"] == "context_length_exceeded"
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=3).usage.completion_tokens == 3


def test_a_short_request_ends_long_before_a_long_one(server):
    """A prompt plus 1536 new tokens fits the model's 2048 positions; a 4-token request sent while it runs
    ends before it: requests join and leave the batch as they come."""
    client, _, _ = server
    events = {}

    def long():
        stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=1536, temperature=0,
                                           stream=True, stream_options={"include_usage": True})  # fmt: skip
        for chunk in stream:
            events.setdefault("long started", time.perf_counter())
            if chunk.usage is not None:
                events["long usage"] = chunk.usage
        events["long ended"] = time.perf_counter()

    thread = threading.Thread(target=long)
    thread.start()
    while "long started" not in events:
        time.sleep(0.01)
    short = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0)
    events["short ended"] = time.perf_counter()
    thread.join()
    assert short.usage.completion_tokens == 4
    assert events["short ended"] < events["long ended"]
    assert events["long usage"].completion_tokens <= 1536  # 1536, unless the model says EOS first
    assert events["long usage"].prompt_tokens + 1536 <= 2048


def test_a_lora_adapter_and_config_overrides_are_served(world, tmp_path):
    """--lora_adapter: the adapter merged, greedy answers as PEFT's model gives them; --config_overrides
    reaches the model (its positions, which --max_model_len may not exceed)."""
    root, _, tok = world
    base = transformers.LlamaForCausalLM.from_pretrained(root / "model")
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the adapters only (B starts at 0): the base stays as saved
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
    adapted.save_pretrained(tmp_path / "adapter")
    argv = ["--model_name_or_path", root / "model", "--lora_adapter", tmp_path / "adapter", "--config_overrides",
            "max_position_embeddings=64", "--max_batch_size", 2]  # fmt: skip

    def served(*flags):
        source, cfg, runtime, _ = parse(serve.__doc__, serve.SECTIONS, [str(a) for a in (*argv, *flags)])
        return serve.service(source, cfg, runtime, None)

    with pytest.raises(JaxseqError, match="max_len 100 exceeds the model's 64 positions"):
        served("--max_model_len", 100)
    served = served("--max_model_len", 48)
    assert served.engine.max_len == 48 and served.name == str(root / "model")
    request = served.engine.generate([tok(PROMPTS[0])["input_ids"]], SamplingParams(max_tokens=8, temperature=0))
    adapted.eval()
    ids = torch.tensor([tok(PROMPTS[0])["input_ids"]])
    with torch.no_grad():
        want = adapted.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                pad_token_id=0)[0, ids.shape[1] :].tolist()  # fmt: skip
    assert request[0].tokens == want


def peft_adapter(base_folder, folder, seed: int, **config):
    """A PEFT LoRA adapter of the model in ``base_folder`` with random (nonzero) weights, saved in ``folder``;
    PEFT's model with it."""
    base = transformers.LlamaForCausalLM.from_pretrained(base_folder)
    adapted = peft.get_peft_model(base, peft.LoraConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the adapters only (B starts at 0): the base stays as saved
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
    adapted.save_pretrained(folder)
    return adapted.eval()


def test_lora_modules_are_served_by_name_beside_the_model(world, tmp_path):
    """--lora_modules a=DIR b=DIR: /v1/models lists both beside the model; a request naming one is answered with
    its adapter (greedy, as PEFT's model with it answers), the model's name gets the model alone, and an unknown
    name a 404; the adapters' engines share the model's weights."""
    from fastapi.testclient import TestClient

    from jaxseq.server import create_app

    root, model, tok = world
    adapters = {
        "a": peft_adapter(root / "model", tmp_path / "a", 3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "b": peft_adapter(root / "model", tmp_path / "b", 4, r=2, lora_alpha=4, target_modules=["o_proj", "up_proj"]),
    }
    argv = ["--model_name_or_path", root / "model", "--served_model_name", "tiny", "--max_batch_size", 2,
            "--max_model_len", 48, "--lora_modules", f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"]  # fmt: skip
    source, cfg, runtime, _ = parse(serve.__doc__, serve.SECTIONS, [str(a) for a in argv])
    served = serve.service(source, cfg, runtime, None)
    embedding = lambda engine: engine.state["model"]["embed_tokens"]["embedding"].get_value()
    assert all(embedding(e) is embedding(served.engine) for e in served.adapters.values())
    ids = tok(PROMPTS[1])["input_ids"]
    with TestClient(create_app(served)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        cards = client.models.list().data
        assert [c.id for c in cards] == ["tiny", "a", "b"] and cards[1].parent == "tiny"
        for name, reference in [("tiny", model), *adapters.items()]:
            answer = client.completions.create(model=name, prompt=ids, max_tokens=8, temperature=0)
            assert answer.model == name
            assert answer.choices[0].text == tok.decode(greedy(reference, ids, 8), skip_special_tokens=True)
        with pytest.raises(openai.NotFoundError, match="`c` does not exist"):
            client.completions.create(model="c", prompt="Hi", max_tokens=2)
    with pytest.raises(JaxseqError, match="NAME=PATH pairs"):
        parse(serve.__doc__, serve.SECTIONS, ["--model_name_or_path", "x", "--lora_modules", "a"])
