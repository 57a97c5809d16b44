"""Generation against transformers PyTorch ``generate()``: greedy tokens with EOS inside the run, min_new_tokens
and log-probs for GPT-2, GPT-J, Qwen3, OPT and T5; the sampling filters against transformers' warpers and by their
draws; seeds; one compiled program per bucket; a (dp=2, mp=4) mesh; and scripts/generate.py end to end."""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.generation import ProgramKey, Settings, cached_program, choose_tokens, filter_logits, generate  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import load_pretrained  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402

VOCAB, NEW, PAD = 128, 32, 0
# Random weights larger than the usual init, so greedy decoding wanders instead of repeating one token.
CONFIGS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, initializer_range=0.3)
    ),
    "gptj": lambda: transformers.GPTJForCausalLM(
        transformers.GPTJConfig(
            n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=VOCAB, n_positions=64, initializer_range=0.3
        )
    ),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            initializer_range=0.3,
        )
    ),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            sliding_window=4,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=8.0,
            tie_word_embeddings=False,  # tied, a tiny random Gemma repeats its last token (tests/test_gemma.py)
            attn_implementation="eager",
            initializer_range=0.3,
        )
    ),
    "opt": lambda: transformers.OPTForCausalLM(
        transformers.OPTConfig(
            num_hidden_layers=2,
            hidden_size=64,
            ffn_dim=128,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            do_layer_norm_before=False,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            init_std=0.2,
        )  # 350m-style: post-norm, project_in/project_out
    ),
    "t5": lambda: t5_with_unit_weights(
        transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                num_layers=2,
                num_decoder_layers=2,
                d_model=64,
                d_kv=16,
                num_heads=4,
                d_ff=128,
                vocab_size=VOCAB,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=20,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        )
    ),
}


def t5_with_unit_weights(model):
    """Every matrix but the position buckets drawn from N(0, 1): at T5's own scales, or larger factors, a
    tiny random T5 repeats one token from the first step."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "relative_attention_bias" not in name:
                param.normal_(0.0, 1.0)
    return model


def prompts(lengths=(12, 7, 3), left=True):
    """int32 ``(ids, mask)`` of random prompts (tokens 3..VOCAB-1), padded on the left or the right."""
    rng = np.random.RandomState(0)
    width = max(lengths)
    ids, mask = np.full((len(lengths), width), PAD, np.int32), np.zeros((len(lengths), width), np.int32)
    for row, n in enumerate(lengths):
        span = slice(width - n, width) if left else slice(0, n)
        ids[row, span], mask[row, span] = rng.randint(3, VOCAB, n), 1
    return ids, mask


def torch_generate(ref, ids, mask, eos_token_id, **kw):
    """transformers' greedy ``generate()``: the new tokens padded to NEW, and each step's raw logits.
    ``eos_token_id=None`` runs all NEW steps (VOCAB is an id no model here produces)."""
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(),
            attention_mask=torch.as_tensor(mask).long(),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=PAD,
            return_dict_in_generate=True,
            output_logits=True,
            eos_token_id=VOCAB if eos_token_id is None else eos_token_id,
            **kw,
        )
    new = out.sequences[:, 1:] if ref.config.is_encoder_decoder else out.sequences[:, ids.shape[1] :]
    new = np.pad(new.numpy(), ((0, 0), (0, NEW - new.shape[1])), constant_values=PAD)
    return new, torch.stack(out.logits, 1).numpy()


def eos_hit_mid_run(tokens) -> int:
    """A token that greedy decoding produces in every row, first at different steps, all well before the
    end (the latest as early as possible): as EOS, rows finish apart and then the whole loop stops early."""
    firsts = {}
    for token in set(tokens[0]):
        steps = [list(row).index(token) if token in row else NEW for row in tokens]
        if max(steps) < NEW - 4 and len(set(steps)) > 1:
            firsts[token] = max(steps)
    return int(min(firsts, key=firsts.get))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    """``(name, transformers model, jaxseq model, eos)`` with the same random float32 weights."""
    torch.manual_seed(0)
    ref = CONFIGS[request.param]().eval()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    task = "seq2seq-lm" if ref.config.is_encoder_decoder else "causal-lm"
    free, _ = torch_generate(ref, *prompts(), eos_token_id=None)
    return request.param, ref, load_pretrained(path, task), eos_hit_mid_run(free)


def test_greedy_matches_pytorch_with_eos_inside_the_run(family):
    """Tokens equal transformers' (EOS kept, padding after it) for prompts padded on either side; log-probs
    are the log-softmax of transformers' raw logits at the chosen tokens, 0 after EOS."""
    _, ref, model, eos = family
    ids, mask = prompts()
    want, logits = torch_generate(ref, ids, mask, eos_token_id=eos)
    finished_at = [list(row).index(eos) for row in want]
    assert len(set(finished_at)) > 1 and max(finished_at) < NEW - 4  # padding while others run; early exit
    got = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD, return_logprobs=True)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)
    steps = logits.shape[1]
    logprobs = torch.log_softmax(torch.as_tensor(logits), -1).numpy()
    chosen = np.take_along_axis(logprobs, want[:, :steps, None], -1)[..., 0]
    ended = np.cumsum(np.pad(want == eos, ((0, 0), (1, 0)))[:, :NEW], 1) > 0  # steps after the row's EOS
    np.testing.assert_allclose(np.asarray(got.logprobs)[:, :steps], np.where(ended[:, :steps], 0.0, chosen), atol=1e-4)
    assert (np.asarray(got.logprobs)[:, steps:] == 0).all()
    # the same prompts padded on the right: left-aligned inside, same program, same tokens
    again = generate(
        model, *prompts(left=False), max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD, return_logprobs=True
    )
    np.testing.assert_array_equal(np.asarray(again.sequences), want)


def test_min_new_tokens_matches_pytorch(family):
    """EOS cannot end a row before min_new_tokens (set past every row's first EOS)."""
    _, ref, model, eos = family
    ids, mask = prompts()
    free, _ = torch_generate(ref, ids, mask, eos_token_id=None)
    min_new = max(list(row).index(eos) for row in free) + 1
    want, _ = torch_generate(ref, ids, mask, eos_token_id=eos, min_new_tokens=min_new)
    assert (want[:, :min_new] != eos).all()
    got = generate(
        model,
        ids,
        mask,
        max_new_tokens=NEW,
        eos_token_id=eos,
        pad_token_id=PAD,
        min_new_tokens=min_new,
        return_logprobs=True,
    )  # the program of the test above
    np.testing.assert_array_equal(np.asarray(got.sequences), want)


def test_filters_match_transformers_warpers():
    from transformers.generation import logits_process as lp

    logits = np.random.RandomState(0).randn(4, 50).astype(np.float32) * 3
    cases = [
        (dict(temperature=0.7), [lp.TemperatureLogitsWarper(0.7)]),
        (dict(top_k=5), [lp.TopKLogitsWarper(5)]),
        (dict(top_p=0.8), [lp.TopPLogitsWarper(0.8)]),
        (
            dict(temperature=1.5, top_k=20, top_p=0.6),
            [lp.TemperatureLogitsWarper(1.5), lp.TopKLogitsWarper(20), lp.TopPLogitsWarper(0.6)],
        ),
    ]
    for kw, warpers in cases:
        want = torch.as_tensor(logits)
        for warper in warpers:
            want = warper(None, want)
        got = np.asarray(filter_logits(jnp.asarray(logits), **kw))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want.numpy()), err_msg=str(kw))
        np.testing.assert_allclose(got[~np.isinf(got)], want.numpy()[~np.isinf(got)], rtol=1e-6, err_msg=str(kw))


@pytest.mark.parametrize("spread", [8.0, 0.01])
def test_the_nucleus_of_a_large_vocabulary_is_transformers(spread):
    """A 5000-token vocabulary: peaked logits (the nucleus among the 1024 most likely tokens) and nearly flat
    ones (it is not: every token sorted), a top_p per row, as transformers' warper of each row's top_p."""
    from transformers.generation import logits_process as lp

    logits = (np.random.RandomState(1).randn(3, 5000) * spread).astype(np.float32)
    top_p = np.array([0.5, 0.9, 0.99], np.float32)
    got = np.asarray(filter_logits(jnp.asarray(logits), top_p=jnp.asarray(top_p)[:, None]))
    for row, p in enumerate(top_p):
        want = lp.TopPLogitsWarper(float(p))(None, torch.as_tensor(logits[row : row + 1])).numpy()[0]
        np.testing.assert_array_equal(np.isinf(got[row]), np.isinf(want), err_msg=f"top_p {p}")
    kept = (~np.isinf(got)).sum(-1)
    assert (kept[-1] > 1024) == (spread < 1)  # which of the two ways found it


@pytest.mark.parametrize(
    "kw, expected",
    [
        (dict(), [0.5, 0.2, 0.15, 0.1, 0.05]),
        (dict(top_k=2), np.array([0.5, 0.2, 0, 0, 0]) / 0.7),
        (dict(top_p=0.75), np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85),  # 0.5 + 0.2 < 0.75 <= 0.5 + 0.2 + 0.15
        (dict(temperature=0.5), np.array([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2 / 0.325),  # softmax(log p / T) ~ p**2
        # at T=2 the probabilities go as sqrt(p): 0.34, 0.21, 0.19, ...; the 0.5 nucleus holds the first two
        (dict(temperature=2.0, top_p=0.5), np.sqrt([0.5, 0.2]) / np.sqrt([0.5, 0.2]).sum()),
    ],
)
def test_sampling_frequencies_follow_the_filtered_distribution(kw, expected):
    """40000 draws: each frequency within 5 standard errors (<= 0.0125) of the renormalised softmax."""
    draws = 40_000
    logits = jnp.tile(jnp.log(jnp.asarray([0.5, 0.2, 0.15, 0.1, 0.05])), (draws, 1))
    tokens = choose_tokens(logits, jax.random.key(0), do_sample=True, **kw)
    freq = np.bincount(np.asarray(tokens), minlength=5) / draws
    expected = np.pad(expected, (0, 5 - len(expected)))
    assert np.abs(freq - expected).max() < 0.0125, (freq, expected)
    assert (freq[expected == 0] == 0).all()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(name)``: the folder of a random CONFIGS[name] model, saved once per module."""
    paths = {}

    def get(name):
        if name not in paths:
            torch.manual_seed(0)
            paths[name] = tmp_path_factory.mktemp(f"{name}-checkpoint")
            CONFIGS[name]().save_pretrained(paths[name])
        return paths[name]

    return get


@pytest.fixture(scope="module")
def gpt2(checkpoint):
    return checkpoint("gpt2")


SAMPLE = dict(max_new_tokens=NEW, do_sample=True, temperature=1.3, top_p=0.95)


def test_sampling_is_seeded_and_top_k_1_is_greedy(gpt2):
    model = load_pretrained(gpt2, "causal-lm")
    ids, mask = prompts()
    a, b = (np.asarray(generate(model, ids, mask, seed=1, **SAMPLE).sequences) for _ in range(2))
    c = np.asarray(generate(model, ids, mask, seed=2, **SAMPLE).sequences)
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.5
    greedy = np.asarray(generate(model, ids, mask, max_new_tokens=NEW).sequences)
    assert (a != greedy).mean() > 0.5
    top1 = generate(model, ids, mask, max_new_tokens=NEW, do_sample=True, top_k=1, temperature=0.5, seed=3)
    np.testing.assert_array_equal(np.asarray(top1.sequences), greedy)


def test_one_compiled_program_per_bucket(gpt2):
    """Prompt widths 12 and 20 share the 32-token bucket; temperature, top_p, seed and min_new_tokens are
    inputs of the program, so changing them compiles nothing new."""
    model = load_pretrained(gpt2, "causal-lm")
    generate(model, *prompts((12, 7, 3)), **{**SAMPLE, "temperature": 0.9, "top_p": 0.9, "seed": 0})
    generate(model, *prompts((20, 5, 1)), **{**SAMPLE, "temperature": 1.2, "top_p": 0.5, "seed": 4}, min_new_tokens=3)
    settings = Settings(
        max_new_tokens=NEW,
        do_sample=True,
        top_k=0,
        use_top_p=True,
        eos=(),
        pad=0,
        return_logprobs=False,
        decoder_start=None,
        mesh=None,
    )
    assert cached_program(ProgramKey(nnx.graphdef(model), settings))._cache_size() == 1


@pytest.mark.parametrize(
    "name, kw",
    [("gpt2", dict(max_new_tokens=NEW)), ("gpt2", SAMPLE), ("t5", dict(max_new_tokens=NEW))],
    ids=["gpt2-greedy", "gpt2-sampled", "t5-greedy"],
)
def test_mesh_dp2_mp4_equals_single_device(checkpoint, name, kw):
    """Parameters sharded by the family's rules, a batch of 3 padded to 4 and split over dp; the same tokens,
    sampled ones included (the same seed draws the same numbers whatever the sharding)."""
    task = "seq2seq-lm" if name == "t5" else "causal-lm"
    ids, mask = prompts()
    single = generate(load_pretrained(checkpoint(name), task), ids, mask, seed=5, **kw)
    model = load_pretrained(checkpoint(name), task, mesh=make_mesh("dp=2,mp=4"))
    assert all(len(leaf.sharding.device_set) == 8 for leaf in jax.tree.leaves(nnx.state(model)))
    sharded = generate(model, ids, mask, seed=5, **kw)
    np.testing.assert_array_equal(np.asarray(sharded.sequences), np.asarray(single.sequences))


@pytest.mark.parametrize("name, mesh", [("gpt2", None), ("gpt2", "dp=2,mp=4"), ("t5", None)])
def test_samples_of_a_prompt_share_its_prefill_and_draw_as_repeated_prompts(checkpoint, name, mesh):
    """``num_return_sequences`` sampled completions of each prompt, from one prefill copied to each: bitwise the
    tokens of the prompts repeated that many times (9 rows, 10 decoded on dp=2 either way)."""
    task = "seq2seq-lm" if name == "t5" else "causal-lm"
    model = load_pretrained(checkpoint(name), task, mesh=mesh and make_mesh(mesh))
    ids, mask = prompts()
    shared = generate(model, ids, mask, seed=7, num_return_sequences=3, return_logprobs=True, **SAMPLE)
    repeated = generate(model, np.repeat(ids, 3, 0), np.repeat(mask, 3, 0), seed=7, return_logprobs=True, **SAMPLE)
    assert shared.sequences.shape == (9, NEW)
    np.testing.assert_array_equal(np.asarray(shared.sequences), np.asarray(repeated.sequences))
    np.testing.assert_allclose(np.asarray(shared.logprobs), np.asarray(repeated.logprobs), rtol=1e-5, atol=1e-5)
    assert len({tuple(row) for row in np.asarray(shared.sequences)[:3]}) > 1  # a prompt's samples differ


def test_bad_arguments_are_one_line_errors(gpt2):
    model = load_pretrained(gpt2, "causal-lm")
    ids, mask = prompts()
    with pytest.raises(JaxseqError, match="no tokens"):
        generate(model, ids, mask * np.array([[1], [0], [1]]), max_new_tokens=4)
    with pytest.raises(JaxseqError, match="exceeds the model's 64 positions"):
        generate(model, ids, mask, max_new_tokens=53)
    with pytest.raises(JaxseqError, match="top_p"):
        generate(model, ids, mask, max_new_tokens=4, do_sample=True, top_p=0.0)


def test_a_llama_prompt_is_checked_against_its_positions():
    """Llama-family configs name their limit max_position_embeddings (GPT-2's n_positions): checked alike."""
    from jaxseq.models import from_config

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    ids, mask = prompts()
    with pytest.raises(JaxseqError, match="exceeds the model's 64 positions"):
        generate(from_config(config, "causal-lm"), ids, mask, max_new_tokens=53)


# --------------------------------------------------------------------------- scripts/generate.py


def load_script():
    """``jaxseq generate`` (scripts/generate.py), to call its ``main(argv)`` in this process."""
    from jaxseq.commands import generate as command

    return command


@pytest.fixture(scope="module")
def gpt2_with_tokenizer(tmp_path_factory):
    """A tiny random GPT-2 over the real GPT-2 vocabulary, saved with the real GPT-2 tokenizer."""
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, initializer_range=0.3)
    ).eval()
    path = tmp_path_factory.mktemp("gpt2-tokenizer")
    ref.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, ref, tokenizer


def test_script_writes_the_completions_of_pytorch_greedy(gpt2_with_tokenizer, tmp_path, capsys):
    path, ref, tokenizer = gpt2_with_tokenizer
    texts = ["The quick brown fox", "Hello", "In 1905, Einstein published four papers that"]
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": t, "id": i}) + "\n" for i, t in enumerate(texts))
    )
    out = tmp_path / "out" / "completions.jsonl"
    code = load_script().main(
        [
            "--model_name_or_path",
            str(path),
            "--prompt_file",
            str(tmp_path / "prompts.jsonl"),
            "--output_file",
            str(out),
            "--max_new_tokens",
            "12",
            "--batch_size",
            "2",
            "--compilation_cache_dir",
            "",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0, err
    assert "generating" in err and "3/3" in err and "tokens/s" in err  # the bar counts finished prompts
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == texts
    for record in records:
        ids = tokenizer(record["prompt"], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            want = ref.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=50256)[0, ids.shape[1] :]
        assert record["prompt_tokens"] == ids.shape[1]
        assert record["completion_tokens"] == len(want)
        assert record["completion"] == tokenizer.decode(want, skip_special_tokens=True)


def test_script_samples_several_completions_of_a_prompt(gpt2_with_tokenizer, tmp_path):
    """``--do_sample --num_return_sequences 3``: each record's ``completions`` are its prompt's samples, sample j
    of prompt i drawn as the engine draws a request of seed (--seed, i, j) alone; the first is ``completion``."""
    from jaxseq.engine import Engine, SamplingParams

    path, _, tokenizer = gpt2_with_tokenizer
    out = tmp_path / "completions.jsonl"
    texts = ["The quick brown fox", "Hello"]
    argv = ["--model_name_or_path", str(path), "--prompt", texts[0], "--prompt", texts[1], "--max_new_tokens", "6",
            "--do_sample", "--temperature", "1.5", "--top_k", "50", "--num_return_sequences", "3", "--seed", "4",
            "--output_file", str(out), "--compilation_cache_dir", ""]  # fmt: skip
    assert load_script().main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    model = load_pretrained(path, "causal-lm")
    for i, (text, record) in enumerate(zip(texts, records)):
        want = []
        for j in range(3):
            seed = int(np.random.SeedSequence([4, i, j]).generate_state(1)[0])
            alone = Engine(model, tokenizer, max_batch_size=1, max_len=64, eos_token_ids=[tokenizer.eos_token_id],
                           top_k=50)  # fmt: skip
            params = SamplingParams(max_tokens=6, temperature=1.5, seed=seed)
            want.append(alone.generate([tokenizer(text)["input_ids"]], params)[0].text)
        assert record["completions"] == want and record["completion"] == want[0]
    assert len({t for r in records for t in r["completions"]}) > 3


def test_script_reads_stdin_and_prints(gpt2_with_tokenizer, monkeypatch, capsys):
    path, _, _ = gpt2_with_tokenizer
    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time\nThe end\n"))
    code = load_script().main(
        [
            "--model_name_or_path",
            str(path),
            "--max_new_tokens",
            "6",
            "--do_sample",
            "--top_k",
            "10",
            "--compilation_cache_dir",
            "",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    first, second = captured.out.rstrip("\n").split("\n\n")
    assert first.startswith("Once upon a time") and len(first) > len("Once upon a time")
    assert second.startswith("The end")
    assert "2 prompts, 12 tokens generated" in captured.err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "Hello", "--prompt", "  "], "the prompt at --prompt #2 is empty"),
        (["--prompt", " ".join(["word"] * 60)], "prompt 1 has 60 token(s); with --max_new_tokens 8 that exceeds"),
        (["--prompt_file", "prompts.jsonl"], "line 1 of prompts.jsonl has no string 'prompt' field"),
        (["--prompt", "a", "--batch_size", "0"], "--batch_size must be at least 1"),
        (["--prompt_file", "missing.txt"], "prompt file missing.txt does not exist"),
        (["--prompt", "a", "--num_beams", "2", "--num_return_sequences", "3"], "between 1 and num_beams (2)"),
    ],
)
def test_script_bad_input_is_one_line_and_exit_1(gpt2_with_tokenizer, tmp_path, monkeypatch, capsys, args, message):
    path, _, _ = gpt2_with_tokenizer
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"text": "no prompt field"}) + "\n")
    code = load_script().main(["--model_name_or_path", str(path), "--max_new_tokens", "8", *args])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_docs_generation_example(capsys):
    from tests.test_readme import API_PAGE, section_code

    scope = {}
    exec(compile(section_code("Generation", API_PAGE), "api.md", "exec"), scope)
    out, sampled, beams = scope["out"], scope["sampled"], scope["beams"]
    assert out.sequences.shape == sampled.logprobs.shape == (2, 16)
    assert beams.sequences.shape == (4, 16) and (np.diff(np.asarray(beams.sequences_scores).reshape(2, 2)) <= 0).all()
    assert (np.asarray(sampled.logprobs) <= 0).all() and (np.asarray(sampled.logprobs) < 0).any()
    assert "[[" in capsys.readouterr().out
