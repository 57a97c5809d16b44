"""Align a causal language model with unpaired feedback: KTO, as TRL's KTOTrainer.

    jaxseq kto --model_name_or_path path/to/sft-model --train_file feedback.jsonl \\
        --output_dir out/kto --beta 0.1 --desirable_weight 1.0 --undesirable_weight 1.33 --learning_rate 1e-6

Rows come from .jsonl/.json files or a Hub dataset: records of "prompt", "completion" and "label" (true: a
desirable completion, false: an undesirable one), as strings or as conversations (lists of {"role",
"content"}, rendered with the tokenizer's chat template or --chat_template); paired records ("chosen" and
"rejected") are unpaired as TRL unpairs them. They are tokenised as TRL tokenises them (EOS after string
completions; sequences cut to --max_length, rows whose prompt fills it left out). The loss (--loss_type kto)
pushes the policy's log-ratio against the reference up for desirable completions and down for undesirable
ones (weighted by --desirable_weight and --undesirable_weight), around the batch's KL estimate: each prompt
with the completion of the row before it among its device's rows (--per_device_train_batch_size of at least
2), as TRL pairs them; apo_zero_unpaired needs no KL. The reference model is a frozen copy of the starting
weights, or with --lora_rank the base weights with the adapters off (no second copy), or (apo_zero_unpaired)
its log-probs computed once before training (--precompute_ref_log_probs). Logged as TRL logs them: loss, kl,
entropy, logits/chosen, logits/rejected, rewards/chosen, logps/chosen, rewards/rejected, logps/rejected,
rewards/margins (metrics.jsonl prefixes train/ and eval/).
Writes to --output_dir what every job writes, and the model with its tokenizer as a Hugging Face folder.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxseq.cli import script
from jaxseq.data.chat import use_chat_template
from jaxseq.data.kto import KTODataConfig, load_kto_rows, weight_advice
from jaxseq.errors import JaxseqError
from jaxseq.models.source import ModelSource
from jaxseq.runner import Job, Prepared, Setup, run
from jaxseq.train.kto import KTOConfig

TASK = "causal-lm"
PER_ROW = ("prompt_length", "completion_length", "label")


def check_batch(objective, trainer) -> None:
    """kto's KL term pairs each prompt with another row's completion among its device's rows: at least 2 (as
    TRL's KTOTrainer asks)."""
    if objective.calculate_kl and trainer.per_device_train_batch_size < 2:
        raise JaxseqError(
            "--loss_type kto pairs each prompt with another row's completion of its device's batch (the KL term): "
            "--per_device_train_batch_size must be at least 2"
        )


def prepare(setup: Setup) -> Prepared:
    """Rows tokenised as TRL does, each its prompt and whole completion (a plan reads none: its rows are
    --max_length tokens)."""
    args, data, kto = setup.args, setup.args.data, setup.args.kto
    objective = kto.objective(data.max_length)
    extra = {"ref_logps": ((), np.float32)} if objective.precomputes_reference else {}
    if setup.planning:
        check_batch(objective, args.trainer)
        seq = data.max_length or 1024
        row = {"input_ids": ((seq,), np.int32), **dict.fromkeys(PER_ROW, ((), np.int32))}
        return Prepared(objective, seq_len=seq, row={**row, **extra})
    tokenizer = setup.tokenizer
    if data.chat_template or getattr(tokenizer, "chat_template", None):
        use_chat_template(tokenizer, data.chat_template)
    main_process = jax.process_index() == 0
    log = print if main_process else (lambda *_: None)
    do_train, do_eval, _ = args.stages.stages()
    if do_train:
        check_batch(objective, args.trainer)
    train, valid = load_kto_rows(data, tokenizer, progress=main_process, log=log, train=do_train, evaluate=do_eval)
    if args.stages.do_eval and valid is None:
        raise JaxseqError(
            "--do_eval needs validation rows: pass --validation_file, a --dataset_name with a validation or test "
            "split, or --validation_split_percentage"
        )
    if train is not None and (advice := weight_advice(train["label"], kto.desirable_weight, kto.undesirable_weight)):
        log(advice)
    rows = valid if train is None else train
    seq = rows["input_ids"].shape[1] if data.max_length is None else min(rows["input_ids"].shape[1], data.max_length)
    count = 0 if train is None else len(train["label"])
    desirable = 0 if train is None else int(train["label"].sum())
    return Prepared(
        objective,
        train=train,
        evals={"": valid} if valid is not None else {},
        seq_len=seq,
        summary=lambda _: (
            f"{count:,} training rows ({desirable:,} desirable) of at most {seq} tokens a sequence, loss "
            f"{kto.loss_type} with beta {kto.beta}; reference: "
            + ("precomputed log-probs" if objective.precomputes_reference else "the starting weights, frozen")
        ),
    )


JOB = Job(
    __doc__,
    TASK,
    {"source": ModelSource, "data": KTODataConfig, "kto": KTOConfig},
    prepare,
    default_stages="train, and evaluate where there are validation rows (TRL's KTOTrainer with an eval_dataset)",
)


@script
def main(argv) -> int:
    return run(JOB, argv)
