"""Which model families jaxseq has: ``model_type`` (as in a Hugging Face ``config.json``) -> ``Family``
(NNX classes per task, partition rules, checkpoint names). Adding a family is one module with a ``FAMILY``
(or ``FAMILIES``, for families that share one architecture, as Llama, Mistral and Qwen2) and one line here."""

from __future__ import annotations

from jaxseq.errors import JaxseqError
from jaxseq.models import bert, gpt2, gptj, llama, t5
from jaxseq.models.family import Family

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (gpt2.FAMILY, gptj.FAMILY, t5.FAMILY, bert.FAMILY, *llama.FAMILIES)
}
TASKS = ("base", "causal-lm", "seq2seq-lm", "sequence-classification", "masked-lm")


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
