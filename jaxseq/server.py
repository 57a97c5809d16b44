"""OpenAI's HTTP API over ``jaxseq.engine``: ``GET /v1/models``, ``POST /v1/completions`` and ``POST
/v1/chat/completions`` (the tokenizer's chat template, ``tools`` passed to it), whole or streamed as
server-sent events, with ``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``n`` and usage
counts; a bad request gets a 4xx and OpenAI's ``{"error": {...}}`` while the server goes on serving. A
request's ``model`` names the base model or one of the LoRA adapters served beside it, each an engine of its
own over the base's weights. The engines run on a thread of their own (``EngineThread``); requests reach it
through a queue, and each one's tokens come back to its handler as they are made."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from jaxseq.engine import Engine, Request, SamplingParams
from jaxseq.errors import JaxseqError

Update = tuple[list[int], str, str | None]
"""What a request's handler hears after each step: its tokens, its text, its finish reason (None: running)."""


class EngineThread:
    """``engines`` (by model name) stepping in turn on a thread of their own while they have work; ``submit``
    (from any thread) queues a request for one of them and the function it reports to (``Update``s, from the
    engines' thread)."""

    def __init__(self, engines: dict[str, Engine]):
        self.engines = engines
        self.inbox: queue.Queue = queue.Queue()
        self.listeners: dict[tuple[str, int], Callable[[Update], None]] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="jaxseq-engine")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.inbox.put(None)
        self.thread.join()

    def submit(
        self, model: str, prompt_ids: Sequence[int], params: SamplingParams, listener: Callable[[Update], None]
    ) -> None:
        self.inbox.put((model, list(prompt_ids), params, listener))

    @property
    def busy(self) -> bool:
        return any(engine.busy for engine in self.engines.values())

    def _take(self, block: bool) -> bool:
        """Move queued requests into the engine (waiting for one if ``block``); False once stopping."""
        try:
            item = self.inbox.get(block=block)
        except queue.Empty:
            return True
        while item is not None:
            model, prompt_ids, params, listener = item
            try:
                request = self.engines[model].add(prompt_ids, params)
            except JaxseqError as e:  # checked by the handler first; a race would end here
                listener(([], str(e), "error"))
            else:
                self.listeners[model, request.id] = listener
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _run(self) -> None:
        while not self.stopping.is_set():
            if not self._take(block=not self.busy):
                return
            for model, engine in self.engines.items():
                if engine.busy:
                    self._step(model, engine)

    def _step(self, model: str, engine: Engine) -> None:
        try:
            changed = engine.step()
        except Exception as e:  # its requests in flight end with a server error; the thread serves on
            for key in [k for k in self.listeners if k[0] == model]:
                self.listeners.pop(key)(([], f"the engine failed: {type(e).__name__}: {e}", "failed"))
            engine.running.clear()
            engine.waiting.clear()
            return
        for request in changed:
            self._report(model, request)

    def _report(self, model: str, request: Request) -> None:
        listener = self.listeners.get((model, request.id))
        if listener is not None:
            listener((list(request.tokens), request.text, request.finish_reason))
            if request.finished:
                del self.listeners[model, request.id]


class BadRequest(Exception):
    """A request the API refuses: its HTTP ``status`` and OpenAI's error fields."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def sampling(body: dict, max_len: int, prompt_tokens: int, *, chat: bool) -> SamplingParams:
    """The request's ``SamplingParams``, OpenAI's defaults (a completion: 16 tokens; a chat answer: up to the
    context's end), or a ``BadRequest`` naming the field."""
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = max_len - prompt_tokens if chat else 16
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest(f"{key} must be a positive integer, got {max_tokens!r}", param=key)
    if prompt_tokens + max_tokens > max_len:
        raise BadRequest(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion). "
            "Please reduce the prompt or the completion's length.",
            param=key,
            code="context_length_exceeded",
        )
    temperature = body.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if not isinstance(temperature, int | float) or not 0 <= temperature <= 2:
        raise BadRequest(f"temperature must be between 0 and 2, got {temperature!r}", param="temperature")
    top_p = body.get("top_p", 1.0)
    top_p = 1.0 if top_p is None else top_p
    if not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p!r}", param="top_p")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise BadRequest("stop must be a string or a list of at most 4 strings", param="stop")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest(f"seed must be an integer, got {seed!r}", param="seed")
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), seed=seed,
                          stop=tuple(stop))  # fmt: skip


def choices_of(body: dict) -> int:
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128:
        raise BadRequest(f"n must be an integer from 1 to 128, got {n!r}", param="n")
    return n


class Service:
    """What the endpoints serve: the model ``name``d by ``engine``, ``adapters`` (LoRA adapters' engines by
    name, over the same weights), all on one ``EngineThread``, and their ``tokenizer``. A request names one."""

    def __init__(self, engine: Engine, tokenizer, name: str, adapters: dict[str, Engine] | None = None):
        self.engine, self.tokenizer, self.name = engine, tokenizer, name
        self.adapters = dict(adapters or {})
        self.runner = EngineThread({name: engine, **self.adapters})
        self.created = int(time.time())

    def check_model(self, body: dict) -> str:
        """The model the request names, one this server serves."""
        model = body.get("model")
        if model not in self.runner.engines:
            served = ", ".join(f"`{m}`" for m in self.runner.engines)
            raise BadRequest(f"The model `{model}` does not exist; this server serves {served}", status=404,
                             param="model", code="model_not_found")  # fmt: skip
        return model

    def completion_prompts(self, body: dict) -> list[list[int]]:
        """The prompts of a completions request: a string, a list of strings, token ids, or lists of them."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest("prompt must be a string, a list of strings or a list of token ids", param="prompt")
        out = []
        for p in prompt:
            ids = self.tokenizer(p)["input_ids"] if isinstance(p, str) else p
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise BadRequest("each prompt must be non-empty text or a non-empty list of token ids", param="prompt")
            out.append(list(ids))
        return out

    def chat_prompt(self, body: dict) -> list[int]:
        """The conversation rendered by the chat template, the generation prompt added (``tools`` given)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages must be a non-empty list of {role, content} objects", param="messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest("this model's tokenizer has no chat template; use /v1/completions", param="messages")
        tools = body.get("tools") or None
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
            )
        except Exception as e:  # a template's own error (a role it does not know, ...) is the request's fault
            raise BadRequest(f"the chat template cannot render these messages: {e}", param="messages") from None
        return list(rendered["input_ids"])

    async def run(self, model: str, prompt_ids: list[int], params: SamplingParams):
        """``Update``s of one request to ``model``, as its engine makes them."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        self.runner.submit(model, prompt_ids, params, lambda u: loop.call_soon_threadsafe(updates.put_nowait, u))
        while True:
            update = await updates.get()
            if update[2] == "error":
                raise BadRequest(update[1])
            if update[2] == "failed":
                raise BadRequest(update[1], status=500)
            yield update
            if update[2] is not None:
                return

    async def finished(self, model: str, prompt_ids: list[int], params: SamplingParams) -> Update:
        last = None
        async for update in self.run(model, prompt_ids, params):
            last = update
        return last


def seeded(params: SamplingParams, i: int) -> SamplingParams:
    """The ``i``-th of ``n`` choices: its own seed where the request gave one."""
    if params.seed is None or i == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + i)


def create_app(service: Service):
    """The FastAPI application of ``service``: its engine thread starts and stops with the app."""

    @asynccontextmanager
    async def lifespan(_app):
        service.runner.start()
        try:
            yield
        finally:
            service.runner.stop()

    app = FastAPI(title="jaxseq", lifespan=lifespan)

    @app.exception_handler(BadRequest)
    async def refused(_request, error: BadRequest):
        return JSONResponse(error.body(), status_code=error.status)

    async def read(request: HTTPRequest) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    @app.get("/v1/models")
    async def models():
        card = {"id": service.name, "object": "model", "created": service.created, "owned_by": "jaxseq",
                "max_model_len": service.engine.max_len}  # fmt: skip
        adapters = [{**card, "id": name, "parent": service.name} for name in service.adapters]
        return {"object": "list", "data": [card, *adapters]}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await read(request)
        model = service.check_model(body)
        prompts, n = service.completion_prompts(body), choices_of(body)
        params = [sampling(body, service.engine.max_len, len(p), chat=False) for p in prompts]
        jobs = [(p, seeded(q, i)) for p, q in zip(prompts, params) for i in range(n)]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model}  # fmt: skip
        if body.get("stream"):
            return stream(service, model, jobs, head, chat=False, usage=_include_usage(body))
        done = await asyncio.gather(*(service.finished(model, p, q) for p, q in jobs))
        choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                   for i, (_, text, reason) in enumerate(done)]  # fmt: skip
        return {**head, "choices": choices, "usage": usage_of(jobs, done)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = await read(request)
        model = service.check_model(body)
        prompt, n = service.chat_prompt(body), choices_of(body)
        params = sampling(body, service.engine.max_len, len(prompt), chat=True)
        jobs = [(prompt, seeded(params, i)) for i in range(n)]
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model}  # fmt: skip
        if body.get("stream"):
            return stream(service, model, jobs, {**head, "object": "chat.completion.chunk"}, chat=True,
                          usage=_include_usage(body))  # fmt: skip
        done = await asyncio.gather(*(service.finished(model, p, q) for p, q in jobs))
        choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": reason} for i, (_, text, reason) in enumerate(done)]  # fmt: skip
        return {**head, "choices": choices, "usage": usage_of(jobs, done)}

    def stream(service: Service, model: str, jobs, head: dict, *, chat: bool, usage: bool):
        """Server-sent events: each choice's new text as it comes, its finish reason, then ``[DONE]``."""

        async def events():
            merged: asyncio.Queue = asyncio.Queue()

            async def follow(index: int, prompt, params):
                sent = 0
                held = max((len(s) for s in params.stop), default=1) - 1  # a stop string may be starting
                if chat:
                    await merged.put((index, {"role": "assistant", "content": ""}, None, None))
                async for tokens, text, reason in service.run(model, prompt, params):
                    upto = len(text) if reason is not None else max(sent, len(text) - held)
                    if reason is None and text[sent:upto].endswith("\ufffd"):  # half a character so far
                        continue
                    if upto > sent or reason is not None:
                        await merged.put((index, text[sent:upto], reason, tokens))
                        sent = upto
                await merged.put((index, None, "end", None))

            tasks = [asyncio.create_task(follow(i, p, q)) for i, (p, q) in enumerate(jobs)]
            live, finals = len(tasks), [None] * len(tasks)
            try:
                while live:
                    index, piece, reason, tokens = await merged.get()
                    if reason == "end":
                        live -= 1
                        continue
                    if tokens is not None and reason is not None:
                        finals[index] = tokens
                    if chat:
                        delta = piece if isinstance(piece, dict) else ({"content": piece} if piece else {})
                        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
                    else:
                        choice = {"index": index, "text": piece, "logprobs": None, "finish_reason": reason}
                    yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
                if usage:
                    done = [([], "", None) if t is None else (t, "", None) for t in finals]
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage_of(jobs, done)})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                for task in tasks:
                    task.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, error: RequestValidationError):
        return JSONResponse(BadRequest(str(error)).body(), status_code=400)

    return app


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    return bool(isinstance(options, dict) and options.get("include_usage"))


def usage_of(jobs: Sequence[tuple[list[int], Any]], done: Sequence[Update]) -> dict:
    """OpenAI's usage counts: every choice's completion tokens; each distinct prompt's tokens once."""
    prompts = sum(len(p) for p in {tuple(p): p for p, _ in jobs}.values())
    completion = sum(len(tokens) for tokens, _, _ in done)
    return {"prompt_tokens": prompts, "completion_tokens": completion, "total_tokens": prompts + completion}
