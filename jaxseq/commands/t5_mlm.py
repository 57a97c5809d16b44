"""Pretrain a T5 model by span corruption with jaxseq (transformers' run_t5_mlm_flax.py).

    jaxseq t5-mlm --model_type t5 --config_overrides num_layers=6,d_model=512 --tokenizer_name my-t5-tokenizer \\
        --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 --max_seq_length 512 --output_dir out/t5

Text from local files (txt, jsonl, csv) or a Hub dataset is tokenized once (cached under ~/.cache/jaxseq/text),
joined with EOS between documents and cut into blocks of raw tokens, as many as make --max_seq_length input
tokens once corrupted (568 for 512). Each training step corrupts every block on the device, from the step's key
(a resumed run corrupts as an uninterrupted one): --mlm_probability of its tokens dropped in spans of
--mean_noise_span_length on average, each span replaced in the input by a sentinel from the top of the
vocabulary (<extra_id_0>, <extra_id_1>, ...), the target the sentinels and their spans; the validation blocks
are corrupted once. Writes to --output_dir: eval_results.json (eval_loss, perplexity), all_results.json,
metrics.jsonl, TensorBoard events, training_curves.png, the config used, orbax checkpoints, and the model with
its tokenizer as a Hugging Face folder.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxseq.cli import script
from jaxseq.config import arg
from jaxseq.data.spans import SpanCorruption, compute_input_and_target_lengths
from jaxseq.data.text import TextDataConfig, check_sources, count, load_blocks, token_dtype
from jaxseq.errors import JaxseqError
from jaxseq.models.source import ModelSource
from jaxseq.runner import Job, Prepared, Setup, run
from jaxseq.train.pretraining import SpanCorruptionLM

TASK = "seq2seq-lm"


@dataclasses.dataclass
class SpanDataConfig(TextDataConfig):
    block_size: int | None = arg(
        512, "input tokens per example once corrupted (each is cut from more raw tokens)", aliases=("max_seq_length",)
    )
    mlm_probability: float = arg(0.15, "share of the raw tokens dropped in spans (the noise density)")
    mean_noise_span_length: float = arg(3.0, "mean length of a dropped span, in tokens")


def sentinel_top(tokenizer) -> int:
    """One above the first sentinel: <extra_id_0>'s id + 1 (T5's tokenizers: its length), else the tokenizer's
    length, as run_t5_mlm_flax (a tokenizer built from a SentencePiece model may add its pad token after them)."""
    first = tokenizer.convert_tokens_to_ids("<extra_id_0>")
    return len(tokenizer) if first is None or first == tokenizer.unk_token_id else first + 1


def prepare(setup: Setup) -> Prepared:
    """Blocks of raw text, corrupted in the step (a plan reads none: its batches are raw blocks)."""
    args, data = setup.args, setup.args.data
    if not 0 < data.mlm_probability < 1:
        raise JaxseqError(f"--mlm_probability must be between 0 and 1, got {data.mlm_probability}")
    if data.mean_noise_span_length < 1:
        raise JaxseqError(f"--mean_noise_span_length must be at least 1, got {data.mean_noise_span_length}")
    if data.block_size is None or data.block_size < 2:
        raise JaxseqError(f"--max_seq_length must be at least 2, got {data.block_size}")
    tokenizer = setup.tokenizer
    if tokenizer.eos_token_id is None:
        raise JaxseqError("the tokenizer has no EOS token; pass a T5 tokenizer")
    raw, targets = compute_input_and_target_lengths(data.block_size, data.mlm_probability, data.mean_noise_span_length)
    corruption = SpanCorruption(
        raw, data.mlm_probability, data.mean_noise_span_length, sentinel_top(tokenizer), tokenizer.eos_token_id
    )
    if corruption.lengths != (data.block_size, targets):
        raise JaxseqError(
            f"--max_seq_length {data.block_size} with --mlm_probability {data.mlm_probability:g} and "
            f"--mean_noise_span_length {data.mean_noise_span_length:g} gives no whole span layout; change one"
        )
    spans, top = corruption.counts[1], corruption.vocab_size
    if top != len(tokenizer) and tokenizer.convert_tokens_to_ids(f"<extra_id_{spans - 1}>") != top - spans:
        raise JaxseqError(f"a block has {spans} spans but the tokenizer lacks <extra_id_0> .. <extra_id_{spans - 1}>")
    common = {
        "objective": SpanCorruptionLM(corruption),
        "seq_len": data.block_size,
        "target_len": targets,
    }
    line = f"span corruption: {raw} tokens -> {data.block_size} input + {targets} target"
    if setup.planning:
        print(line)
        return Prepared(**common, row={"input_ids": ((raw,), token_dtype(len(tokenizer)))})
    do_train, do_eval, _ = args.stages.stages()
    check_sources(data, train=do_train, evaluate=do_eval)
    main_process = jax.process_index() == 0
    log = print if main_process else (lambda *_: None)
    train, valid = load_blocks(data, tokenizer, raw, progress=main_process, log=log, train=do_train, evaluate=do_eval)
    return Prepared(
        **common,
        train=None if train is None else {"input_ids": train},
        evals={} if valid is None else {"": corruption.corrupt_examples(valid, args.trainer.seed)},
        summary=lambda _: f"{line}; {count(train):,} training / {count(valid):,} validation blocks",
        extra_eval=lambda results: {"perplexity": results["eval_perplexity"]},
    )


JOB = Job(__doc__, TASK, {"source": ModelSource, "data": SpanDataConfig}, prepare)


@script
def main(argv) -> int:
    return run(JOB, argv)
