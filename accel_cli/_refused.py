"""`accelerate launch` flags (Accelerate 1.15) that `accel launch` takes only to refuse them by
name, each with the reason, instead of argparse's "unrecognized arguments"."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

_TPU = "accel runs on torch.distributed backends (gloo, nccl), not on TPUs through XLA"
_MEGATRON = "accel does not wrap Megatron-LM; use --use_fsdp or the parallelism_config_* flags"

REFUSED: dict[str, str] = {
    "mpirun_hostfile": (
        "accel launch starts the workers with torchrun, not mpirun; start them with mpirun "
        "yourself, whose ranks init_distributed reads (docs/scale-out.md): `mpirun --hostfile "
        "HOSTFILE ... python train.py` (Open MPI), `mpirun -f HOSTFILE ...` (MPICH, Intel MPI)"
    ),
    "mpirun_ccl": (
        "accel launch starts the workers with torchrun, not mpirun with oneCCL; start them with "
        "mpirun yourself (docs/scale-out.md): they meet over gloo at MASTER_ADDR:MASTER_PORT"
    ),
    "no_python": "accel launch runs Python scripts (or -m modules) only",
    "debug": "accel launch always shows each failed worker's traceback and a summary line",
    "quiet": "accel launch's output on a failure is already the workers' tracebacks and one line",
    "role": "accel launch does not name torchrun's worker role; drop the flag",
    "enable_cpu_affinity": "accel launch does not pin workers to CPUs; use numactl or taskset",
    "aws_access_key_id": "accel launch does not start Amazon SageMaker jobs",
    "aws_secret_access_key": "accel launch does not start Amazon SageMaker jobs",
    "tpu": _TPU, "tpu_cluster": _TPU, "no_tpu_cluster": _TPU, "tpu_use_sudo": _TPU,
    "vm": _TPU, "env": _TPU, "main_training_function": _TPU, "downcast_bf16": _TPU,
    "use_megatron_lm": _MEGATRON,
    "fsdp_activation_checkpointing_offload": (
        "accel's activation checkpointing recomputes on the device; offloading the checkpoints "
        "to the CPU is not implemented"
    ),
    **{
        f"parallelism_config_{name}": "accel's mesh has no context-parallel backend choice "
        "(cp_backend)"
        for name in ("cp_backend",)
    },
    **{
        f"megatron_lm_{name}": _MEGATRON
        for name in (
            "tp_degree", "use_custom_fsdp", "no_load_optim", "eod_mask_loss",
            "overlap_cpu_optimizer_d2h_h2d", "no_save_optim", "optimizer_cpu_offload",
            "use_precision_aware_optimizer", "decoder_last_pipeline_num_layers", "pp_degree",
            "num_micro_batches", "sequence_parallelism", "recompute_activations",
            "use_distributed_optimizer", "gradient_clipping", "recompute_granularity",
            "recompute_method", "recompute_num_layers", "attention_backend",
            "expert_model_parallel_size", "context_parallel_size", "attention_dropout",
            "hidden_dropout", "attention_softmax_in_fp32", "expert_tensor_parallel_size",
            "calculate_per_token_loss", "use_rotary_position_embeddings",
        )
    },
}  # fmt: skip
"""Flag (underscore spelling) -> why accel launch cannot honour it."""


class _Refuse(argparse.Action):
    """Ends the parse with one line naming the flag and why accel launch refuses it."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
        values: str | Sequence[Any] | None, option_string: str | None = None,
    ) -> None:  # fmt: skip
        why = REFUSED[self.dest]
        parser.exit(
            2, f"{parser.prog}: error: --{self.dest} (Accelerate's) is not supported: {why}.\n"
        )


def add_refused(parser: argparse.ArgumentParser) -> None:
    """Add every refused flag to `accel launch`'s parser, hidden from its help."""
    for name in REFUSED:
        spellings = [f"--{name}", f"--{name.replace('_', '-')}"]
        if name == "quiet":
            spellings.append("-q")
        parser.add_argument(
            *dict.fromkeys(spellings), dest=name, action=_Refuse, nargs="?", help=argparse.SUPPRESS
        )
