"""Load a Hugging Face model into jaxseq and run one forward pass (the quick check that all is set up).

    python scripts/demo.py --model_name_or_path sentence-transformers/all-MiniLM-L6-v2
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_TEXTS = ["jaxseq runs Hugging Face models in JAX.", "A second, somewhat longer sentence to pad against."]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="local HF folder or Hub id")
    parser.add_argument("--task", default=None, help="causal-lm, seq2seq-lm, sequence-classification, "
                        "masked-lm or base (default: base for BERT, causal-lm for GPT-2/GPT-J, seq2seq-lm for T5)")
    parser.add_argument("--text", action="append", help="input text (repeatable); two examples by default")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from transformers import AutoTokenizer

    from jaxseq.errors import JaxseqError
    from jaxseq.models import load_config, load_pretrained
    from jaxseq.models.hub import resolve

    try:
        folder = resolve(args.model_name_or_path)
        model_type = load_config(folder).model_type
        task = args.task or {"bert": "base", "t5": "seq2seq-lm"}.get(model_type, "causal-lm")
        start = time.perf_counter()
        model = load_pretrained(folder, task, dtype=jnp.dtype(args.dtype))
        loaded = time.perf_counter() - start
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        batch = tokenizer(args.text or DEFAULT_TEXTS, padding=True, return_tensors="np")
        inputs = [jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])]
        if task == "seq2seq-lm":
            inputs.append(jnp.zeros((inputs[0].shape[0], 1), jnp.int32))
        out = model(*inputs)
        first = out[0] if isinstance(out, tuple) else out
        first = np.asarray(first)
    except JaxseqError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    params = sum(x.size for x in jax.tree.leaves(model))
    print(f"{model_type} {task}: {params / 1e6:.1f}M parameters loaded in {loaded:.1f}s on {jax.device_count()} "
          f"{jax.devices()[0].platform} device(s)")
    print(f"output {first.shape} {first.dtype}, mean {first.mean():+.4f}, std {first.std():.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
