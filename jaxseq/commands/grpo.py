"""Train a causal language model with GRPO on rewards you compute, as TRL's GRPOTrainer.

    jaxseq grpo --model_name_or_path path/to/sft-model --train_file prompts.jsonl \\
        --reward_funcs rewards.py:correct --num_generations 8 --max_completion_length 256 \\
        --per_device_train_batch_size 32 --output_dir out/grpo --learning_rate 1e-6 --max_steps 500

Prompts come from .jsonl/.json files or a Hub dataset: records with "prompt", a string or a conversation (a list
of {"role", "content"}, rendered with the tokenizer's chat template or --chat_template, the generation prompt
added, as TRL; a record's "tools", JSON schemas of functions, are shown to the template as TRL shows its
trainer's tools, though no tool is called). Each step samples --num_generations completions of each prompt from
the weights being trained (jaxseq.generation: the same arrays, one compiled sampler for the whole run), scores
them with every --reward_funcs (called as TRL calls them: prompts, completions, completion_ids and the records'
other columns as keyword lists; completions are strings, or [{"role": "assistant", "content": ...}] for
conversations), weighs them (--reward_weights), normalises them within each prompt's group into advantages and
takes --num_iterations updates of the clipped surrogate on them, with a k3 KL to the reference when --beta > 0.
A --reward_funcs that is not file.py:function is a reward model: a folder (or Hub id) of a sequence classifier
with one label, as jaxseq reward writes it, mixed freely with functions (--reward_funcs out/reward
rewards.py:correct --reward_weights 1.0 0.5). It scores as TRL's GRPOTrainer scores with one: prompt + completion
(conversations: their messages through the reward model's own tokenizer's chat template), tokenised by its own
tokenizer (EOS pads where it has no pad token) without special tokens, right-padded; the reward is its output
at the last token. It runs in JAX on the run's devices (--mesh), weights sharded as the policy's, computing in
--dtype, one compiled program for the run; its figures are named after the folder (rewards/<folder>/mean).
--reward_funcs and --reward_weights are lists as TRL's (--reward_weights 1.0 0.5), or repeated flags.
--per_device_train_batch_size counts completions, as TRL's: a step trains on per_device x data-parallel devices x
--gradient_accumulation_steps completions (the global batch), sampled together as whole groups of
--num_generations, global batch / --num_generations prompts (TRL's rule: it must be divisible); an epoch is every
prompt once (prompts x --num_generations completions, the run's train_samples). Several processes
(--coordinator_address, --num_processes, --process_id) sample what one process does: the sampler is one program
over the whole mesh, each device drawing its own rows (keyed by the seed, the step and the row, not by the
process layout); each process scores the completions it trains on with the reward functions (TRL's way), and
the rewards are gathered before each group is normalised, so a group may span processes. Logged every
--logging_steps as TRL logs them: reward, reward_std, rewards/<func>/mean and /std, frac_reward_zero_std,
completions/mean_length (min, max, clipped_ratio, terminated lengths), kl (with --beta), entropy,
clip_ratio/low_mean, high_mean, region_mean, low_min, high_max.
Writes to --output_dir what every job writes, and the model with its tokenizer as a Hugging Face folder.
--compile_topology plans the run for a TPU slice: its train step on a step's completions (the longest prompt +
--max_completion_length tokens each; the prompts read only for their length, else --max_prompt_length) and its
sampler's program, both in plan.json (the sampler's memory under "sampler"); no weights are read.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxseq import generation
from jaxseq.cli import script
from jaxseq.config import arg
from jaxseq.data.chat import template_kwargs, use_chat_template
from jaxseq.data.records import read_records, require_columns
from jaxseq.data.text import load_hub_dataset
from jaxseq.errors import JaxseqError
from jaxseq.harness import EvalTasksConfig
from jaxseq.mesh import batch_sharding, data_parallel_size
from jaxseq.models import load_pretrained
from jaxseq.models.hub import load_config, resolve
from jaxseq.models.source import ModelSource, load_tokenizer, pad_with_eos, stop_token_ids
from jaxseq.plan import compile_plan
from jaxseq.runner import Job, Prepared, Setup, run
from jaxseq.train.rl import GRPO, GRPOConfig, RewardModel, Rollout, prompts_per_step

TASK = "causal-lm"


@dataclasses.dataclass
class PromptDataConfig:
    train_file: str | None = arg(
        None, "training prompts: .jsonl or .json records with a prompt (and any other columns)"
    )
    dataset_name: str | None = arg(None, "Hugging Face Hub dataset of prompts instead of --train_file")
    dataset_config_name: str | None = arg(None, "configuration of --dataset_name")
    max_prompt_length: int | None = arg(None, "cut each prompt to its last N tokens (TRL 0.x's flag; default: whole)")
    chat_template: str | None = arg(
        None, "a Jinja chat template, or a file holding one, for conversations and a tokenizer without its own"
    )
    max_train_samples: int | None = arg(None, "use only the first N prompts")

    def __post_init__(self):
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise JaxseqError(f"--max_prompt_length must be at least 1, got {self.max_prompt_length}")


def load_prompts(config: PromptDataConfig) -> list[dict]:
    """The prompt records of the configured file or Hub dataset's train split."""
    if config.dataset_name:
        splits = load_hub_dataset(config.dataset_name, config.dataset_config_name)
        if "train" not in splits:
            raise JaxseqError(f"dataset {config.dataset_name!r} has no train split (it has {', '.join(splits)})")
        records, where = [dict(r) for r in splits["train"]], config.dataset_name
    elif config.train_file:
        records, where = read_records(config.train_file), config.train_file
    else:
        raise JaxseqError("give the prompts: --train_file FILE.jsonl or --dataset_name NAME")
    if not records or not isinstance(records[0], dict):
        raise JaxseqError(f"{where} has no prompt records (objects with a prompt)")
    require_columns(records, ["prompt"], where)
    return records[: config.max_train_samples]


def prompt_rows(tokenizer, records: list[dict], max_prompt_length: int | None, pad: int) -> dict[str, np.ndarray]:
    """Prompts tokenised as TRL's ``_tokenize_prompts`` (conversations through the chat template with the
    generation prompt and the record's ``tools``, where TRL gives the trainer's), cut to their last
    ``max_prompt_length`` tokens, left-padded to the longest."""
    if isinstance(records[0]["prompt"], list):
        encoded = [
            tokenizer.apply_chat_template(
                r["prompt"],
                tools=template_kwargs(r, f"prompt {i + 1}")["tools"] or None,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
            for i, r in enumerate(records)
        ]
    else:
        encoded = tokenizer([r["prompt"] for r in records])["input_ids"]
    encoded = [list(ids)[-max_prompt_length:] if max_prompt_length else list(ids) for ids in encoded]
    if not all(encoded):
        raise JaxseqError("a prompt has no tokens; every prompt needs at least one")
    width = max(map(len, encoded))
    ids = np.full((len(encoded), width), pad, np.int32)
    mask = np.zeros((len(encoded), width), np.int32)
    for i, row in enumerate(encoded):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "prompt_index": np.arange(len(encoded), dtype=np.int32)}


def is_function_spec(spec: str) -> bool:
    """Whether ``spec`` names a Python function (``path/to/file.py:function``, or an existing file's); anything
    else names a reward model (a folder or Hub id)."""
    path, colon, _ = spec.rpartition(":")
    return bool(colon) and (path.endswith(".py") or Path(path).is_file())


def load_reward_funcs(specs: list[str] | None, *, mesh=None, dtype: str = "float32") -> list[tuple[str, object]]:
    """(name, function) of each spec: a ``path/to/file.py:function``, named as the function (TRL's name), or a
    reward model (``load_reward_model``), named as the tail of its folder or Hub id (TRL's, from the model's
    ``config._name_or_path``)."""
    if not specs:
        raise JaxseqError(
            "give at least one reward function: --reward_funcs path/to/file.py:function, or a reward model folder"
        )
    funcs = []
    for spec in specs:
        if not is_function_spec(spec):
            funcs.append(load_reward_model(spec, mesh=mesh, dtype=dtype))
            continue
        path, _, name = spec.rpartition(":")
        if not path or not name:
            raise JaxseqError(f"--reward_funcs {spec!r} is not path/to/file.py:function")
        if not Path(path).is_file():
            raise JaxseqError(f"--reward_funcs {spec!r}: file {path} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"jaxseq_rewards_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        func = getattr(module, name, None)
        if not callable(func):
            raise JaxseqError(f"--reward_funcs {spec!r}: {path} defines no function {name}")
        funcs.append((getattr(func, "__name__", name), func))
    return funcs


def load_reward_model(spec: str, *, mesh=None, dtype: str = "float32") -> tuple[str, RewardModel]:
    """(name, scorer) of the reward model ``spec``, a folder or Hub id, as TRL's GRPOTrainer loads a reward
    model given by name: a sequence classifier with one label, its own tokenizer (AutoTokenizer of the same
    folder) with EOS as its pad token where it has none, and that pad token the model's; on ``mesh``, computing
    in ``dtype``. Anything that is not such a model: a one-line error."""
    what = (
        f"--reward_funcs {spec!r} is neither path/to/file.py:function nor a reward model (a folder with "
        "config.json, or a Hub id)"
    )
    if spec.endswith(".py") or not spec.strip():
        raise JaxseqError(what)
    local = Path(spec).expanduser()
    if local.is_dir() and not (local / "config.json").is_file():
        raise JaxseqError(
            f"--reward_funcs {spec!r} is a folder without config.json, not a reward model (a sequence classifier "
            "with one label, what jaxseq reward writes)"
        )
    try:
        folder = resolve(spec)
        config = load_config(folder)
    except JaxseqError as e:
        raise JaxseqError(f"{what}: {e}") from None
    heads = [a for a in (config.architectures or []) if not a.endswith("ForSequenceClassification")]
    if config.architectures and heads:
        raise JaxseqError(
            f"--reward_funcs {spec!r} is a {heads[0]}, not a reward model: a sequence classifier with one label "
            "(what jaxseq reward writes)"
        )
    if config.architectures and config.num_labels != 1:
        raise JaxseqError(
            f"--reward_funcs {spec!r} is a classifier of {config.num_labels} labels; a reward model has one"
        )
    try:
        tokenizer = pad_with_eos(load_tokenizer(folder, fast=False))
    except JaxseqError as e:
        raise JaxseqError(f"--reward_funcs {spec!r}: {e}") from None
    model = load_pretrained(
        folder,
        "sequence-classification",
        mesh=mesh,
        dtype=jnp.dtype(dtype),
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    name = spec.rstrip("/").split("/")[-1]
    return name, RewardModel(model, tokenizer, name)


def prepare(setup: Setup) -> Prepared:
    """Prompt rows and the GRPO objective with its rollout."""
    args = setup.args
    data, grpo, trainer = args.data, args.grpo, args.trainer
    args.stages.stages((True, False))  # it only trains: stage flags that ask for nothing end here
    if setup.planning:
        return planned(setup)
    devices = data_parallel_size(setup.mesh)
    accumulate = trainer.gradient_accumulation_steps
    step_prompts = prompts_per_step(trainer.per_device_train_batch_size, devices, accumulate, grpo.num_generations)
    config = setup.config
    funcs = load_reward_funcs(grpo.reward_funcs, mesh=setup.mesh, dtype=args.runtime.dtype)
    tokenizer = setup.tokenizer
    records = load_prompts(data)
    micro_batch = trainer.per_device_train_batch_size * devices
    for _, func in funcs:  # a reward model scores a micro-batch of completions at a time, all of one shape
        if isinstance(func, RewardModel):
            func.size(micro_batch, [r["prompt"] for r in records], grpo.max_completion_length)
    if isinstance(records[0]["prompt"], list):
        use_chat_template(tokenizer, data.chat_template)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train = prompt_rows(tokenizer, records, data.max_prompt_length, pad)
    prompts, width = train["input_ids"].shape
    if prompts < step_prompts:
        raise JaxseqError(
            f"{prompts} prompts do not fill one step's {step_prompts} (--per_device_train_batch_size "
            f"{trainer.per_device_train_batch_size} x {devices} device(s) x --gradient_accumulation_steps "
            f"{accumulate} completions / --num_generations {grpo.num_generations}); give more prompts or lower "
            "--per_device_train_batch_size"
        )
    eos = stop_token_ids(tokenizer, config)
    rollout = Rollout(grpo, tokenizer, records, funcs, seed=trainer.seed, eos_token_ids=eos, prompts=train)
    main_process = jax.process_index() == 0
    if main_process:
        print(f"reward functions: {', '.join(name for name, _ in funcs)}")
    return Prepared(
        objective=GRPO(grpo, rollout),
        train=completion_slots(prompts, grpo.num_generations),
        seq_len=width + grpo.max_completion_length,
        summary=lambda _: (
            f"{prompts:,} prompts of at most {width} tokens, {grpo.num_generations} completions each of at most "
            f"{grpo.max_completion_length} tokens; a step samples {step_prompts} prompts x {grpo.num_generations} "
            f"= {step_prompts * grpo.num_generations} completions ({trainer.per_device_train_batch_size} per "
            f"device); loss {grpo.loss_type}, beta {grpo.beta}, {grpo.num_iterations} update(s) per sampled batch"
        ),
    )


def planned(setup: Setup) -> Prepared:
    """A plan's GRPO: the train step of a step's completions (--per_device_train_batch_size rows of the longest
    prompt + --max_completion_length tokens, with their advantages and completion mask, the old log-probs with
    --num_iterations > 1; the reference's come from the frozen weights inside the step with --beta) and the
    sampler's program. No weights are read, nor reward models; the prompts only for their length, else
    --max_prompt_length is it."""
    args = setup.args
    data, grpo, trainer = args.data, args.grpo, args.trainer
    prompts_per_step(
        trainer.per_device_train_batch_size,
        data_parallel_size(setup.mesh),
        trainer.gradient_accumulation_steps,
        grpo.num_generations,
    )  # TRL's rule, before anything compiles
    if data.train_file or data.dataset_name:
        if setup.tokenizer_name is None:
            raise JaxseqError(
                "a GRPO plan reads the prompts for their length with the tokenizer: pass --tokenizer_name (or "
                "--model_name_or_path), or --max_prompt_length instead of the prompts"
            )
        records, tokenizer = load_prompts(data), setup.tokenizer
        if isinstance(records[0]["prompt"], list):
            use_chat_template(tokenizer, data.chat_template)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        width = prompt_rows(tokenizer, records, data.max_prompt_length, pad or 0)["input_ids"].shape[1]
    elif data.max_prompt_length:
        width = data.max_prompt_length
    else:
        raise JaxseqError(
            "a GRPO plan needs the prompts' length: pass --max_prompt_length N, or the prompts (--train_file or "
            "--dataset_name) with a tokenizer"
        )
    completion = grpo.max_completion_length
    seq = width + completion
    row = {
        "input_ids": ((seq,), np.int32),
        "attention_mask": ((seq,), np.int32),
        "completion_mask": ((completion,), np.int32),
        "advantages": ((), np.float32),
    }
    if grpo.num_iterations > 1:
        row["old_logps"] = ((completion,), np.float32)
    config = setup.config
    eos = [int(e) for e in np.atleast_1d(config.eos_token_id if config.eos_token_id is not None else 0)]
    pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else eos[0]
    rows = trainer.per_device_train_batch_size * data_parallel_size(setup.mesh) * trainer.gradient_accumulation_steps
    sampler = functools.partial(plan_sampler, rows=rows, prompt_length=width, config=grpo, eos=eos, pad=pad)
    return Prepared(objective=GRPO(grpo), seq_len=seq, row=row, plans={"sampler": sampler})


def completion_slots(prompts: int, num_generations: int) -> dict[str, np.ndarray]:
    """What the runner's feeder steps through: one row per completion of an epoch (``num_generations`` per
    prompt), so that its global batch, epochs and sample counts are of completions, as TRL's. A row holds only
    its prompt's index (``input_ids`` ``[rows, 1]``); the rollout draws each step's prompts itself."""
    return {"input_ids": np.repeat(np.arange(prompts, dtype=np.int32), num_generations)[:, None]}


JOB = Job(
    __doc__,
    TASK,
    {"source": ModelSource, "data": PromptDataConfig, "grpo": GRPOConfig, "eval_tasks": EvalTasksConfig},
    prepare,
    default_stages="train",
    no_eval="jaxseq grpo has no evaluation (no validation prompts, no eval metrics: its figures are the training "
    "rewards)",
)


@script
def main(argv) -> int:
    return run(JOB, argv)


def plan_sampler(program, topo, *, rows: int, prompt_length: int, config: GRPOConfig, eos: Sequence[int], pad: int):
    """The plan (``jaxseq.plan.compile_plan``'s, memory only) of GRPO's sampler on the slice ``topo``, from the
    run's ``program`` (a ``TrainProgram`` on an abstract model): ``rows`` completions a step (the global batch)
    of ``prompt_length`` prompt tokens (bucketed as ``generate`` buckets them) + ``--max_completion_length``,
    sampled from the training weights as the run samples them (``Training.eval_model``: with LoRA the adapters
    folded in, with QLoRA dequantised where used), the whole training state held meanwhile (an argument of the
    program, counted in its memory). Its step time is left out: the loop's length is the completions'."""
    mesh, training = program.mesh, program.training
    state, frozen = program.abstract_state, program.abstract_frozen
    settings = generation.Settings(
        max_new_tokens=config.max_completion_length,
        do_sample=True,
        top_k=config.top_k,
        use_top_p=config.top_p < 1.0,
        eos=tuple(int(e) for e in eos),
        pad=int(pad),
        return_logprobs=False,
        decoder_start=None,
        mesh=mesh,
        samples=config.num_generations,
        rows=rows,
    )

    def sample(params, frozen, opt_state, ema, ids, mask, seed, temperature, top_p):
        graphdef, weights = nnx.split(training.eval_model(params, frozen))
        run = generation.program(graphdef, settings)
        return run(weights, ids, mask, jax.random.key(seed), temperature, top_p, jnp.int32(0), None)[0]

    width = -(-prompt_length // generation.PROMPT_BUCKET) * generation.PROMPT_BUCKET
    prompts = -(-rows // config.num_generations // data_parallel_size(mesh)) * data_parallel_size(mesh)
    tokens = jax.ShapeDtypeStruct((prompts, width), jnp.int32, sharding=batch_sharding(mesh))
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=NamedSharding(mesh, jax.sharding.PartitionSpec()))
    lowered = jax.jit(sample, keep_unused=True).lower(
        state.params, frozen, state.opt_state, state.ema, tokens, tokens, scalar(jnp.uint32), scalar(jnp.float32),
        scalar(jnp.float32),
    )  # fmt: skip
    kinds = {"params": "parameters", "frozen": "frozen weights", "opt_state": "optimizer state", "ema": "EMA weights"}
    plan = compile_plan(
        lowered,
        topo,
        parameters=(state.params, frozen, state.ema),
        optimizer_state=state.opt_state,
        batch=(tokens, tokens),
        argument_kinds={**kinds, "ids": "batch", "mask": "batch"},
    )
    plan.update(
        estimated_step_seconds=None,
        estimated_mfu=None,
        compiled_flops_per_device=None,
        estimate_method=f"memory only: the loop samples up to {config.max_completion_length} tokens",
        inputs={"input_ids": {"shape": [prompts, width], "dtype": "int32"}},
    )
    return plan
