"""Generate text with a Hugging Face {families} checkpoint in jaxseq (sharded over every device).

    jaxseq generate --model_name_or_path gpt2 --prompt "The meaning of life is" --max_new_tokens 32
    jaxseq generate --model_name_or_path out/model --prompt_file prompts.jsonl \\
        --output_file completions.jsonl --do_sample --temperature 0.8 --top_p 0.9 --mesh dp=2,mp=4
    jaxseq generate --model_name_or_path t5-small --prompt "translate English to German: Hello" --num_beams 4
    cat prompts.txt | jaxseq generate --model_name_or_path gpt2

Prompts come from --prompt (repeat it for several), --prompt_file (one prompt per line, or JSONL with a "prompt"
field) or stdin (one per line). A causal LM continues them by continuous batching (jaxseq.engine: --batch_size
slots; a prompt joins as soon as one is free, the samples of a prompt share its prefill); beam search and T5 run in
batches of --batch_size prompts of similar lengths. With --output_file each prompt becomes a JSONL record (prompt,
completion, prompt_tokens, completion_tokens; with --num_return_sequences N also completions: the N best beams, best
first, or N samples of the prompt, prefilled once); otherwise each prompt and its completion(s) are printed. Greedy
unless --do_sample or --num_beams (transformers' beam search); a completion ends at the tokenizer's EOS token or
after --max_new_tokens.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxseq.cli import RuntimeConfig, parse, script, start
from jaxseq.config import arg
from jaxseq.distributed import DistributedConfig
from jaxseq.engine import Engine, SamplingParams, bucket
from jaxseq.errors import JaxseqError
from jaxseq.generation import check_beams, check_sampling, generate
from jaxseq.models.hub import load_config, load_pretrained, parse_overrides, position_limit, resolve
from jaxseq.models.registry import families_with, family_for, family_names
from jaxseq.models.source import PretrainedModel, check_vocabulary, load_tokenizer
from jaxseq.sharding import gather
from jaxseq.train.lora import ADAPTER_HELP, merge_adapter

__doc__ = __doc__.format(families=family_names("causal-lm", "seq2seq-lm"))  # the families the registry lists


@dataclasses.dataclass
class GenerateConfig:
    prompt: list[str] | None = arg(None, "a prompt; repeat the flag for several")
    prompt_file: str | None = arg(None, "file of prompts: one per line, or JSONL (*.jsonl) with a 'prompt' field")
    batch_size: int = arg(
        8, "sequences decoded together: the engine's slots (beam search and T5: prompts a batch, similar lengths)"
    )
    max_new_tokens: int = arg(64, "tokens to generate at most per prompt")
    min_new_tokens: int = arg(0, "tokens to generate before EOS may end a completion")
    do_sample: bool = arg(False, "sample the next token instead of taking the most likely one")
    temperature: float = arg(1.0, "sampling temperature (lower is more deterministic)")
    top_k: int = arg(0, "sample among the k most likely tokens only (0 = all)")
    top_p: float = arg(1.0, "sample from the smallest set of tokens holding this probability mass (1 = all)")
    seed: int = arg(0, "random seed of the sampling; the same seed gives the same completions")
    num_beams: int = arg(1, "beam search with this many beams per prompt (1 = greedy or sampling)")
    length_penalty: float = arg(
        1.0, "beam search: a hypothesis scores its summed log-probabilities / its length ** this (> 0 favours longer)"
    )
    early_stopping: str = arg(
        "false",
        "beam search: true (stop a prompt once it has --num_beams finished hypotheses), false (once no running "
        "beam can beat them at its current length), never (judged at --max_new_tokens for a positive "
        "--length_penalty); a bare --early_stopping is true",
        choices=("false", "true", "never"),
        const="true",
    )
    num_return_sequences: int = arg(
        1, "completions returned per prompt: beam search's best first (<= --num_beams), or with --do_sample samples"
    )
    output_file: str | None = arg(None, "write JSONL records here instead of printing the completions")
    lora_adapter: str | None = arg(None, f"{ADAPTER_HELP}: merged into the weights before generating")


SECTIONS = (PretrainedModel, GenerateConfig, RuntimeConfig, DistributedConfig)


def read_prompts(cfg: GenerateConfig, stdin=None) -> list[str]:
    """The prompts of --prompt, --prompt_file or stdin, in order; an empty one is an error."""
    stdin = sys.stdin if stdin is None else stdin
    if cfg.prompt and cfg.prompt_file:
        raise JaxseqError("pass either --prompt or --prompt_file, not both")
    if cfg.prompt:
        prompts = [(f"--prompt #{i + 1}", p) for i, p in enumerate(cfg.prompt)]
    elif cfg.prompt_file:
        path = Path(cfg.prompt_file)
        if not path.is_file():
            raise JaxseqError(f"prompt file {path} does not exist")
        lines = path.read_text().splitlines()
        if path.suffix == ".jsonl":
            prompts = [
                (f"line {i + 1} of {path}", jsonl_prompt(line, i, path)) for i, line in enumerate(lines) if line.strip()
            ]
        else:
            prompts = [(f"line {i + 1} of {path}", line) for i, line in enumerate(lines)]
    elif not stdin.isatty():
        prompts = [(f"line {i + 1} of stdin", line) for i, line in enumerate(stdin.read().splitlines())]
    else:
        raise JaxseqError("no prompts: pass --prompt TEXT, --prompt_file FILE, or pipe prompts on stdin")
    if not prompts:
        raise JaxseqError("no prompts: the prompt file or stdin is empty")
    for where, text in prompts:
        if not text.strip():
            raise JaxseqError(f"the prompt at {where} is empty; every prompt needs some text")
    return [text for _, text in prompts]


def jsonl_prompt(line: str, index: int, path: Path) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise JaxseqError(f"line {index + 1} of {path} is not valid JSON: {e.msg}") from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise JaxseqError(f"line {index + 1} of {path} has no string 'prompt' field")
    return record["prompt"]


def batches(lengths: list[int], size: int) -> list[list[int]]:
    """Prompt indices in batches of ``size``, shortest prompts first, so a batch pads little."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + size] for i in range(0, len(order), size)]


def completion_length(tokens, eos: int | None) -> int:
    """Tokens of a completion up to and including its EOS (all of them if it never ends)."""
    tokens = list(tokens)
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)


@script
def main(argv) -> int:
    source, cfg, runtime, distributed = parse(__doc__, SECTIONS, argv)
    if not source.model_name_or_path:
        raise JaxseqError("pass --model_name_or_path (a Hub id such as gpt2, or a local model folder)")
    if cfg.batch_size < 1:
        raise JaxseqError(f"--batch_size must be at least 1, got {cfg.batch_size}")
    early_stopping = {"true": True, "false": False}.get(cfg.early_stopping, cfg.early_stopping)
    check_beams(cfg.num_beams, cfg.num_return_sequences, early_stopping, cfg.do_sample)
    check_sampling(cfg.max_new_tokens, cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_new_tokens)
    prompts = read_prompts(cfg)

    mesh = start(runtime, distributed)  # a multi-host run: every process reads the same prompts, process 0 writes
    folder = resolve(source.model_name_or_path)
    config = load_config(folder)
    family_for(config.model_type)  # one that jaxseq has
    task = next((t for t in ("causal-lm", "seq2seq-lm") if config.model_type in families_with(t)), None)
    if task is None:
        raise JaxseqError(
            f"{config.model_type} models cannot generate text; "
            f"use a {family_names('causal-lm', 'seq2seq-lm')} checkpoint"
        )
    overrides = parse_overrides(source.config_overrides, config)
    tokenizer = load_tokenizer(source.tokenizer_name or folder, fast=False)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    limit = position_limit(config) if task == "causal-lm" else None
    for i, ids in enumerate(encoded):
        if not ids:
            raise JaxseqError(f"prompt {i + 1} has no tokens after tokenization")
        if limit and len(ids) + cfg.max_new_tokens > limit:
            raise JaxseqError(
                f"prompt {i + 1} has {len(ids)} token(s); with --max_new_tokens {cfg.max_new_tokens} that exceeds "
                f"the model's {limit} positions; shorten the prompt or lower --max_new_tokens"
            )
    model = load_pretrained(folder, task, mesh=mesh, dtype=jnp.dtype(runtime.dtype), **overrides)
    if cfg.lora_adapter:
        merge_adapter(model, cfg.lora_adapter)
    check_vocabulary(tokenizer, model.config)

    started = time.perf_counter()
    bar = tqdm(total=len(prompts), desc="generating", unit="prompt", file=sys.stderr, dynamic_ncols=True,
               disable=jax.process_index() != 0)  # fmt: skip
    if task == "causal-lm" and cfg.num_beams == 1:
        texts, lengths = continued(model, tokenizer, encoded, cfg, eos, bar)
    else:
        texts, lengths = in_batches(model, tokenizer, encoded, cfg, eos, pad, early_stopping, bar)
    completions = []
    for prompt, ids, text, length in zip(prompts, encoded, texts, lengths):
        record = {"prompt": prompt, "completion": text[0], "prompt_tokens": len(ids), "completion_tokens": length[0]}
        completions.append({**record, "completions": text} if cfg.num_return_sequences > 1 else record)
    generated = sum(map(sum, lengths))
    bar.close()
    seconds = time.perf_counter() - started

    if jax.process_index() != 0:
        return 0
    if cfg.output_file:
        path = Path(cfg.output_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in completions))
    else:
        print("\n\n".join(c["prompt"] + text for c in completions for text in c.get("completions", [c["completion"]])))
    print(
        f"{len(prompts)} prompts, {generated} tokens generated in {seconds:.1f}s (compilation included)",
        file=sys.stderr,
    )
    return 0


def continued(model, tokenizer, encoded, cfg: GenerateConfig, eos, bar):
    """Each prompt's completions' texts and token counts, by the engine: every prompt queued, --batch_size of
    them decoded at a time; sample ``j`` of prompt ``i`` draws with a seed of --seed, ``i`` and ``j``."""
    samples = cfg.num_return_sequences if cfg.do_sample else 1
    limit = position_limit(model.config)
    widest = bucket(max(map(len, encoded)), 1 << 62)  # the engine pads a prompt to a power of two
    engine = Engine(model, tokenizer, max_batch_size=cfg.batch_size,
                    max_len=min(widest + cfg.max_new_tokens, limit or 1 << 62),
                    eos_token_ids=[] if eos is None else [eos], top_k=cfg.top_k if cfg.do_sample else 0)  # fmt: skip
    params = SamplingParams(
        max_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature if cfg.do_sample else 0.0,
        top_p=cfg.top_p if cfg.do_sample else 1.0,
        min_tokens=cfg.min_new_tokens,
    )
    seed = lambda i, j: int(np.random.SeedSequence([cfg.seed, i, j]).generate_state(1)[0])
    requests = [[engine.add(ids, dataclasses.replace(params, seed=seed(i, j))) for j in range(samples)]
                for i, ids in enumerate(encoded)]  # fmt: skip
    left = {id(r): i for i, group in enumerate(requests) for r in group}
    unfinished, made, started = [samples] * len(requests), 0, time.perf_counter()
    while engine.busy:
        for request in engine.step():
            if request.finished and id(request) in left:
                i = left.pop(id(request))
                unfinished[i] -= 1
                bar.update(unfinished[i] == 0)  # a prompt whose samples all ended
                made += len(request.tokens)
        bar.set_postfix_str(f"{made / (time.perf_counter() - started):.0f} tokens/s", refresh=False)
    return [[r.text for r in group] for group in requests], [[len(r.tokens) for r in group] for group in requests]


def in_batches(model, tokenizer, encoded, cfg: GenerateConfig, eos, pad, early_stopping, bar):
    """Each prompt's completions' texts and token counts (beam search's best first), by ``generate`` on batches
    of --batch_size prompts of similar lengths."""
    texts, lengths = [None] * len(encoded), [None] * len(encoded)
    started, made = time.perf_counter(), 0
    for k, batch in enumerate(batches([len(ids) for ids in encoded], cfg.batch_size)):
        rows = [encoded[i] for i in batch]
        rows += [rows[-1]] * (cfg.batch_size - len(rows))  # a full batch reuses the compiled program
        width = max(map(len, rows))
        ids = np.array([[pad or 0] * (width - len(r)) + r for r in rows], np.int32)
        mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], np.int32)
        out = generate(
            model,
            ids,
            mask,
            max_new_tokens=cfg.max_new_tokens,
            min_new_tokens=cfg.min_new_tokens,
            do_sample=cfg.do_sample,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            eos_token_id=eos,
            pad_token_id=pad,
            seed=int(np.random.SeedSequence([cfg.seed, k]).generate_state(1)[0]),  # each batch its own draws
            num_beams=cfg.num_beams,
            length_penalty=cfg.length_penalty,
            early_stopping=early_stopping,
            num_return_sequences=cfg.num_return_sequences,
        )
        returned = gather(out.sequences).reshape(cfg.batch_size, cfg.num_return_sequences, -1)
        for i, sequences in zip(batch, returned):
            lengths[i] = [completion_length(tokens, eos) for tokens in sequences]
            texts[i] = [tokenizer.decode(t[:n], skip_special_tokens=True) for t, n in zip(sequences, lengths[i])]
            made += sum(lengths[i])
        bar.update(len(batch))  # after the batch's tokens came back: finished prompts
        bar.set_postfix_str(f"{made / (time.perf_counter() - started):.0f} tokens/s")
    return texts, lengths
