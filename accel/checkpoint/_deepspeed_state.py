"""The full weights of a DeepSpeed engine's module, for save_model (ZeRO-3 gathers them).

Imported only for a DeepSpeed engine: it imports deepspeed.
"""

from __future__ import annotations

from typing import Any

import torch


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
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    if not engine.zero_gather_16bit_weights_on_model_save():
        raise ValueError(
            "save_model: the DeepSpeed engine is ZeRO-3 and its config has "
            "stage3_gather_16bit_weights_on_model_save=false (zero3_save_16bit_model), so its "
            "weights are not gathered for a save; set it to true in the DeepSpeed config."
        )
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
