"""Distil a teacher into a causal language model (the student), as TRL's GKD trainer and DistillationTrainer.

    jaxseq distill --model_name_or_path path/to/student --teacher_model_name_or_path path/to/teacher \\
        --train_file chats.jsonl --output_dir out/distill --lmbda 0.5 --beta 0.5

Rows come from .jsonl/.json files or a Hub dataset: records of "messages" (the last message is the completion,
the ones before it the prompt), or "prompt" and "completion" (strings, or lists of messages), with "tools"
for tool calling as `jaxseq chat` reads them; rendered with the student tokenizer's chat template (or
--chat_template) and tokenised as TRL's GKD trainer tokenises them (sequences longer than --max_length keep
their last tokens). The teacher (--teacher_model_name_or_path: a causal LM of the student's vocabulary, any
family and size) is frozen, its weights stored in the compute dtype (--dtype) and sharded on the run's mesh
as the student's are; --teacher_quantization int8 or nf4 stores its blocks' dense kernels quantised instead
(as QLoRA's base), each layer dequantised where it is used. The loss is the generalized Jensen-Shannon
divergence between the student's and the teacher's next-token distributions on the completion tokens (--beta
0: forward KL, 1: reverse KL), the logits of both made a chunk at a time (--loss_chunk_tokens). With
probability --lmbda a step trains on completions the student samples from its prompts (on-policy,
--temperature, --max_new_tokens) instead of the data's. --lmbda 1 is TRL's DistillationTrainer (always
on-policy, its defaults, --temperature also in the loss); rows may then be "prompt" alone. Sequence-level
distillation is `jaxseq generate --prompts_file` with the teacher, then `jaxseq chat` on what it wrote.
Logged: loss (metrics.jsonl prefixes train/ and eval/).
Writes to --output_dir what every job writes, and the student with its tokenizer as a Hugging Face folder.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxseq.cli import script
from jaxseq.config import arg
from jaxseq.data.chat import use_chat_template
from jaxseq.data.distill import DistillDataConfig, load_distill_rows
from jaxseq.errors import JaxseqError
from jaxseq.models.source import ModelSource, model_config, stop_token_ids
from jaxseq.runner import Job, Prepared, Setup, run
from jaxseq.train.distill import Distill, DistillConfig, OnPolicy
from jaxseq.train.objectives import CausalLM
from jaxseq.train.quantize import QUANTIZE
from jaxseq.train.spec import Teacher

TASK = "causal-lm"
ROW = ("input_ids", "attention_mask", "loss_mask")


@dataclasses.dataclass
class TeacherConfig:
    teacher_model_name_or_path: str | None = arg(
        None, "the teacher: Hub id or local folder of a causal LM with the student's vocabulary (required)"
    )
    teacher_quantization: str = arg(
        "none",
        "store the teacher's block kernels quantised on the devices, as QLoRA's base (int8: a scale per output "
        "channel; nf4: 4-bit NormalFloat, an absmax scale per 64 inputs), each layer dequantised where used",
        choices=QUANTIZE,
    )


def load_teacher(name: str | None, student_config, *, weights: bool, quantization: str = "none") -> Teacher:
    """The teacher's config and folder, checked: a causal LM jaxseq has, of the student's vocabulary;
    ``quantization``: how its block kernels are stored (``Teacher``)."""
    if not name:
        raise JaxseqError("give the teacher: --teacher_model_name_or_path (a Hub id or a model folder)")
    config, folder, _ = model_config(ModelSource(model_name_or_path=name), TASK, weights=weights)
    if config.vocab_size != student_config.vocab_size:
        raise JaxseqError(
            f"the teacher's vocabulary has {config.vocab_size} tokens and the student's {student_config.vocab_size}: "
            "distillation compares their next-token distributions over one vocabulary; pick a teacher of the "
            "student's tokenizer"
        )
    return Teacher(config, folder, quantization)


def prepare(setup: Setup) -> Prepared:
    """Rows tokenised as TRL's GKD collator, the teacher, and the loss (with its on-policy sampler)."""
    args, data, distill = setup.args, setup.args.data, setup.args.distill
    teacher = load_teacher(
        args.teacher.teacher_model_name_or_path,
        setup.config,
        weights=not setup.planning,
        quantization=args.teacher.teacher_quantization,
    )
    lm = CausalLM(distill.loss_chunk_tokens or None)
    if setup.planning:
        rows = {**dict.fromkeys(ROW, ((data.max_length,), np.int32)), "prompt_length": ((), np.int32)}
        return Prepared(Distill(distill, lm=lm), seq_len=data.max_length, row=rows, teacher=teacher)
    tokenizer = setup.tokenizer
    use_chat_template(tokenizer, data.chat_template)
    main_process = jax.process_index() == 0
    do_train, do_eval, _ = args.stages.stages()
    on_policy = do_train and distill.lmbda > 0
    train, valid = load_distill_rows(
        data, tokenizer, prompts_only=distill.lmbda == 1, progress=main_process, train=do_train, evaluate=do_eval
    )
    if args.stages.do_eval and valid is None:
        raise JaxseqError(
            "--do_eval needs validation rows: pass --validation_file, a --dataset_name with a validation or test "
            "split, or --validation_split_percentage"
        )
    sampler = None
    if on_policy:
        eos = stop_token_ids(tokenizer, setup.config)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        width = int(train["prompt_length"].max())
        sampler = OnPolicy(distill, width, eos, pad, args.trainer.seed)
    rows = valid if train is None else train
    seq = rows["input_ids"].shape[1]
    count = 0 if train is None else len(train["input_ids"])
    return Prepared(
        Distill(distill, lm=lm, sampler=sampler),
        train=train,
        evals={"": valid} if valid is not None else {},
        seq_len=seq,
        teacher=teacher,
        summary=lambda _: (
            f"{count:,} training rows of at most {seq} tokens; teacher {teacher.config.model_type} from "
            f"{teacher.folder}"
            + ("" if teacher.quantization == "none" else f" ({teacher.quantization})")
            + f"; beta {distill.beta}, "
            + (
                f"on-policy with probability {distill.lmbda} (temperature {distill.temperature}, at most "
                f"{distill.max_new_tokens} new tokens)"
                if sampler is not None
                else "on the data's completions"
            )
        ),
    )


JOB = Job(
    __doc__,
    TASK,
    {"source": ModelSource, "teacher": TeacherConfig, "data": DistillDataConfig, "distill": DistillConfig},
    prepare,
    default_stages="train, and evaluate where there are validation rows (TRL's trainers with an eval_dataset)",
)


@script
def main(argv) -> int:
    return run(JOB, argv)
