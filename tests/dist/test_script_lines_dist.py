"""The eval and logging lines of transformers' `run_clm_no_trainer.py`, `run_mlm_no_trainer.py`
and `run_glue_no_trainer.py`, written as those scripts write them, under accel and under
Accelerate 1.15 (on the CPU, in the same kind of world) at 1 and 2 processes.

The scripts gather `loss.repeat(per_device_eval_batch_size)` per eval batch (CLM, MLM) and a
`(predictions, labels)` pair (GLUE), then log `{"perplexity": ..., "eval_loss": ..., "epoch":
..., "step": completed_steps}` (GLUE: `{"accuracy": {"accuracy": ..., "f1": ...}, ...}`) with
`step=completed_steps`. Eleven eval samples in batches of 4 leave a short last batch at one
process and a last round of 3 real samples at two. Each tracker is read back through its own
reader in the 2-process world.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch

import accel
from accel import RunContext
from accel.testing import run_world

NUM_SAMPLES, BATCH, SEQ, VOCAB = 11, 4, 8, 32
TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow", "trackio")


def _accelerator(ctx: RunContext, **kwargs: Any) -> Any:
    """Accelerate's Accelerator on this run_world rank: its launcher's variables, the process
    group run_world made (Accelerate keeps an initialised group)."""
    os.environ.update(
        RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.rank),
        LOCAL_WORLD_SIZE=str(ctx.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    from accelerate import Accelerator

    return Accelerator(cpu=True, **kwargs)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")),
        pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]",
    )  # fmt: skip


def _samples(kind: str) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (NUM_SAMPLES, SEQ), generator=g)
    if kind == "clm":
        return [{"input_ids": x, "attention_mask": torch.ones(SEQ, dtype=torch.long),
                 "labels": x.clone()} for x in ids]  # fmt: skip
    if kind == "mlm":
        return [{"input_ids": x.tolist()} for x in ids]
    labels = torch.randint(0, 2, (NUM_SAMPLES,), generator=g)
    return [{"input_ids": x, "labels": y} for x, y in zip(ids, labels, strict=True)]


def _model(kind: str) -> torch.nn.Module:
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
    )

    torch.manual_seed(0)
    if kind == "clm":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16,
                                          n_layer=1, n_head=2))  # fmt: skip
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=SEQ,
    )
    return (BertForMaskedLM if kind == "mlm" else BertForSequenceClassification)(config)


def _loader(kind: str) -> torch.utils.data.DataLoader:
    from transformers import DataCollatorForLanguageModeling, default_data_collator

    collate = (
        DataCollatorForLanguageModeling(_tokenizer(), mlm_probability=0.15)
        if kind == "mlm"
        else default_data_collator
    )
    return torch.utils.data.DataLoader(_samples(kind), collate_fn=collate, batch_size=BATCH)


def _accuracy_f1(predictions: torch.Tensor, references: torch.Tensor) -> dict[str, float]:
    hits = (predictions == references).sum().item()
    tp = ((predictions == 1) & (references == 1)).sum().item()
    fp = ((predictions == 1) & (references == 0)).sum().item()
    fn = ((predictions == 0) & (references == 1)).sum().item()
    return {"accuracy": hits / len(references), "f1": 2 * tp / max(2 * tp + fp + fn, 1)}


def _evaluate(
    kind: str, model: Any, loader: Any, gather_for_metrics: Any, *, draw: bool = False
) -> dict[str, Any]:
    """The scripts' eval loop, line for line; `gather_for_metrics` is the one call that differs.
    `draw`: docs/migration.md's global-RNG recipe, the int64 Accelerate's loader draws per pass
    (accel's does not), so the MLM collator masks the same tokens."""
    per_device_eval_batch_size = BATCH
    model.eval()
    if draw:
        torch.empty((), dtype=torch.int64).random_()
    if kind == "glue":
        predictions_all, references_all = [], []
        for _step, batch in enumerate(loader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = gather_for_metrics((predictions, batch["labels"]))
            predictions_all.append(predictions)  # metric.add_batch(...)
            references_all.append(references)
        eval_metric = _accuracy_f1(torch.cat(predictions_all), torch.cat(references_all))
        return {"accuracy": eval_metric, "samples": len(torch.cat(references_all))}
    losses = []
    for _step, batch in enumerate(loader):
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss
        losses.append(gather_for_metrics(loss.repeat(per_device_eval_batch_size)))
    losses = torch.cat(losses)
    try:
        eval_loss = torch.mean(losses)
        perplexity = math.exp(eval_loss)
    except OverflowError:
        perplexity = float("inf")
    return {"perplexity": perplexity, "eval_loss": eval_loss.item(), "samples": len(losses)}


def _with_accel(ctx: RunContext, kind: str, directory: str | None) -> dict[str, Any]:
    accel.set_seed(42)
    loader = accel.shard_loader(ctx, _loader(kind))
    model = accel.wrap_model(ctx, _model(kind))
    result = _evaluate(
        kind, model, loader, lambda t: accel.gather_for_metrics(ctx, t, loader=loader), draw=True
    )
    if directory is not None:  # the scripts' logging line, step= and a metric named "step"
        trackers = accel.init_trackers(ctx, list(TRACKERS[:-1]), project="scripts",
                                       config={"lr": 5e-5}, directory=directory)  # fmt: skip
        trackers += accel.init_trackers(ctx, ["trackio"], project="scripts")  # in $TRACKIO_DIR
        completed_steps, epoch, train_loss = 6, 0, 2.5
        metrics = {k: v for k, v in result.items() if k != "samples"}
        accel.log_metrics(
            ctx, {**metrics, "train_loss": train_loss, "epoch": epoch, "step": completed_steps},
            step=completed_steps, trackers=trackers,
        )  # fmt: skip
        for tracker in trackers:
            tracker.close()
    return result


def _with_accelerate(ctx: RunContext, kind: str) -> dict[str, Any]:
    from accelerate.utils import set_seed

    accelerator = _accelerator(ctx)
    set_seed(42)
    model, loader = accelerator.prepare(_model(kind), _loader(kind))
    return _evaluate(kind, model, loader, accelerator.gather_for_metrics)


def _both(ctx: RunContext) -> dict[str, tuple[dict, dict]]:
    return {
        kind: (_with_accel(ctx, kind, None), _with_accelerate(ctx, kind))
        for kind in ("clm", "mlm", "glue")
    }


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)  # transformers and accelerate imported in each world
@pytest.mark.parametrize("world_size", [1, 2])
def test_script_eval_lines_give_accelerates_metrics_at_1_and_2_processes(world_size: int) -> None:
    for res in run_world(_both, world_size=world_size, timeout=600):
        for kind, (mine, theirs) in res.items():
            assert mine == theirs, (kind, world_size, mine, theirs)
            assert mine["samples"] == NUM_SAMPLES  # every eval sample counted once


def _log_both(ctx: RunContext, directory: str) -> dict[str, dict[str, Any]]:
    return {kind: _with_accel(ctx, kind, str(Path(directory, kind))) for kind in ("clm", "glue")}


def _tensorboard(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for event_file in sorted(folder.rglob("events.out.tfevents.*")):
        events = EventAccumulator(str(event_file))
        events.Reload()
        prefix = "" if event_file.parent == folder else event_file.parent.name + ":"
        for tag in events.Tags()["scalars"]:
            scalars[prefix + tag] = [(e.step, e.value) for e in events.Scalars(tag)]
    return scalars


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)  # transformers, wandb, mlflow and trackio imported on each rank
def test_script_logging_lines_reach_every_tracker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    from tests.dist.test_trackers_dist import _key, _wandb_records

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    logged = run_world(_log_both, world_size=2, timeout=600, args=(str(tmp_path),))[0]
    for result in logged.values():
        result.pop("samples")
    clm, glue = logged["clm"], logged["glue"]
    common = {"train_loss": 2.5, "epoch": 0, "step": 6}

    # JSONL: the record as logged, the step once (the metric "step" equals step=).
    for kind, result in logged.items():
        lines = (tmp_path / kind / "scripts" / "metrics.jsonl").read_text().splitlines()
        assert json.loads(lines[-1]) == {"step": 6, **result, **common}

    # TensorBoard: scalars at step 6; GLUE's dict through add_scalars (one run per key).
    scalars = _tensorboard(tmp_path / "clm" / "scripts" / "tensorboard")
    assert scalars == {k: [(6, pytest.approx(v))] for k, v in {**clm, **common}.items()}
    scalars = _tensorboard(tmp_path / "glue" / "scripts" / "tensorboard")
    expected = {f"accuracy_{k}:accuracy": v for k, v in glue["accuracy"].items()} | common
    assert scalars == {k: [(6, pytest.approx(v))] for k, v in expected.items()}

    # W&B: one history row at step 6 holding every metric, GLUE's as a nested value.
    for kind, result in logged.items():
        (run_file,) = (tmp_path / kind / "wandb").glob("offline-run-*/run-*.wandb")
        rows = [
            {_key(item): json.loads(item.value_json) for item in record.history.item}
            for record in _wandb_records(run_file)
            if record.WhichOneof("record_type") == "history"
        ]
        assert len(rows) == 1 and rows[0].pop("_step") == 6
        flat = {k: v for k, v in {**result, **common}.items() if not isinstance(v, dict)}
        flat |= {f"accuracy/{k}": v for k, v in result.get("accuracy", {}).items()}
        assert {k: rows[0][k] for k in flat} == pytest.approx(flat)

    # MLflow: each metric at step 6; a dict value as "name/key" metrics.
    for kind, result in logged.items():
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / kind / 'mlflow.db'}")
        (run,) = client.search_runs([client.get_experiment_by_name("scripts").experiment_id])
        flat = {k: v for k, v in {**result, **common}.items() if not isinstance(v, dict)}
        flat |= {f"accuracy/{k}": v for k, v in result.get("accuracy", {}).items()}
        history = {
            k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
            for k in run.data.metrics
        }
        assert history == {k: [(6, pytest.approx(v))] for k, v in flat.items()}

    # trackio: one row at step 6 with the metrics as logged (a dict nested; trackio stores a
    # metric named "step" as "__step", its own escape for the names it reserves).
    with sqlite3.connect(tmp_path / "trackio" / "scripts.db") as db:
        rows = db.execute("SELECT step, metrics FROM metrics ORDER BY id").fetchall()
    assert [step for step, _ in rows] == [6, 6]
    for (_, metrics), result in zip(rows, logged.values(), strict=True):
        got = json.loads(metrics)
        got["step"] = got.pop("__step")
        assert {k: got[k] for k in {**result, **common}} == {**result, **common}
