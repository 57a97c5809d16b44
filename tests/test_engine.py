"""The generation engine (``jaxseq.engine``): greedy continuations equal transformers' ``generate`` token for
token under continuous batching (requests joining and leaving mid-flight, more requests than slots, prompts
of different lengths in different buckets), for a Llama (grouped-query attention, RoPE, a scanned stack) and a
GPT-2 (learned positions); a sampled request draws the same tokens whatever runs beside it; stop strings,
EOS and the token budget end a request; requests that cannot fit stop in one line."""

import jax
import numpy as np
import pytest

from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from jaxseq.engine import Engine, SamplingParams  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.models import load_pretrained  # noqa: E402
from jaxseq.models.execution import Execution  # noqa: E402
from jaxseq.models.registry import families_with  # noqa: E402
from tests.reference import perturb  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a king who had three daughters and",
    "To be",
    "It was the best of times, it was the worst of times",
    "A",
    "The capital of France is Paris and the capital of Italy is",
]


@pytest.fixture(scope="module")
def tok():
    folder = shared_asset("data/tokenizers/gpt2")
    return transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def folder(request, tok, tmp_path_factory):
    """A tiny perturbed model of the family, and its PyTorch original."""
    root = tmp_path_factory.mktemp(f"engine-{request.param}")
    positions = {"llama": "max_position_embeddings", "gpt2": "n_positions"}[request.param]
    config = tiny_config(request.param, vocab_size=len(tok), eos_token_id=tok.eos_token_id, **{positions: 256})
    cls = {"llama": transformers.LlamaForCausalLM, "gpt2": transformers.GPT2LMHeadModel}[request.param]
    torch.manual_seed(0)
    model = perturb(cls(config), std=0.05).eval()
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root, model, request.param


def hf_greedy(model, tok, prompt: str, max_new_tokens: int) -> list[int]:
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tok.eos_token_id)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def test_greedy_continuations_equal_transformers_under_continuous_batching(folder, tok):
    root, reference, family = folder
    execution = Execution(scan_layers=family == "llama")
    engine = Engine(load_pretrained(root, "causal-lm", execution=execution), tok, max_batch_size=3, max_len=128)
    budgets = [12, 5, 20, 9, 16, 7]
    requests = []
    for i, (prompt, budget) in enumerate(zip(PROMPTS, budgets)):  # one joins every other step
        requests.append(engine.add(tok(prompt)["input_ids"], SamplingParams(max_tokens=budget, temperature=0)))
        if i % 2:
            engine.step()
    seen_full = False
    while engine.busy:
        engine.step()
        seen_full |= len(engine.running) == 3
    assert seen_full  # the slots were shared, several requests at a time
    for request, prompt, budget in zip(requests, PROMPTS, budgets):
        want = hf_greedy(reference, tok, prompt, budget)
        assert request.tokens == want[: len(request.tokens)], (prompt, request.tokens, want)
        assert request.finish_reason == ("stop" if tok.eos_token_id in want else "length")
        assert request.text == tok.decode(request.tokens, skip_special_tokens=True)


def test_a_sampled_request_draws_the_same_whatever_runs_beside_it(folder, tok):
    root, _, _ = folder
    model = load_pretrained(root, "causal-lm")
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7)
    alone = Engine(model, tok, max_batch_size=1, max_len=64).generate([tok("To be")["input_ids"]], params)[0]
    crowd = Engine(model, tok, max_batch_size=4, max_len=64)
    others = [crowd.add(tok(p)["input_ids"], SamplingParams(max_tokens=6, temperature=1.0)) for p in PROMPTS[:2]]
    crowd.step()
    mine = crowd.add(tok("To be")["input_ids"], params)
    while crowd.busy:
        crowd.step()
    assert mine.tokens == alone.tokens and all(o.finished for o in others)
    other_seed = Engine(model, tok, max_batch_size=1, max_len=64).generate(
        [tok("To be")["input_ids"]], SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=8)
    )[0]
    assert other_seed.tokens != alone.tokens


def test_stop_strings_eos_and_budgets_end_requests(folder, tok):
    """A stop string cuts the text before it; an EOS id ends a request (not before its min_tokens, where the
    tokens are transformers' with min_new_tokens); the budget ends it; requests past the positions stop in one
    line."""
    root, reference, _ = folder
    engine = Engine(load_pretrained(root, "causal-lm"), tok, max_batch_size=2, max_len=64)
    greedy = engine.generate([tok(PROMPTS[0])["input_ids"]], SamplingParams(max_tokens=12, temperature=0))[0]
    text = greedy.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    cut = engine.generate([tok(PROMPTS[0])["input_ids"]], SamplingParams(max_tokens=12, temperature=0, stop=(stop,)))
    assert cut[0].finish_reason == "stop" and cut[0].text == text[: text.find(stop)]
    first = greedy.tokens[0]
    ended = Engine(load_pretrained(root, "causal-lm"), tok, max_batch_size=2, max_len=64, eos_token_ids=[first])
    request = ended.generate([tok(PROMPTS[0])["input_ids"]], SamplingParams(max_tokens=12, temperature=0))[0]
    assert request.tokens == [first] and request.finish_reason == "stop"
    held = ended.generate([tok(PROMPTS[0])["input_ids"]], SamplingParams(max_tokens=8, temperature=0, min_tokens=4))
    ids = torch.tensor([tok(PROMPTS[0])["input_ids"]])
    with torch.no_grad():  # transformers' MinNewTokensLengthLogitsProcessor
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=4,
                                 do_sample=False, eos_token_id=first, pad_token_id=first)  # fmt: skip
    want = out[0, ids.shape[1] :].tolist()
    want = want[: want.index(first) + 1] if first in want else want  # padded after its EOS
    assert held[0].tokens == want and len(want) > 4
    with pytest.raises(JaxseqError, match="exceeds the engine's 64 positions"):
        engine.add(list(range(60)), SamplingParams(max_tokens=8))
    with pytest.raises(JaxseqError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    np.testing.assert_array_equal(engine.start, 0)  # every slot free again


def test_requests_of_a_running_prompt_copy_its_slot_instead_of_a_prefill(folder, tok):
    """Three samples of one prompt (as an API request's ``n``) prefill it once, and one more sent while they run
    is copied from a slot that has decoded past its prompt: each draws the tokens it draws alone."""
    root, _, _ = folder
    model = load_pretrained(root, "causal-lm")
    prompt = tok(PROMPTS[3])["input_ids"]
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=s) for s in (1, 2, 3, 4)]
    alone = [Engine(model, tok, max_batch_size=1, max_len=64).generate([prompt], p)[0].tokens for p in params]
    engine = Engine(model, tok, max_batch_size=4, max_len=64)
    group = [engine.add(prompt, p) for p in params[:3]]
    for _ in range(3):
        engine.step()
    late = engine.add(prompt, params[3])
    while engine.busy:
        engine.step()
    assert [r.tokens for r in (*group, late)] == alone
    assert engine.stats == {"prefills": 1, "forks": 3}
    assert len({tuple(t) for t in alone}) > 1


def test_sliding_window_layers_decode_from_rolling_caches_as_transformers(tok, tmp_path):
    """A Gemma 3 whose sliding layers (a window of 6) keep rolling caches of 6 positions beside full ones:
    prompts and answers longer than the window, under continuous batching, equal transformers' greedy tokens. A
    request of a running prompt copies its slot only while that slot has decoded nothing (its first token would
    overwrite the window's oldest keys), else its prompt is prefilled."""
    config = tiny_config("gemma3_text", vocab_size=len(tok), eos_token_id=tok.eos_token_id, sliding_window=6,
                         layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    reference = perturb(transformers.Gemma3ForCausalLM(config), std=0.05).eval()
    reference.save_pretrained(tmp_path)
    engine = Engine(load_pretrained(tmp_path, "causal-lm"), tok, max_batch_size=4, max_len=64)
    assert engine.rolling and {leaf.shape[-2] for leaf in jax.tree.leaves(engine.cache.layers)} == {6, 64}
    greedy = SamplingParams(max_tokens=12, temperature=0)
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[3], PROMPTS[1], PROMPTS[5], PROMPTS[0]]
    requests = [engine.add(tok(p)["input_ids"], greedy) for p in prompts[:2]]  # the second copies the first
    engine.step()
    engine.step()
    requests += [engine.add(tok(p)["input_ids"], greedy) for p in prompts[2:]]  # the fourth: prefilled again
    while engine.busy:
        engine.step()
    for request, prompt in zip(requests, prompts):
        assert request.tokens == hf_greedy(reference, tok, prompt, 12)[: len(request.tokens)], prompt
    assert engine.stats == {"prefills": 5, "forks": 1}


def word_tokenizer(size: int):
    """A word-level tokenizer of ``size`` tokens, ``t0`` (also its padding) to ``t{size-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", unk_token="t0")


@pytest.mark.parametrize("model_type", families_with("causal-lm"))
def test_every_causal_family_decodes_in_the_engine_as_generate_does(model_type):
    """Each causal family's tiny config (sliding windows of 6 where it has them), randomly initialised at a
    large scale: the engine's greedy tokens, three prompts of 3 to 10 tokens sharing two slots, equal
    ``generation.generate``'s for the prompts as one left-padded batch."""
    from jaxseq.generation import generate
    from jaxseq.models import from_config

    config = tiny_config(model_type, initializer_range=0.3)
    if getattr(config, "sliding_window", None):
        config.sliding_window = 6
    model = from_config(config, "causal-lm", seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, n).tolist() for n in (10, 3, 7)]
    engine = Engine(model, word_tokenizer(config.vocab_size), max_batch_size=2, max_len=32, eos_token_ids=[])
    got = [r.tokens for r in engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))]
    ids = np.array([[0] * (10 - len(p)) + p for p in prompts], np.int32)
    mask = (np.arange(10)[None] >= 10 - np.array([len(p) for p in prompts])[:, None]).astype(np.int32)
    want = np.asarray(generate(model, ids, mask, max_new_tokens=8).sequences).tolist()
    assert got == want
