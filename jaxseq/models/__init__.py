"""Model families as Flax NNX modules, one folder each (``jaxseq/models/<model_type>/``, listed in
``registry.FAMILIES``: ``registry.family_names()`` names them), and Hugging Face checkpoint I/O."""

from jaxseq.models.attention import use_attention
from jaxseq.models.hub import from_config, load_config, load_pretrained, save_pretrained
from jaxseq.models.layers import enable_remat
from jaxseq.models.registry import FAMILIES

__all__ = [
    "FAMILIES", "enable_remat", "from_config", "load_config", "load_pretrained", "save_pretrained", "use_attention",
]  # fmt: skip
