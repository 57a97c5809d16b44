"""Serve a causal language model over HTTP with OpenAI's API, batching requests continuously.

    jaxseq serve --model_name_or_path out/chat --port 8000 --max_batch_size 16

Endpoints, as OpenAI's (and vLLM's) API has them: GET /v1/models; POST /v1/completions (a prompt, prompts or
token ids); POST /v1/chat/completions (messages rendered by the tokenizer's chat template, or --chat_template,
with the request's tools). Each takes max_tokens (chat: max_completion_tokens too; default 16 for a
completion, the rest of the context for a chat answer), temperature (0: greedy), top_p, stop (up to 4
strings), seed, n and stream (server-sent events; stream_options.include_usage), and answers with usage
counts. Requests must name the served model (--served_model_name, default --model_name_or_path as given) or
one of the LoRA adapters of --lora_modules, served beside it by name (as vLLM's --lora-modules). A
bad request gets a 4xx and {"error": {"message": ...}}; the server keeps serving. Requests share
--max_batch_size slots of one key/value cache of --max_model_len positions (default: the model's, at most
4096): a request joins as soon as a slot is free and leaves when it ends, whatever the others do. The server
is ready (GET /v1/models answers) once every program is compiled. Any OpenAI client talks to it:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="out/chat", messages=[{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxseq.cli import RuntimeConfig, parse, script, start
from jaxseq.config import arg
from jaxseq.data.chat import use_chat_template
from jaxseq.distributed import DistributedConfig
from jaxseq.engine import Engine
from jaxseq.errors import JaxseqError
from jaxseq.models.hub import load_config, load_pretrained, parse_overrides, resolve
from jaxseq.models.registry import families_with
from jaxseq.models.source import PretrainedModel, check_vocabulary, load_tokenizer
from jaxseq.server import Service, create_app
from jaxseq.train.lora import ADAPTER_HELP, adapted_model, merge_adapter


@dataclasses.dataclass
class ServeConfig:
    served_model_name: str | None = arg(None, "the model's name in the API (default: --model_name_or_path as given)")
    host: str = arg("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = arg(8000, "port to listen on")
    max_batch_size: int = arg(16, "requests decoded together (slots of the key/value cache)")
    max_model_len: int | None = arg(None, "positions per slot, prompt and completion (default: the model's, <= 4096)")
    chat_template: str | None = arg(
        None, "a Jinja chat template, or a file holding one, for a tokenizer without its own"
    )
    lora_adapter: str | None = arg(None, f"{ADAPTER_HELP}: merged into the weights before serving")
    lora_modules: list[str] | None = arg(
        None,
        "LoRA adapters served by name beside the model, NAME=PATH each (PATH a PEFT adapter's folder; several: "
        "--lora_modules a=dir1 b=dir2): a request's model picks one; each has --max_batch_size slots of its "
        "own and shares the model's weights, its adapter computed beside them",
    )

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise JaxseqError(f"--max_batch_size must be at least 1, got {self.max_batch_size}")
        if not 0 < self.port < 65536:
            raise JaxseqError(f"--port must be from 1 to 65535, got {self.port}")
        self.adapters  # noqa: B018 (checks the NAME=PATH pairs)

    @property
    def adapters(self) -> dict[str, str]:
        """--lora_modules' adapter folders by name."""
        out = {}
        for pair in self.lora_modules or []:
            name, _, path = pair.partition("=")
            if not name or not path:
                raise JaxseqError(f"--lora_modules takes NAME=PATH pairs, got {pair!r}")
            if name in out:
                raise JaxseqError(f"--lora_modules names {name!r} twice; give each adapter its own name")
            out[name] = path
        return out


SECTIONS = (PretrainedModel, ServeConfig, RuntimeConfig, DistributedConfig)


def service(source: PretrainedModel, cfg: ServeConfig, runtime: RuntimeConfig, mesh) -> Service:
    """The model, its tokenizer and an engine of ``cfg``'s slots, compiled."""
    if not source.model_name_or_path:
        raise JaxseqError("pass --model_name_or_path (a Hub id or a local model folder)")
    folder = resolve(source.model_name_or_path)
    config = load_config(folder)
    if config.model_type not in families_with("causal-lm"):
        raise JaxseqError(f"{config.model_type} models are not causal language models; serve one of "
                          f"{', '.join(families_with('causal-lm'))}")  # fmt: skip
    tokenizer = load_tokenizer(source.tokenizer_name or folder)
    if cfg.chat_template:
        use_chat_template(tokenizer, cfg.chat_template)
    overrides = parse_overrides(source.config_overrides, config)
    model = load_pretrained(folder, "causal-lm", mesh=mesh, dtype=jnp.dtype(runtime.dtype), **overrides)
    if cfg.lora_adapter:
        merge_adapter(model, cfg.lora_adapter)
    check_vocabulary(tokenizer, model.config)
    name = cfg.served_model_name or source.model_name_or_path
    if name in cfg.adapters:
        raise JaxseqError(f"--lora_modules names an adapter {name!r}, the model's own name; rename the adapter")
    engines = {}
    for served, model_ in [(name, model), *((n, adapter(model, n, path)) for n, path in cfg.adapters.items())]:
        engines[served] = Engine(model_, tokenizer, max_batch_size=cfg.max_batch_size, max_len=cfg.max_model_len)
        print(f"compiling {served} for {cfg.max_batch_size} slots of {engines[served].max_len} positions ...",
              flush=True)  # fmt: skip
        engines[served].warm_up()
    return Service(engines.pop(name), tokenizer, name, adapters=engines)


def adapter(model, name: str, folder: str):
    """``model`` with the PEFT adapter in ``folder`` beside its weights, or a one-line error naming it."""
    try:
        return adapted_model(model, folder)
    except JaxseqError as e:
        raise JaxseqError(f"--lora_modules {name}={folder}: {e}") from None


@script
def main(argv) -> int:
    import uvicorn

    source, cfg, runtime, distributed = parse(__doc__, SECTIONS, argv)
    mesh = start(runtime, distributed)
    served = service(source, cfg, runtime, mesh)
    print(f"serving {served.name} on http://{cfg.host}:{cfg.port}/v1", flush=True)
    uvicorn.run(create_app(served), host=cfg.host, port=cfg.port, log_level="info")
    return 0
