"""Beam search against transformers PyTorch ``generate(num_beams=..., do_sample=False)``: the same tokens and
``sequences_scores`` for GPT-2, Llama and T5 over (num_beams, length_penalty, early_stopping,
num_return_sequences) with an EOS that beams reach at different steps; one compiled program for every
length_penalty / early_stopping; a scanned model on a (dp=2, mp=4) mesh; the traced ``search_tokens`` an
evaluation step calls; one-line errors; and ``jaxseq generate --num_beams`` in a fresh one-device process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.generation import ProgramKey, Settings, cached_program, generate, search_tokens  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import Execution, load_pretrained  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402
from tests.tiny import DEFAULT, tiny_config  # noqa: E402

VOCAB, NEW, PAD = 128, 12, 1  # PAD is not 0: transformers' beam search pads with EOS when pad_token_id is 0
NOISE = 0.3
"""Every weight gets N(0, NOISE) added: at transformers' init (or with 0.05 added) GPT-2 and T5 repeat one token
from the first step, leaving the beams nothing to choose between."""
CONFIGS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(tiny_config("gpt2", n_embd=64, vocab_size=VOCAB, n_positions=64)),
    "llama": lambda: transformers.LlamaForCausalLM(
        tiny_config("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, max_position_embeddings=64)
    ),
    "t5": lambda: transformers.T5ForConditionalGeneration(
        tiny_config(
            "t5",
            num_decoder_layers=2,
            d_model=64,
            d_kv=16,
            d_ff=128,
            vocab_size=VOCAB,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=20,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
    ),
}
CASES = [
    dict(num_beams=4),  # transformers' defaults: length_penalty 1, early_stopping False
    dict(num_beams=4, length_penalty=0.8, num_return_sequences=3),
    dict(num_beams=4, length_penalty=2.0, early_stopping=True, num_return_sequences=2),
    dict(num_beams=4, length_penalty=1.0, early_stopping="never", num_return_sequences=4),  # judged at NEW
    dict(num_beams=4, length_penalty=-1.0, early_stopping="never", num_return_sequences=2),
    dict(num_beams=2, length_penalty=0.0, early_stopping=True, num_return_sequences=2),
    dict(num_beams=4, min_new_tokens=3, num_return_sequences=4),  # no EOS among the first 3 new tokens
]


def perturbed(model):
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * NOISE)
    return model.eval()


def prompts(lengths=(9, 4, 6)):
    """int32 ``(ids, mask)`` of random prompts (tokens 3..VOCAB-1) padded on the left with PAD."""
    rng = np.random.RandomState(0)
    width = max(lengths)
    ids, mask = np.full((len(lengths), width), PAD, np.int32), np.zeros((len(lengths), width), np.int32)
    for row, n in enumerate(lengths):
        ids[row, width - n :], mask[row, width - n :] = rng.randint(3, VOCAB, n), 1
    return ids, mask


REFERENCE = {}  # torch_beams' results by (model, eos, settings): choosing an EOS already ran most cases


def torch_beams(ref, eos: int, **kw):
    """transformers' beam search on ``prompts()``: the new tokens padded to NEW with PAD, and sequences_scores."""
    key = (id(ref), eos, tuple(sorted(kw.items())))
    if key not in REFERENCE:
        REFERENCE[key] = (ref, run_beams(ref, eos, **kw))  # ref kept alive, so its id stays its own
    return REFERENCE[key][1]


def run_beams(ref, eos: int, **kw):
    ids, mask = prompts()
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(),
            attention_mask=torch.as_tensor(mask).long(),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_scores=True,
            **kw,
        )
    new = out.sequences[:, 1:] if ref.config.is_encoder_decoder else out.sequences[:, ids.shape[1] :]
    return np.pad(new.numpy(), ((0, 0), (0, NEW - new.shape[1])), constant_values=PAD), out.sequences_scores.numpy()


def ends_apart(tokens, eos: int) -> bool:
    """Some sequences end on ``eos``, not all at the same step."""
    lengths = completion_lengths(tokens, eos)
    return len(set(lengths)) > 1 and lengths.min() < NEW


def eos_for(ref, cases) -> int:
    """A token the beams produce (not PAD) that, as EOS, ends sequences at different steps in every case:
    the most frequent such token of a run that never stops early."""
    free, _ = torch_beams(ref, VOCAB, num_beams=4, num_return_sequences=4)  # VOCAB: an EOS never produced
    counts = np.bincount(free.ravel(), minlength=VOCAB)
    for token in np.argsort(-counts, kind="stable")[:16]:
        if token != PAD and all(ends_apart(torch_beams(ref, int(token), **case)[0], int(token)) for case in cases):
            return int(token)
    raise AssertionError("no token of the beams ends them at different steps in every case; change the seed")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    """``(transformers model, its folder, jaxseq model, eos)`` with the same perturbed float32 weights."""
    torch.manual_seed(0)
    ref = perturbed(CONFIGS[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    task = "seq2seq-lm" if ref.config.is_encoder_decoder else "causal-lm"
    return ref, path, load_pretrained(path, task), eos_for(ref, CASES)


def completion_lengths(tokens, eos) -> np.ndarray:
    return np.array([list(row).index(eos) + 1 if eos in row else NEW for row in tokens])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_beam_search_matches_pytorch(family, case):
    """Tokens identical to transformers' (each prompt's best first, EOS kept, PAD after it), sequences_scores
    within 1e-4 (relative 1e-5 for the larger scores of a negative length_penalty); the log-probs of the
    returned tokens sum to the score times length ** length_penalty."""
    ref, _, model, eos = family
    want, want_scores = torch_beams(ref, eos, **case)
    assert ends_apart(want, eos)
    lengths = completion_lengths(want, eos)
    got = generate(
        model, *prompts(), max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD, return_logprobs=True, **case
    )
    np.testing.assert_array_equal(np.asarray(got.sequences), want)
    np.testing.assert_allclose(np.asarray(got.sequences_scores), want_scores, rtol=1e-5, atol=1e-4)
    logprobs = np.asarray(got.logprobs)
    assert (logprobs[np.arange(NEW) >= lengths[:, None]] == 0).all()
    lp = case.get("length_penalty", 1.0)
    np.testing.assert_allclose(logprobs.sum(1) / lengths.astype(np.float64) ** lp, want_scores, rtol=1e-5, atol=1e-4)


def test_one_program_for_every_penalty_and_stopping(family):
    """length_penalty and early_stopping are inputs and num_return_sequences a slice: the calls above and these
    share one compiled program per num_beams."""
    ref, _, model, eos = family
    for lp, stopping in [(0.7, False), (1.3, "never"), (3.0, True)]:
        got = generate(
            model,
            *prompts(),
            max_new_tokens=NEW,
            eos_token_id=eos,
            pad_token_id=PAD,
            return_logprobs=True,
            num_beams=4,
            length_penalty=lp,
            early_stopping=stopping,
        )
        want, _ = torch_beams(ref, eos, num_beams=4, length_penalty=lp, early_stopping=stopping)
        np.testing.assert_array_equal(np.asarray(got.sequences), want)
    settings = Settings(
        max_new_tokens=NEW, do_sample=False, top_k=0, use_top_p=False, eos=(eos,), pad=PAD, return_logprobs=True,
        decoder_start=model.decoder_start_id() if hasattr(model, "encode") else None, mesh=None, num_beams=4,
    )  # fmt: skip
    assert cached_program(ProgramKey(nnx.graphdef(model), settings))._cache_size() == 1


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_scanned_model_on_a_mesh_equals_pytorch(tmp_path, name):
    """Stacked blocks (a cache with a leading layer axis) sharded over (dp=2, mp=4), three prompts padded to
    four rows: the cache gathered per beam there gives transformers' tokens."""
    torch.manual_seed(0)
    ref = perturbed(CONFIGS[name]())
    ref.save_pretrained(tmp_path)
    case = dict(num_beams=3, length_penalty=1.2, num_return_sequences=2)
    eos = eos_for(ref, [case])
    want, want_scores = torch_beams(ref, eos, **case)
    task = "seq2seq-lm" if name == "t5" else "causal-lm"
    model = load_pretrained(tmp_path, task, mesh=make_mesh("dp=2,mp=4"), execution=Execution(scan_layers=True))
    assert all(len(leaf.sharding.device_set) == 8 for leaf in jax.tree.leaves(nnx.state(model)))
    got = generate(model, *prompts(), max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD, **case)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)
    np.testing.assert_allclose(np.asarray(got.sequences_scores), want_scores, rtol=1e-5, atol=1e-4)


def test_traced_best_beam_for_an_evaluation_step(family):
    """``search_tokens(num_beams=...)`` inside the caller's jit: the best beam of ``generate``."""
    _, _, model, eos = family
    ids, mask = prompts()
    kw = dict(num_beams=3, length_penalty=0.8, early_stopping=True)
    traced = jax.jit(
        lambda i, m: search_tokens(model, i, m, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD, **kw)
    )(ids, mask)
    got = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD, **kw)
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(got.sequences))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_beams=2, num_return_sequences=3), "num_return_sequences must be between 1 and num_beams (2)"),
        (dict(num_return_sequences=2), "num_return_sequences must be between 1 and num_beams (1)"),
        (dict(num_beams=0), "num_beams must be at least 1"),
        (dict(num_beams=2, early_stopping="sometimes"), "early_stopping must be True, False or 'never'"),
        (dict(num_beams=2, do_sample=True), "beam search does not sample"),
    ],
)
def test_bad_beam_arguments_are_one_line_errors(kw, message):
    from jaxseq.models import from_config

    model = from_config(tiny_config("gpt2", n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=DEFAULT), "causal-lm")
    with pytest.raises(JaxseqError) as error:
        generate(model, *prompts(), max_new_tokens=4, **kw)
    assert message in str(error.value) and "\n" not in str(error.value)


# --------------------------------------------------------------------------- jaxseq generate --num_beams


def test_command_beams_match_pytorch_in_a_fresh_process(tmp_path):
    """The installed ``jaxseq generate`` on one CPU device: each prompt's two best beams, as transformers'
    beam search (the same flags) writes them."""
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    torch.manual_seed(0)
    ref = perturbed(transformers.GPT2LMHeadModel(tiny_config("gpt2", n_embd=64, vocab_size=DEFAULT, n_positions=64)))
    ref.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    texts = ["The quick brown fox", "Hello", "In 1905, Einstein published four papers that"]
    (tmp_path / "prompts.txt").write_text("\n".join(texts) + "\n")
    flags = dict(num_beams=3, length_penalty=0.8, num_return_sequences=2, max_new_tokens=8)
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [Path(sys.executable).with_name("jaxseq"), "generate", "--model_name_or_path", tmp_path / "model",
         "--prompt_file", tmp_path / "prompts.txt", "--output_file", tmp_path / "out.jsonl", "--batch_size", "2",
         "--early_stopping", *(a for k, v in flags.items() for a in (f"--{k}", str(v)))],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == texts
    for record in records:
        ids = tokenizer(record["prompt"], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = ref.generate(ids, do_sample=False, early_stopping=True, pad_token_id=50256, **flags)
        want = [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out]
        assert record["completions"] == want and record["completion"] == want[0]
