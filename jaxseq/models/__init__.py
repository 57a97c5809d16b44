"""Model families (GPT-2, GPT-J, T5, BERT) as Flax NNX modules, and Hugging Face checkpoint I/O."""

from jaxseq.models import bert, gpt2, gptj, t5
from jaxseq.models.hub import from_config, load_config, load_pretrained, save_pretrained

FAMILIES = {family.model_type: family for family in (gpt2.FAMILY, gptj.FAMILY, t5.FAMILY, bert.FAMILY)}

__all__ = ["FAMILIES", "from_config", "load_config", "load_pretrained", "save_pretrained"]
