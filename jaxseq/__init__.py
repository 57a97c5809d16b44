"""jaxseq: train and fine-tune Hugging Face sequence models in JAX."""

__version__ = "0.1.0"
