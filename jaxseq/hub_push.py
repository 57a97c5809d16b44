"""Push a run's model to the Hugging Face Hub: the exported folder (config, weights or PEFT adapter,
tokenizer, results, loss plot) with a generated model card, through huggingface_hub's ``create_repo`` and
``upload_folder``.

What goes up is first staged in a folder, exactly the files uploaded with the card as ``README.md``;
a dry run stops there. The token goes to huggingface_hub and nowhere else: it is never logged, never in
the card or ``config.yaml``, and a staged file that contains it stops the push. A failed push (offline,
no or a wrong token) is one line; the run's own files are only ever read.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import yaml

from jaxseq.config import arg
from jaxseq.errors import JaxseqError

# the top-level files of an output folder that go up (checkpoints and TensorBoard events stay home)
UPLOADED = ("*.json", "*.safetensors", "*.txt", "*.model", "metrics.jsonl", "config.yaml", "training_curves.png")
DRY_RUN_DIR = "hub_dry_run"
_PIPELINES = {
    "ForSequenceClassification": "text-classification",
    "LMHeadModel": "text-generation",
    "ForCausalLM": "text-generation",
    "ForConditionalGeneration": "text2text-generation",
    "ForMaskedLM": "fill-mask",
}
_PEFT_PIPELINES = {
    "SEQ_CLS": "text-classification",
    "CAUSAL_LM": "text-generation",
    "SEQ_2_SEQ_LM": "text2text-generation",
}
_AUTO_CLASSES = {
    "text-classification": "SequenceClassification",
    "text-generation": "CausalLM",
    "text2text-generation": "Seq2SeqLM",
    "fill-mask": "MaskedLM",
}
_NOT_HYPERPARAMETERS = re.compile(r"(dir|file|path|token|address|resume|push|hub_|process|config_name|_or_path)")


@dataclasses.dataclass
class HubConfig:
    push_to_hub: bool = arg(
        False, "at the end, upload the exported model with a generated model card to the Hugging Face Hub"
    )
    hub_model_id: str | None = arg(
        None, "Hub repo to push to, 'user/name' or 'name' in your namespace (default: the --output_dir folder's name)"
    )
    hub_private_repo: bool = arg(False, "create the Hub repo private")
    hub_token: str | None = arg(
        None, "Hub token (default: HF_TOKEN or the login `hf auth login` stored); never logged nor written"
    )
    hub_dry_run: bool = arg(
        False, f"stage exactly what --push_to_hub would upload in OUTPUT_DIR/{DRY_RUN_DIR} and upload nothing"
    )

    def __post_init__(self):
        if self.hub_model_id is not None:
            check_repo_id(self.hub_model_id)


def check_repo_id(repo_id: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise JaxseqError(
            f"{repo_id!r} is not a valid Hub repo id; write 'user/name' or 'name' (letters, digits, '-', '_', '.')"
        ) from None


def push_run(hub: HubConfig, output_dir: str | os.PathLike) -> str | None:
    """What a training script does at its end: push ``output_dir`` as ``hub`` says (nothing unless
    ``--push_to_hub`` or ``--hub_dry_run``). Only process 0 pushes. Returns the repo URL or staging folder."""
    import jax

    if not (hub.push_to_hub or hub.hub_dry_run) or jax.process_index() != 0:
        return None
    out = Path(output_dir)
    repo_id = hub.hub_model_id or out.absolute().name
    if hub.hub_dry_run:
        stage(out, out / DRY_RUN_DIR, repo_id, token=hub.hub_token)
        print(f"hub dry run: staged the upload to {repo_id} in {out / DRY_RUN_DIR}; nothing was uploaded")
        return str(out / DRY_RUN_DIR)
    url = push(out, repo_id, private=hub.hub_private_repo, token=hub.hub_token)
    print(f"pushed {out} to {url}")
    return url


def push(output_dir: str | os.PathLike, repo_id: str, *, private: bool = False, token: str | None = None) -> str:
    """Create the repo (if needed) and upload the staged folder to it; returns the repo's URL."""
    from huggingface_hub import HfApi

    check_repo_id(repo_id)
    out = Path(output_dir)
    with tempfile.TemporaryDirectory(prefix="jaxseq-push-") as staging:
        stage(out, Path(staging), repo_id, token=token)
        try:  # network, offline mode, a missing or refused token: all end here, as one line
            api = HfApi(token=token)
            url = api.create_repo(repo_id, private=private, exist_ok=True)
            api.upload_folder(
                repo_id=url.repo_id, folder_path=staging, commit_message="Upload model trained with jaxseq"
            )
        except Exception as e:
            raise JaxseqError(
                f"could not push {out} to the Hub repo {repo_id!r}: {_one_line(e, token)}; check the network and "
                "your token (`hf auth login` or --hub_token); the local results are untouched"
            ) from None
    return str(url)


def stage(output_dir: Path, staging: Path, repo_id: str, *, token: str | None = None) -> list[str]:
    """Copy the files that go up into ``staging`` (emptied first) and write the model card there as
    ``README.md``; returns their names."""
    files = uploaded_files(output_dir)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    for name in files:
        shutil.copy2(output_dir / name, staging / name)
    (staging / "README.md").write_text(model_card(output_dir, repo_id), encoding="utf-8")
    _refuse_token(staging, token)
    return sorted([*files, "README.md"])


def uploaded_files(output_dir: Path) -> list[str]:
    if not output_dir.is_dir():
        raise JaxseqError(f"{output_dir} is not a folder; pass the --output_dir of a finished run")
    files = sorted(
        p.name
        for p in output_dir.iterdir()
        if p.is_file() and any(fnmatch.fnmatch(p.name, pattern) for pattern in UPLOADED)
    )
    if not {"config.json", "adapter_config.json"} & set(files):
        raise JaxseqError(
            f"{output_dir} holds no exported model (no config.json or adapter_config.json); "
            "push the --output_dir of a finished run"
        )
    return files


def _refuse_token(staging: Path, token: str | None) -> None:
    from huggingface_hub import get_token

    secret = (token or get_token() or "").encode()
    if len(secret) < 8:
        return
    for path in staging.iterdir():
        if secret in path.read_bytes():
            raise JaxseqError(
                f"{path.name} contains your Hub token; nothing was uploaded: remove it from the run's "
                "files and push again"
            )


def _one_line(error: Exception, token: str | None) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if token:
        text = text.replace(token, "***")
    return f"{type(error).__name__}: {text[:300]}"


# --------------------------------------------------------------------------- the model card


def model_card(output_dir: Path, repo_id: str) -> str:
    """README.md for the repo: metadata, what the model is (base model, task, dataset), its evaluation
    results, the hyperparameters from ``config.yaml``, the training curves and how to load it."""
    from huggingface_hub import ModelCard, ModelCardData

    run = _read_yaml(output_dir / "config.yaml")
    flat = {k: v for section in run.values() if isinstance(section, dict) for k, v in section.items()}
    results = _read_json(output_dir / "all_results.json")
    adapter = _read_json(output_dir / "adapter_config.json")
    config = _read_json(output_dir / "config.json")
    architecture = (config.get("architectures") or [""])[0]
    if adapter:
        pipeline = _PEFT_PIPELINES.get(adapter.get("task_type"))
    else:
        pipeline = next((p for suffix, p in _PIPELINES.items() if architecture.endswith(suffix)), None)
    base = flat.get("model_name_or_path") or (adapter or {}).get("base_model_name_or_path")
    base_id = base if base and _is_hub_id(base) else None
    dataset, dataset_ids = _dataset(flat)
    lora_rank = (adapter or {}).get("r") or flat.get("lora_rank") or 0
    name = repo_id.split("/")[-1]
    scores = eval_results(_read_json(output_dir / "eval_results.json"), flat, pipeline)
    data = ModelCardData(
        library_name="peft" if adapter else "transformers",
        base_model=base_id,
        datasets=dataset_ids or None,
        pipeline_tag=pipeline,
        tags=["jaxseq", "jax", *(["lora"] if lora_rank else [])],
        model_name=name if scores else None,
        eval_results=scores or None,
    )
    if base_id:
        origin = f"[{base_id}](https://huggingface.co/{base_id})"
    elif base:
        origin = f"`{Path(base).name}` (a local checkpoint)"
    else:
        origin = "a model trained from scratch" + (f" (`{flat['model_type']}`)" if flat.get("model_type") else "")
    lines = [
        f"# {name}",
        "",
        f"{origin} fine-tuned with [jaxseq](https://github.com/jaxseq/jaxseq) on {dataset}"
        f"{f' for {pipeline}' if pipeline else ''}.",
    ]
    if lora_rank:
        alpha = (adapter or {}).get("lora_alpha", flat.get("lora_alpha"))
        what = (
            "This repo holds the adapter alone, in PEFT's format; it loads on the base model."
            if adapter
            else "The adapters are merged into the weights: this is a plain transformers model."
        )
        lines += ["", f"Trained with LoRA adapters (rank {lora_rank}, alpha {_fmt(alpha)}). {what}"]
    metrics = {
        k.removeprefix("eval_"): v for k, v in sorted(results.items()) if k.startswith("eval_") and k != "eval_samples"
    }
    lines += ["", "## Evaluation", ""]
    if metrics:
        lines += [
            f"On {results.get('eval_samples', 'the')} evaluation examples:",
            "",
            "| metric | value |",
            "|---|---|",
            *(f"| {k} | {_fmt(v)} |" for k, v in metrics.items()),
        ]
    else:
        lines.append("No evaluation results were recorded.")
    lines += ["", "## Training", ""]
    facts = [
        ("training examples", results.get("train_samples")),
        ("epochs", results.get("epoch")),
        ("training time (s)", results.get("train_runtime")),
        ("trainable parameters", results.get("trainable_parameters")),
        ("optimizer state (bytes)", results.get("optimizer_state_bytes")),
    ]
    lines += [f"- {k}: {_fmt(v)}" for k, v in facts if v is not None]
    hyper = {k: v for k, v in flat.items() if v not in (None, "") and not _NOT_HYPERPARAMETERS.search(k)}
    if hyper:
        lines += [
            "",
            "### Hyperparameters",
            "",
            "| name | value |",
            "|---|---|",
            *(f"| {k} | {_fmt(v)} |" for k, v in hyper.items()),
        ]
    if (output_dir / "training_curves.png").is_file():
        lines += ["", "### Training curves", "", "![training loss and evaluation metrics](training_curves.png)"]
    lines += ["", "## How to use", "", "```python", *_usage(repo_id, pipeline, adapter), "```", ""]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


def eval_results(evaluated: dict, flat: dict, pipeline: str | None) -> list:
    """``eval_results.json``'s finite figures as huggingface_hub ``EvalResult``s: the card's ``model-index``,
    from which the Hub shows the score. ``eval_accuracy`` is the metric ``accuracy``; a name met twice
    (``eval_perplexity`` and run_clm's ``perplexity``) is reported once."""
    from huggingface_hub import EvalResult

    if flat.get("task_name"):
        dataset = dict(
            dataset_type="nyu-mll/glue",
            dataset_name=f"GLUE {str(flat['task_name']).upper()}",
            dataset_config=str(flat["task_name"]),
            dataset_split="validation",
        )
    elif flat.get("dataset_name") and not flat.get("validation_file"):
        dataset = dict(
            dataset_type=flat["dataset_name"],
            dataset_name=flat["dataset_name"],
            dataset_config=flat.get("dataset_config_name"),
        )
    else:
        source = flat.get("validation_file") or flat.get("train_file") or "evaluation data"
        dataset = dict(dataset_type=Path(source).name, dataset_name=Path(source).name)
    metrics = {}
    for key, value in evaluated.items():
        name = key.removeprefix("eval_")
        if key != "eval_samples" and isinstance(value, int | float) and math.isfinite(value):
            metrics.setdefault(name, float(value))
    task = pipeline or "other"
    return [
        EvalResult(task_type=task, metric_type=name, metric_name=name, metric_value=value, **dataset)
        for name, value in metrics.items()
    ]


def _usage(repo_id: str, pipeline: str | None, adapter: dict | None) -> list[str]:
    auto = _AUTO_CLASSES.get(pipeline, "Model")
    if adapter:
        return [
            f"from peft import AutoPeftModelFor{auto}",
            "",
            f'model = AutoPeftModelFor{auto}.from_pretrained("{repo_id}")  # loads the base model too',
        ]
    return [
        f"from transformers import AutoModelFor{auto}, AutoTokenizer",
        "",
        f'model = AutoModelFor{auto}.from_pretrained("{repo_id}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
    ]


def _dataset(flat: dict) -> tuple[str, list[str]]:
    if flat.get("train_file"):
        return f"`{Path(flat['train_file']).name}`", []
    if flat.get("task_name"):
        return f"GLUE {str(flat['task_name']).upper()}", ["nyu-mll/glue"]
    if flat.get("dataset_name"):
        config = f" ({flat['dataset_config_name']})" if flat.get("dataset_config_name") else ""
        return f"[{flat['dataset_name']}](https://huggingface.co/datasets/{flat['dataset_name']}){config}", [
            flat["dataset_name"]
        ]
    return "its training data", []


def _is_hub_id(name: str) -> bool:
    return not (Path(name).expanduser().exists() or name.startswith((".", "/", "~"))) and bool(
        re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name)
    )


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_yaml(path: Path) -> dict:
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
