"""Fine-tune a causal language model on chats, learning only the assistant's turns (supervised fine-tuning).

    jaxseq chat --model_name_or_path path/to/model --train_file chats.jsonl \\
        --output_dir out/chat --max_seq_length 1024

Conversations come from .jsonl/.json files or a Hub dataset: records with "messages" (a list of {"role",
"content"}), or "prompt" and "completion"; for tool calling, "tools" (function schemas) and assistant
"tool_calls", as TRL's. Each is rendered with the tokenizer's chat template (or --chat_template); the loss
covers the tokens of every assistant turn (its tool calls too) and nothing else. Conversations are
packed several to a row (--no_pack_sequences: one per row), attention and positions never crossing from one
to the next. Writes to --output_dir what `jaxseq clm` writes (eval_results.json with the held-out loss and
perplexity over assistant tokens, metrics.jsonl, TensorBoard, checkpoints), and the model with its tokenizer
and chat template as a Hugging Face folder that transformers' generate and pipelines chat with.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxseq.cli import script
from jaxseq.data.chat import ChatDataConfig, load_chat_rows, use_chat_template
from jaxseq.harness import EvalTasksConfig
from jaxseq.models.source import ModelSource, sequence_length
from jaxseq.runner import Job, Prepared, Setup, run
from jaxseq.train.objectives import CausalLMConfig
from jaxseq.train.throughput import SpeedConfig

TASK = "causal-lm"
ROW = ("input_ids", "attention_mask", "position_ids", "loss_mask")


def prepare(setup: Setup) -> Prepared:
    """Conversations rendered by the chat template into rows of --max_seq_length tokens, packed (a plan reads
    none: its batches are rows of that length)."""
    args, data = setup.args, setup.args.data
    seq = sequence_length(data.max_seq_length, setup.config, "max_seq_length", 2048)
    common = {"objective": args.loss.objective(), "seq_len": seq, "packed_rows": data.pack_sequences}
    if setup.planning:
        return Prepared(**common, row=dict.fromkeys(ROW, ((seq,), np.int32)))
    tokenizer = setup.tokenizer
    use_chat_template(tokenizer, data.chat_template)
    main_process = jax.process_index() == 0
    log = print if main_process else (lambda *_: None)
    do_train, do_eval, _ = args.stages.stages()
    train, valid = load_chat_rows(
        data, tokenizer, seq, progress=main_process, log=log, train=do_train, evaluate=do_eval
    )
    rows = 0 if train is None else len(train["input_ids"])
    learned = 0 if train is None else int(train["loss_mask"].sum())
    return Prepared(
        **common,
        train=train,
        evals={} if valid is None else {"": valid},
        summary=lambda _: (
            f"{rows:,} training rows of {seq} tokens ({learned:,} assistant tokens, "
            f"{learned / max(rows * seq, 1):.0%} of the rows), "
            f"{0 if valid is None else len(valid['input_ids']):,} validation rows"
        ),
        extra_eval=lambda results: {"perplexity": results["eval_perplexity"]},
    )


JOB = Job(
    __doc__,
    TASK,
    {
        "source": ModelSource,
        "data": ChatDataConfig,
        "speed": SpeedConfig,
        "loss": CausalLMConfig,
        "eval_tasks": EvalTasksConfig,
    },
    prepare,
)


@script
def main(argv) -> int:
    return run(JOB, argv)
