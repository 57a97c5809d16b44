"""Model families as Flax NNX modules, one folder each (``jaxseq/models/<model_type>/``, listed in
``registry.FAMILIES``: ``registry.family_names()`` names them), and Hugging Face checkpoint I/O. How a model
executes (scanned blocks, attention kernel, remat, per-block gathering) is one ``Execution`` given to its
constructor; ``decide_execution`` decides it from a run's flags and mesh."""

from jaxseq.models.decide import decide_execution
from jaxseq.models.execution import Execution
from jaxseq.models.hub import from_config, load_config, load_pretrained, save_pretrained
from jaxseq.models.registry import FAMILIES

__all__ = [
    "FAMILIES", "Execution", "decide_execution", "from_config", "load_config", "load_pretrained", "save_pretrained",
]  # fmt: skip
