"""Training: state, optimizers, the sharded train/eval steps, the loop and checkpoints."""
