"""Training objectives: the loss, the per-example eval outputs and the metrics of each kind of job."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxseq.data.glue import GlueTask, compute_metrics


class SequenceClassification:
    """Cross-entropy over classes, or mean squared error when the task is a regression (STS-B)."""

    def __init__(self, task: GlueTask):
        self.task = task

    def _logits(self, model, batch, rngs=None):
        extra = {"token_type_ids": batch["token_type_ids"]} if "token_type_ids" in batch else {}
        return model(batch["input_ids"], batch["attention_mask"], **extra, rngs=rngs)

    def _losses(self, logits, labels):
        if self.task.is_regression:
            return (logits[:, 0] - labels) ** 2
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

    def loss(self, model, batch: Mapping[str, jax.Array], rngs) -> jax.Array:
        return self._losses(self._logits(model, batch, rngs), batch["labels"]).mean()

    def predict(self, model, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        logits = self._logits(model, batch)
        prediction = logits[:, 0] if self.task.is_regression else jnp.argmax(logits, axis=-1)
        return {"prediction": prediction, "loss": self._losses(logits, batch["labels"])}

    def metrics(self, outputs: dict[str, np.ndarray], arrays: Mapping[str, np.ndarray]) -> dict[str, float]:
        return {"loss": float(outputs["loss"].mean()),
                **compute_metrics(self.task, outputs["prediction"], arrays["labels"])}
