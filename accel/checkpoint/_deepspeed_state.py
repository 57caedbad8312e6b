"""A DeepSpeed engine in accel's checkpoints: its whole weights for save_model (ZeRO-3 gathers
them), and each rank's ZeRO state for save_state / load_state.

Importing this module does not import deepspeed; gathering ZeRO-3's weights does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from accel.checkpoint._model_io import storage_view
from accel.parallel.deepspeed import deepspeed_engine


def engine_state(engine: Any) -> dict[str, torch.Tensor]:
    """The module's state dict with whole tensors (on the CPU), on every rank.

    ZeRO-1/2 keep whole weights in the module; ZeRO-3 partitions them, so they are gathered
    parameter by parameter's group with DeepSpeed's `GatheredParameters` (every rank holds the
    whole model while it copies), as Accelerate's `get_state_dict` requires
    `stage3_gather_16bit_weights_on_model_save` for it.
    """
    import deepspeed  # on use: only a DeepSpeed engine gets here

    module = engine.module
    if not engine.zero_optimization_partition_weights():
        return _cpu_copies(module.state_dict())
    if not engine.zero_gather_16bit_weights_on_model_save():
        raise ValueError(
            "save_model: the DeepSpeed engine is ZeRO-3 and its config has "
            "stage3_gather_16bit_weights_on_model_save=false (zero3_save_16bit_model), so its "
            "weights are not gathered for a save; set it to true in the DeepSpeed config."
        )
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return _cpu_copies(module.state_dict())


def _cpu_copies(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CPU copy of each tensor, one per shared tensor: tied weights (GPT-2's embedding and
    head) stay one tensor, which save_model writes once, as it does for a plain model."""
    copies: dict[tuple[object, ...], torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        key = storage_view(t)
        if key not in copies:
            copies[key] = t.detach().cpu().clone()
        out[name] = copies[key]
    return out


def engines_as_state(fn: str, objects: dict[str, Any]) -> dict[str, Any]:
    """The objects to save or load, with each DeepSpeed engine (or its module) as its per-rank
    `EngineState`, and the optimizer given to it as a reference to that entry (its state is in
    the engine's). An engine's optimizer without the engine is refused."""
    found = {name: deepspeed_engine(obj) for name, obj in objects.items()}
    if all(engine is None for engine in found.values()):
        return objects
    models = {n for n, obj in objects.items() if isinstance(obj, nn.Module)}
    engines = {n: e for n, e in found.items() if e is not None and n in models}
    out = dict(objects)
    for name, engine in found.items():
        if name in engines:
            out[name] = EngineState(fn, name, engine)
        elif engine is not None:
            owner = next((n for n, e in engines.items() if e is engine), None)
            if owner is None:
                raise ValueError(
                    f"{fn}: {name} is the optimizer of a DeepSpeed engine, which keeps its state "
                    "(ZeRO partitions it); pass the engine (the model wrap_model returned) too, "
                    'e.g. {"model": model, "optimizer": optimizer}.'
                )
            out[name] = EngineOptimizer(fn, name, owner)
    return out


class EngineState:
    """A DeepSpeed engine's whole training state on this rank, as data (tensors and numbers).

    ZeRO partitions the fp32 master weights and the optimizer state across ranks, so
    `save_state` saves this per rank: the module's weights and buffers (ZeRO-1/2 hold the
    weights whole; ZeRO-3's are partitions, in the optimizer's state), the optimizer's ZeRO
    state (master-weight partitions, the torch optimizer's state, the loss scale) and the
    engine's step counters. It loads into an engine built the same way at the same world size,
    bit for bit, through the engine's own `load_state_dict`, as `engine.load_checkpoint` does,
    without its pickles.
    """

    state_is_per_rank = True  # every rank saves its own partitions

    def __init__(self, fn: str, name: str, engine: Any) -> None:
        self.fn, self.name, self.engine = fn, name, engine

    def state_dict(self) -> dict[str, Any]:
        engine = self.engine
        # Off a boundary (accumulate told the engine: set_gradient_accumulation_boundary),
        # partial gradients sit in ZeRO's buffers, which no checkpoint holds.
        if not engine.is_gradient_accumulation_boundary():
            raise RuntimeError(
                f"{self.fn}: {self.name} is a DeepSpeed engine inside a gradient accumulation "
                "window: its partial gradients live in ZeRO's buffers, which are not saved. "
                "Save after optimizer_step (where accumulate(...) yields sync=True)."
            )
        optimizer = dict(engine.optimizer.state_dict())
        # Two entries are objects, not data: the loss scaler is kept as its numbers; the slice
        # mappings (an index for DeepSpeed's universal checkpoints) the engine rebuilds itself.
        scaler = optimizer.pop("loss_scaler")
        optimizer.pop("param_slice_mappings", None)
        optimizer["zero_stage"] = int(optimizer["zero_stage"])
        return {
            "zero_stage": int(engine.zero_optimization_stage()),
            "world_size": int(engine.dp_world_size),
            "module": _module_state(engine),
            "optimizer": optimizer,
            "loss_scaler": {
                k: v for k, v in vars(scaler).items() if isinstance(v, bool | int | float)
            },
            "counters": {k: int(getattr(engine, k)) for k in _COUNTERS},
            "lr_scheduler": (
                engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
            ),
        }

    def check(self, state: dict[str, Any]) -> None:
        """Raise naming what differs between the saved engine and this one."""
        engine, where = self.engine, f"{self.fn}: {self.name}"
        stage, world = int(engine.zero_optimization_stage()), int(engine.dp_world_size)
        if (state["zero_stage"], state["world_size"]) != (stage, world):
            raise ValueError(
                f"{where} was saved from a ZeRO-{state['zero_stage']} engine over "
                f"{state['world_size']} data-parallel ranks; this engine is ZeRO-{stage} over "
                f"{world}. ZeRO's partitions load into the same stage and world size only; "
                "resume with those (accel merge-weights turns the weights into a plain model)."
            )
        if (state["lr_scheduler"] is None) != (engine.lr_scheduler is None):
            raise ValueError(
                f"{where}: the saved engine {'had' if state['lr_scheduler'] else 'had no'} "
                "DeepSpeed scheduler and this one "
                f"{'has' if engine.lr_scheduler is not None else 'has none'}; build the engine "
                "from the same DeepSpeed config."
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check(state)
        engine, world = self.engine, int(self.engine.dp_world_size)
        if engine.zero_optimization_partition_weights():
            for name, value in state["module"].items():
                engine.module.get_buffer(name).copy_(value)
        else:
            engine.module.load_state_dict(state["module"])  # in place: ZeRO's flat views stay
        scaler = engine.optimizer.loss_scaler
        for key, value in state["loss_scaler"].items():
            setattr(scaler, key, value)
        optimizer = {**state["optimizer"], "loss_scaler": scaler}
        engine.optimizer.load_state_dict(
            [optimizer] * world, load_optimizer_states=True, load_from_fp32_weights=True
        )
        for key, value in state["counters"].items():
            setattr(engine, key, value)
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])


_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def _module_state(engine: Any) -> dict[str, torch.Tensor]:
    """The module's state_dict; under ZeRO-3 only its buffers, which ZeRO does not partition
    (the parameters' partitions are in the optimizer's state)."""
    state: dict[str, torch.Tensor] = engine.module.state_dict()
    if not engine.zero_optimization_partition_weights():
        return state
    params = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in state.items() if k not in params}


class EngineOptimizer:
    """The optimizer given to a DeepSpeed engine: its state is in the engine's entry."""

    def __init__(self, fn: str, name: str, engine_name: str) -> None:
        self.fn, self.name, self.engine_name = fn, name, engine_name

    def state_dict(self) -> dict[str, Any]:
        return {"saved_with_engine": self.engine_name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("saved_with_engine") != self.engine_name:
            raise ValueError(
                f"{self.fn}: {self.name} was saved with the DeepSpeed engine named "
                f"{state.get('saved_with_engine')!r}, and is loaded with {self.engine_name!r}; "
                "pass the engine under the name it was saved with."
            )
