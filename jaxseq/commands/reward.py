"""Train a reward model on preference pairs, as TRL's RewardTrainer.

    jaxseq reward --model_name_or_path path/to/sft-model --train_file pairs.jsonl \\
        --output_dir out/reward --learning_rate 1e-4 --center_rewards_coefficient 0.01

Pairs come from .jsonl/.json files or a Hub dataset: records of "chosen" and "rejected" (and optionally
"prompt", put in front of each, and "margin"), as strings or as conversations (lists of {"role", "content"},
rendered with the tokenizer's chat template or --chat_template). They are tokenised as TRL tokenises them (EOS
after strings; pairs with a sequence longer than --max_length are left out). The model (any decoder family,
or an encoder) gets a classifier with one output, reading each sequence's last non-padding token (the pad
token is the tokenizer's, else its EOS), and learns the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected
- margin), plus --center_rewards_coefficient x mean((r_chosen + r_rejected)^2). Logged as TRL logs them: loss,
min_reward, mean_reward, max_reward, accuracy, margin (metrics.jsonl prefixes train/ and eval/).
Writes to --output_dir what every job writes, and the reward model with its tokenizer as a Hugging Face folder
that AutoModelForSequenceClassification loads.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxseq.cli import script
from jaxseq.data.chat import use_chat_template
from jaxseq.data.reward import RewardDataConfig, load_reward_rows
from jaxseq.errors import JaxseqError
from jaxseq.models.hub import position_limit
from jaxseq.models.source import ModelSource, pad_with_eos
from jaxseq.runner import Job, Prepared, Setup, run
from jaxseq.train.reward import RewardConfig

TASK = "sequence-classification"
ROW = ("input_ids", "pair_mask")


def prepare(setup: Setup) -> Prepared:
    """Pairs tokenised as TRL does into ``[2, length]`` rows (a plan reads none: its rows are --max_length)
    for a classifier with one label, whose pad token is the tokenizer's (else its EOS)."""
    args, data = setup.args, setup.args.data
    objective = args.reward.objective()
    setup.override(num_labels=1)
    if not setup.planning or setup.tokenizer_name is not None:
        tokenizer = pad_with_eos(setup.tokenizer)  # as TRL: the pad token, else EOS, marks each sequence's end
        setup.override(pad_token_id=tokenizer.pad_token_id)
    if setup.planning:
        seq = data.max_length or 1024
        return Prepared(objective, seq_len=seq, row=dict.fromkeys(ROW, ((2, seq), np.int32)))
    if data.chat_template or getattr(tokenizer, "chat_template", None):
        use_chat_template(tokenizer, data.chat_template)
    main_process = jax.process_index() == 0
    do_train, do_eval, _ = args.stages.stages()
    train, valid = load_reward_rows(
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
    seq = max(rows["input_ids"].shape[-1] for rows in (train, valid) if rows is not None)
    limit = position_limit(setup.config)
    if limit is not None and seq > limit:
        raise JaxseqError(
            f"pairs of up to {seq} tokens a sequence exceed the model's {limit} positions; pass --max_length {limit}"
        )
    pairs = 0 if train is None else len(train["input_ids"])
    center = args.reward.center_rewards_coefficient
    return Prepared(
        objective,
        train=train,
        evals={"": valid} if valid is not None else {},
        seq_len=seq,
        summary=lambda _: (
            f"{pairs:,} training pairs of at most {seq} tokens a sequence"
            + (", with margins" if train is not None and "margin" in train else "")
            + (f"; rewards centred with coefficient {center}" if center is not None else "")
        ),
    )


JOB = Job(
    __doc__,
    TASK,
    {"source": ModelSource, "data": RewardDataConfig, "reward": RewardConfig},
    prepare,
    default_stages="train, and evaluate where there are validation pairs (TRL's RewardTrainer with an eval_dataset)",
)


@script
def main(argv) -> int:
    return run(JOB, argv)
