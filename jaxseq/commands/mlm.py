"""Pretrain a {families} masked language model with jaxseq, or keep training one (transformers' run_mlm.py).

    jaxseq mlm --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --train_file corpus.txt \\
        --output_dir out/mlm
    jaxseq mlm --model_type bert --config_overrides num_hidden_layers=4,hidden_size=256 \\
        --tokenizer_name bert-base-uncased --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1

Text from local files (txt, jsonl, csv) or a Hub dataset is tokenized once (cached under ~/.cache/jaxseq/text),
joined with the separator token ([SEP], </s>) between documents and cut into blocks of --max_seq_length tokens;
with --line_by_line each non-empty line is one example ([CLS] line [SEP], truncated, padded). Each training
step masks --mlm_probability of the tokens on the device as transformers' DataCollatorForLanguageModeling does
(80% the mask token, 10% a random token, 10% kept; special tokens and padding never), drawn from the step's key,
so a resumed run masks as an uninterrupted one; the validation set is masked once (a fixed mask per example).
Writes to --output_dir: eval_results.json (eval_loss, perplexity), all_results.json, metrics.jsonl, TensorBoard
events, training_curves.png, the config used, orbax checkpoints, and the model with its tokenizer as a Hugging
Face folder (AutoModelForMaskedLM, the fill-mask pipeline).
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import numpy as np

from jaxseq.cli import script
from jaxseq.config import arg
from jaxseq.data.masking import mask_examples
from jaxseq.data.text import TextDataConfig, check_sources, load_blocks, load_hub_dataset, read_documents, token_dtype
from jaxseq.errors import JaxseqError
from jaxseq.models.registry import family_names
from jaxseq.models.source import ModelSource, sequence_length
from jaxseq.runner import Job, Prepared, Setup, run
from jaxseq.train.pretraining import MaskedLM

TASK = "masked-lm"
__doc__ = __doc__.format(families=family_names(TASK))


@dataclasses.dataclass
class MLMDataConfig(TextDataConfig):
    block_size: int | None = arg(
        None, "tokens per example (default: the model's positions, at most 512)", aliases=("max_seq_length",)
    )
    line_by_line: bool = arg(False, "each non-empty line of the text is one example, instead of blocks of text")
    mlm_probability: float = arg(0.15, "share of the tokens masked (80%% mask token, 10%% random, 10%% kept)")


def separated(tokenizer):
    """``tokenizer``, or a copy whose EOS is its separator: what ``load_blocks`` puts between documents."""
    if tokenizer.eos_token_id is not None:
        return tokenizer
    if tokenizer.sep_token_id is None:
        raise JaxseqError("the tokenizer has neither a separator nor an EOS token to put between documents")
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.eos_token = tokenizer.sep_token
    return tokenizer


def lines(data: MLMDataConfig, split: str) -> list[str]:
    """The non-empty lines of the training or validation text (``split``)."""
    if data.dataset_name:
        splits = load_hub_dataset(data.dataset_name, data.dataset_config_name)
        documents = splits[split][data.text_column] if split in splits else []
    else:
        path = data.train_file if split == "train" else data.validation_file
        documents = read_documents(path, data.text_column) if path else []
    return [line.strip() for document in documents for line in document.splitlines() if line.strip()]


def line_examples(
    data: MLMDataConfig, tokenizer, length: int, *, train: bool = True, evaluate: bool = True
) -> tuple[dict | None, dict | None]:
    """(train, validation) arrays of one line each, with special tokens, truncated and padded to ``length``
    (None for a stage not asked for); without validation text, the last --validation_split_percentage of the
    lines."""
    valid = lines(data, "validation")
    lines_of_train = lines(data, "train") if train or not valid else []
    if not valid:
        held_out = max(1, int(len(lines_of_train) * data.validation_split_percentage / 100))
        if held_out >= len(lines_of_train):
            raise JaxseqError(
                f"{len(lines_of_train)} line(s) cannot be split into training and validation; give more text"
            )
        lines_of_train, valid = lines_of_train[:-held_out], lines_of_train[-held_out:]

    def encode(texts):
        encoded = tokenizer(texts, truncation=True, max_length=length, padding="max_length")
        return {k: np.asarray(encoded[k], np.int32) for k in ("input_ids", "attention_mask")}

    return (
        encode(lines_of_train[: data.max_train_samples]) if train else None,
        encode(valid[: data.max_eval_samples]) if evaluate else None,
    )


def prepare(setup: Setup) -> Prepared:
    """Blocks of text, or lines (a plan reads none: its batches are rows of --max_seq_length tokens)."""
    args, data = setup.args, setup.args.data
    if not 0 < data.mlm_probability < 1:
        raise JaxseqError(f"--mlm_probability must be between 0 and 1, got {data.mlm_probability}")
    length = sequence_length(data.block_size, setup.config, "max_seq_length", 512)
    tokenizer = setup.tokenizer
    if tokenizer.mask_token_id is None:
        raise JaxseqError("the tokenizer has no mask token; pass the model's own tokenizer (--tokenizer_name)")
    objective = MaskedLM(data.mlm_probability, tokenizer.mask_token_id, tokenizer.all_special_ids, len(tokenizer))
    common = {"objective": objective, "seq_len": length}
    if setup.planning:
        row = {"input_ids": ((length,), np.int32 if data.line_by_line else token_dtype(len(tokenizer)))}
        if data.line_by_line:
            row["attention_mask"] = ((length,), np.int32)
        return Prepared(**common, row=row)
    do_train, do_eval, _ = args.stages.stages()
    check_sources(data, train=do_train, evaluate=do_eval)
    if data.line_by_line:
        train, valid = line_examples(data, tokenizer, length, train=do_train, evaluate=do_eval)
        kind = "lines"
    else:
        main_process = jax.process_index() == 0
        log = print if main_process else (lambda *_: None)
        blocks = load_blocks(
            data, separated(tokenizer), length, progress=main_process, log=log, train=do_train, evaluate=do_eval
        )
        train, valid = (None if b is None else {"input_ids": b} for b in blocks)
        kind = "blocks"
    masking = dict(probability=data.mlm_probability, mask_token_id=tokenizer.mask_token_id, vocab_size=len(tokenizer))
    if valid is not None:
        valid = mask_examples(valid, args.trainer.seed, tokenizer.all_special_ids, **masking)
    sizes = [0 if part is None else len(part["input_ids"]) for part in (train, valid)]
    return Prepared(
        **common,
        train=train,
        evals={} if valid is None else {"": valid},
        summary=lambda _: (
            f"{sizes[0]:,} training / {sizes[1]:,} validation {kind} of {length} tokens, {data.mlm_probability:g} "
            "of them masked"
        ),
        extra_eval=lambda results: {"perplexity": results["eval_perplexity"]},  # run_mlm's name for it
    )


JOB = Job(__doc__, TASK, {"source": ModelSource, "data": MLMDataConfig}, prepare)


@script
def main(argv) -> int:
    return run(JOB, argv)
