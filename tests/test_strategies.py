"""When the trainer evaluates and saves (--eval_strategy, --save_strategy), which checkpoint is the best
(--metric_for_best_model with or without transformers' ``eval_`` prefix) and what --load_best_model_at_end
leaves in the trainer, on real SST-2 text with a tiny GPT-2."""

import pytest

from jaxseq.errors import JaxseqError
from jaxseq.train.trainer_config import TrainerConfig
from tests.test_trainer import make_trainer, sst2, tokenizer  # noqa: F401 (fixtures)


def evals(trainer, key="eval/accuracy"):
    return {r["step"]: r[key] for r in trainer.logger.records if key in r}


def kept_steps(output_dir):
    return sorted(int(p.name) for p in (output_dir / "checkpoints").iterdir() if p.name.isdigit())


def test_metric_named_as_transformers_does_picks_the_best_checkpoint(tmp_path, tokenizer, sst2):  # noqa: F811
    # eval_accuracy used to crash the second save ("free disk space"): orbax looked up eval/eval_accuracy
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        sst2,
        max_steps=6,
        eval_steps=2,
        save_steps=2,
        save_total_limit=1,
        metric_for_best_model="eval_accuracy",
    )
    trainer.train()
    trainer.close()
    accuracy = evals(trainer)
    assert sorted(accuracy) == [2, 4, 6]
    best = trainer.checkpointer.best_step("eval/accuracy")
    assert accuracy[best] == max(accuracy.values())
    assert kept_steps(tmp_path) == sorted({best, 6})  # the latest and the best


def test_load_best_model_at_end_holds_the_best_state(tmp_path, tokenizer, sst2):  # noqa: F811
    # "best" = the highest eval loss, so that the best is not the last step
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        sst2,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        learning_rate=3e-3,
        load_best_model_at_end=True,
        greater_is_better=True,
    )
    assert trainer.config.metric_for_best_model == "loss"
    results = trainer.train()
    losses = evals(trainer, "eval/loss")
    best = max(losses, key=losses.get)
    assert best != 6, losses
    assert results["eval_loss"] == losses[best]
    assert trainer.evaluate()["loss"] == pytest.approx(losses[best], rel=1e-6)  # the state is the best one
    trainer.close()


def test_epoch_saves_and_no_evaluation_until_the_end(tmp_path, tokenizer, sst2):  # noqa: F811
    trainer = make_trainer(  # 96 examples, global batch 16: 6 steps per epoch
        tmp_path, tokenizer, sst2, max_steps=8, eval_strategy="no", save_strategy="epoch", save_total_limit=5
    )
    assert trainer.steps_per_epoch == 6
    trainer.train()
    trainer.close()
    assert sorted(evals(trainer)) == [8]
    assert kept_steps(tmp_path) == [6, 8]


def test_save_strategy_no_saves_nothing(tmp_path, tokenizer, sst2):  # noqa: F811
    trainer = make_trainer(tmp_path, tokenizer, sst2, max_steps=2, save_strategy="no")
    trainer.train()
    trainer.close()
    assert kept_steps(tmp_path) == []


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(metric_for_best_model="eval_f1"), "is not an eval metric of this run; choose one of loss, accuracy"),
        (dict(load_best_model_at_end=True, eval_steps=2, save_steps=3), "the checkpoint of step 3 would have no"),
    ],
)
def test_best_model_settings_that_cannot_work_stop_before_training(tmp_path, tokenizer, sst2, settings, message):  # noqa: F811
    with pytest.raises(JaxseqError, match=message):
        make_trainer(tmp_path, tokenizer, sst2, **settings)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_strategy_defaults_follow_transformers():
    config = TrainerConfig(load_best_model_at_end=True, eval_strategy="steps", output_dir="/tmp/unused")
    assert (config.metric_for_best_model, config.greater_is_better, config.eval_steps) == ("loss", False, 50)
    assert TrainerConfig(metric_for_best_model="eval_matthews_correlation").greater_is_better is True
    with pytest.raises(JaxseqError, match="--load_best_model_at_end needs checkpoints with evaluations"):
        TrainerConfig(load_best_model_at_end=True, save_strategy="no")
    # evaluation once training ends unless asked for (transformers' "no"), as often as the best model needs
    assert TrainerConfig().eval_strategy == "no"
    assert TrainerConfig(eval_steps=20).eval_strategy == "steps"
    assert TrainerConfig(load_best_model_at_end=True).eval_strategy == "epoch"


def test_a_second_run_on_a_busy_output_dir_stops(tmp_path, tokenizer, sst2):  # noqa: F811
    first = make_trainer(tmp_path, tokenizer, sst2, max_steps=1)
    with pytest.raises(JaxseqError, match=f"another run .* is writing to {tmp_path}"):
        make_trainer(tmp_path, tokenizer, sst2, max_steps=1)
    first.close()  # done: the folder is free again
    make_trainer(tmp_path, tokenizer, sst2, max_steps=1).close()
