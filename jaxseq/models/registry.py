"""Which model families jaxseq has: ``model_type`` (as in a Hugging Face ``config.json``) -> ``Family``
(NNX classes per task, partition rules, checkpoint names, position limit, FLOPs). A family is a folder,
``jaxseq/models/<model_type>/``, whose ``FAMILY`` is one line of ``FAMILIES`` below; every list of families
jaxseq shows (help, errors, docs) is read from here (``family_names``)."""

from __future__ import annotations

from jaxseq.errors import JaxseqError
from jaxseq.models import (
    bert,
    deepseek_v3,
    gemma2,
    gemma3_text,
    gemma4_text,
    gpt2,
    gpt_oss,
    gptj,
    llama,
    mistral,
    mixtral,
    opt,
    phi3,
    qwen2,
    qwen3,
    qwen3_5_moe_text,
    qwen3_5_text,
    qwen3_moe,
    roberta,
    t5,
)
from jaxseq.models.family import Family

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        gpt2.FAMILY,
        gptj.FAMILY,
        opt.FAMILY,
        t5.FAMILY,
        bert.FAMILY,
        roberta.FAMILY,
        llama.FAMILY,
        mistral.FAMILY,
        mixtral.FAMILY,
        qwen2.FAMILY,
        qwen3.FAMILY,
        qwen3_moe.FAMILY,
        deepseek_v3.FAMILY,
        qwen3_5_text.FAMILY,
        qwen3_5_moe_text.FAMILY,
        gpt_oss.FAMILY,
        gemma2.FAMILY,
        gemma3_text.FAMILY,
        gemma4_text.FAMILY,
        phi3.FAMILY,
    )
}
TASKS = (
    "base",
    "causal-lm",
    "seq2seq-lm",
    "sequence-classification",
    "masked-lm",
    "token-classification",
    "question-answering",
)


def family_for(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        raise JaxseqError(f"model_type {model_type!r} is not supported; jaxseq supports {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def model_class(config, task: str) -> type:
    """The NNX class of ``config``'s family for ``task`` (one-line error if jaxseq has none)."""
    family = family_for(config.model_type)
    if task not in family.tasks:
        raise JaxseqError(
            f"task {task!r} is not available for {family.model_type}; choose one of {', '.join(family.tasks)}"
        )
    return family.tasks[task]


def families_with(task: str) -> list[str]:
    """Model types that have a ``task`` model, sorted."""
    return sorted(name for name, family in FAMILIES.items() if task in family.tasks)


def task_of(model) -> str:
    """The task whose class ``model`` is (``Family.tasks``)."""
    family = family_for(model.config.model_type)
    task = next((task for task, cls in family.tasks.items() if type(model) is cls), None)
    if task is None:
        raise JaxseqError(f"{type(model).__name__} is none of the {family.name} classes jaxseq has")
    return task


def family_names(*tasks: str, conjunction: str = "or") -> str:
    """The families (their ``name``s, in registry order) that have a model for any of ``tasks`` (all families
    without ``tasks``), as a list in a sentence: ``"GPT-2, GPT-J, Llama, Mistral or Qwen2"``."""
    names = [f.name for f in FAMILIES.values() if not tasks or any(t in f.tasks for t in tasks)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


def task_table() -> str:
    """Markdown table of each task and the families that have a model for it (README's, checked by
    ``tests/test_house.py``)."""
    rows = ["| task | families |", "|---|---|"]
    rows += [f"| `{task}` | {family_names(task, conjunction='and')} |" for task in TASKS]
    return "\n".join(rows)


def model_flops(config, task: str, rows: int, seq_len: int, target_len: int = 0, *, training: bool = True) -> float:
    """Model FLOPs of one step of ``config``'s model for ``task`` over ``rows`` rows of ``seq_len`` tokens
    (an encoder-decoder's source; ``target_len`` its target): ``Family.model_flops`` of its family."""
    return family_for(config.model_type).model_flops(config, task, rows, seq_len, target_len, training=training)
