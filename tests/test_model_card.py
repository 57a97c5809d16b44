"""The model card's ``model-index``: every finite figure of ``eval_results.json`` as an evaluation result that
huggingface_hub parses back from the staged README.md (what the Hub reads to show the score)."""

import json

import yaml
from huggingface_hub import ModelCard, metadata_load
from huggingface_hub.repocard_data import model_index_to_eval_results

from jaxseq.hub_push import stage


def finished_folder(path, config_yaml: dict, evaluated: dict, architecture: str):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": "gpt2"}))
    (path / "config.yaml").write_text(yaml.safe_dump(config_yaml))
    (path / "eval_results.json").write_text(json.dumps(evaluated))
    (path / "all_results.json").write_text(json.dumps({**evaluated, "train_samples": 12, "epoch": 1.0}))
    return path


def card_results(folder, repo_id):
    staged = folder / "staged"
    stage(folder, staged, repo_id)
    meta = metadata_load(staged / "README.md")
    card = ModelCard.load(staged / "README.md")
    name, results = model_index_to_eval_results(meta["model-index"])
    assert card.data.eval_results == results and card.data.model_name == name
    return name, results


def test_clm_card_scores_equal_eval_results(tmp_path):
    evaluated = {"eval_loss": 3.25, "eval_perplexity": 25.79, "perplexity": 25.79, "eval_samples": 7}
    run = {"TextDataConfig": {"dataset_name": "wikitext", "dataset_config_name": "wikitext-2-raw-v1"}}
    folder = finished_folder(tmp_path / "gpt2-wt2", run, evaluated, "GPT2LMHeadModel")
    name, results = card_results(folder, "me/gpt2-wt2")
    assert name == "gpt2-wt2"
    assert {r.metric_type: r.metric_value for r in results} == {"loss": 3.25, "perplexity": 25.79}
    for r in results:
        assert (r.task_type, r.dataset_type, r.dataset_name, r.dataset_config) == (
            "text-generation",
            "wikitext",
            "wikitext",
            "wikitext-2-raw-v1",
        )


def test_glue_card_names_the_task_and_skips_nonfinite(tmp_path):
    evaluated = {"eval_accuracy": 0.8125, "eval_loss": float("nan"), "eval_samples": 40}
    run = {"GlueConfig": {"task_name": "sst2"}}
    folder = finished_folder(tmp_path / "bert-sst2", run, evaluated, "BertForSequenceClassification")
    _, results = card_results(folder, "bert-sst2")
    assert [(r.metric_type, r.metric_value) for r in results] == [("accuracy", 0.8125)]
    r = results[0]
    assert (r.task_type, r.dataset_type, r.dataset_config, r.dataset_split) == (
        "text-classification",
        "nyu-mll/glue",
        "sst2",
        "validation",
    )


def test_no_evaluation_means_no_model_index(tmp_path):
    run = {"TextDataConfig": {"train_file": "corpus.txt"}}
    folder = finished_folder(tmp_path / "scratch", run, {"eval_samples": 0}, "GPT2LMHeadModel")
    stage(folder, folder / "staged", "scratch")
    assert "model-index" not in metadata_load(folder / "staged" / "README.md")
