"""Pretrain a {families} causal language model with jaxseq, from scratch or from a
checkpoint.

    jaxseq clm --model_name_or_path path/to/gpt2 --train_file corpus.txt --output_dir out/clm
    jaxseq clm --config_name gpt2 --config_overrides n_layer=6,n_embd=384,n_head=6 \\
        --tokenizer_name gpt2 --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 --block_size 256

Text from local files (txt, jsonl, csv) or a Hub dataset is tokenized once (cached under
~/.cache/jaxseq/text), joined with EOS between documents and cut into blocks of --block_size tokens.
Writes to --output_dir: eval_results.json (eval_loss, perplexity), all_results.json, metrics.jsonl
(training loss, tokens/s and model FLOPs utilisation), TensorBoard events, training_curves.png, the
config used, orbax checkpoints (a rerun resumes from the last one and ends bitwise where an uninterrupted
run would, even after a kill), and the model with its tokenizer as a Hugging Face folder.
"""

from __future__ import annotations

import jax

from jaxseq.cli import script
from jaxseq.data.text import TextDataConfig, check_sources, count, load_blocks, token_dtype
from jaxseq.harness import EvalTasksConfig
from jaxseq.models.registry import family_names
from jaxseq.models.source import ModelSource, sequence_length
from jaxseq.runner import Job, Prepared, Setup, run
from jaxseq.train.objectives import CausalLMConfig
from jaxseq.train.throughput import SpeedConfig

TASK = "causal-lm"
__doc__ = __doc__.format(families=family_names(TASK))


def prepare(setup: Setup) -> Prepared:
    """Text cut into blocks of --block_size tokens (a plan reads none: its batches are blocks)."""
    args, data, planning = setup.args, setup.args.data, setup.planning
    config = setup.config
    block_size = sequence_length(data.block_size, config, "block_size", 1024)
    common = {"objective": args.loss.objective(), "seq_len": block_size}
    tokenizer = setup.tokenizer if setup.tokenizer_name or not planning else None
    vocabulary = config.vocab_size if tokenizer is None else len(tokenizer)
    if planning:  # blocks of token ids, stored as the run stores them
        return Prepared(**common, row={"input_ids": ((block_size,), token_dtype(vocabulary))})
    do_train, do_eval, _ = args.stages.stages()
    check_sources(data, train=do_train, evaluate=do_eval)
    main_process = jax.process_index() == 0
    log = print if main_process else (lambda *_: None)
    train, valid = load_blocks(
        data, tokenizer, block_size, progress=main_process, log=log, train=do_train, evaluate=do_eval
    )
    return Prepared(
        **common,
        train=None if train is None else {"input_ids": train},
        evals={} if valid is None else {"": {"input_ids": valid}},
        summary=lambda _: f"{count(train):,} training / {count(valid):,} validation blocks of {block_size} tokens",
        extra_eval=lambda results: {"perplexity": results["eval_perplexity"]},  # run_clm's name for it
    )


JOB = Job(
    __doc__,
    TASK,
    {
        "source": ModelSource,
        "data": TextDataConfig,
        "speed": SpeedConfig,
        "loss": CausalLMConfig,
        "eval_tasks": EvalTasksConfig,
    },
    prepare,
)


@script
def main(argv) -> int:
    return run(JOB, argv)
