"""Align a causal language model with preference pairs: DPO and its variants, as TRL's DPOTrainer.

    jaxseq dpo --model_name_or_path path/to/sft-model --train_file pairs.jsonl \\
        --output_dir out/dpo --beta 0.1 --loss_type sigmoid --learning_rate 1e-6

Pairs come from .jsonl/.json files or a Hub dataset: records of "prompt", "chosen" and "rejected", as strings
or as conversations (lists of {"role", "content"}, rendered with the tokenizer's chat template or
--chat_template); without "prompt", the common start of chosen and rejected is the prompt. They are tokenised
as TRL tokenises them (EOS after string completions; --max_length, --truncation_mode). The reference model is
a frozen copy of the starting weights, or with --lora_rank the base weights with the adapters off (no second
copy), or its log-probs computed once before training (--precompute_ref_log_probs); --loss_type simpo and orpo
need none (TRL's CPOTrainer and ORPOTrainer). Each step runs chosen and rejected in one forward pass. Logged
as TRL logs them: loss, rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected (metrics.jsonl prefixes train/ and eval/).
Writes to --output_dir what every job writes, and the model with its tokenizer as a Hugging Face folder.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxseq.cli import script
from jaxseq.data.chat import use_chat_template
from jaxseq.data.preference import PreferenceDataConfig, load_pair_rows
from jaxseq.errors import JaxseqError
from jaxseq.harness import EvalTasksConfig
from jaxseq.models.source import ModelSource
from jaxseq.runner import Job, Prepared, Setup, run
from jaxseq.train.preference import DPOConfig

TASK = "causal-lm"
ROW = ("input_ids", "pair_mask", "completion_mask")


def prepare(setup: Setup) -> Prepared:
    """Pairs tokenised as TRL does into ``[2, length]`` rows (a plan reads none: its rows are --max_length)."""
    args, data, dpo = setup.args, setup.args.data, setup.args.dpo
    objective = dpo.objective()
    extra = {"ref_logps": ((2,), np.float32)} if objective.precomputes_reference else {}
    if setup.planning:
        seq = data.max_length or 1024
        return Prepared(objective, seq_len=seq, row={**dict.fromkeys(ROW, ((2, seq), np.int32)), **extra})
    tokenizer = setup.tokenizer
    if data.chat_template or getattr(tokenizer, "chat_template", None):
        use_chat_template(tokenizer, data.chat_template)
    main_process = jax.process_index() == 0
    do_train, do_eval, _ = args.stages.stages()
    train, valid = load_pair_rows(
        data,
        tokenizer,
        progress=main_process,
        log=print if main_process else (lambda *_: None),
        train=do_train,
        evaluate=do_eval,
    )
    if args.stages.do_eval and valid is None:
        raise JaxseqError(
            "--do_eval needs validation pairs: pass --validation_file, a --dataset_name with a validation or test "
            "split, or --validation_split_percentage"
        )
    seq = (valid if train is None else train)["input_ids"].shape[-1]
    pairs = 0 if train is None else len(train["input_ids"])
    return Prepared(
        objective,
        train=train,
        evals={"": valid} if valid is not None else {},
        seq_len=seq,
        summary=lambda _: (
            f"{pairs:,} training pairs of at most {seq} tokens a sequence, loss {dpo.loss_type} with beta "
            f"{dpo.beta}; reference: "
            + (
                "precomputed log-probs"
                if objective.precomputes_reference
                else "the starting weights, frozen"
                if objective.needs_reference
                else "none"
            )
        ),
    )


JOB = Job(
    __doc__,
    TASK,
    {"source": ModelSource, "data": PreferenceDataConfig, "dpo": DPOConfig, "eval_tasks": EvalTasksConfig},
    prepare,
    default_stages="train, and evaluate where there are validation pairs (TRL's DPOTrainer with an eval_dataset)",
)


@script
def main(argv) -> int:
    return run(JOB, argv)
