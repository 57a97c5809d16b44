"""How a model's blocks run, fixed when the model is built: its attention kernel, what each block keeps for
the backward pass (remat) and whether each block gathers its fully sharded weights itself. A run decides
these once (``jaxseq.train.spec``); ``models.hub`` builds every model with them, so nothing changes a model
after it is built."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flax import nnx
from jax.sharding import Mesh

from jaxseq.mesh import mesh_platform
from jaxseq.models.attention import use_attention
from jaxseq.models.layers import Stacked, enable_remat, gather_layers
from jaxseq.models.registry import family_for


@dataclasses.dataclass(frozen=True)
class Execution:
    """``attention``: a kernel choice of ``attention.ATTENTION_KERNELS`` (``auto`` resolves per backend and
    model); ``remat``: a ``layers.REMAT_POLICIES`` name; ``mesh``: the devices the model runs on (the
    backend; with fsdp > 1 each block gathers its own weights, ``layers.gather_layers``; with ep > 1 a
    mixture of experts computes each expert on the devices that hold it); ``packed``: batches
    pack several examples per row."""

    attention: str = "xla"
    remat: str = "none"
    mesh: Mesh | None = None
    packed: bool = False

    def apply(self, model: nnx.Module, say: Callable[[str], None] | None = None) -> str:
        """Set it on a freshly built ``model`` and return the attention kernel chosen (``say``: why not the
        fused one, when ``auto`` falls back to XLA)."""
        kernel = use_attention(model, self.attention, self.mesh, packed=self.packed, say=say)
        enable_remat(model, self.remat)
        gathering = self.mesh is not None and self.mesh.shape["fsdp"] > 1
        rules = family_for(model.config.model_type).partition_rules
        gather_layers(model, self.mesh if gathering else None, rules)
        experts = self.mesh if self.mesh is not None and self.mesh.shape["ep"] > 1 else None
        on_cpu = mesh_platform(self.mesh) == "cpu"
        for _, module in nnx.iter_modules(model):
            if hasattr(module, "expert_mesh"):  # a mixture of experts' block: its experts split over ep
                module.expert_mesh = experts
            if isinstance(module, Stacked):
                module.draws_ahead = on_cpu
        return kernel
