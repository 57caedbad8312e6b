"""The core section of the settings table: the top-level keys of a launch config.

Each row with a `field` reaches that field of every worker's RunContext by itself; the one rule
here is the value no single row gives (use_cpu puts every worker on the CPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accel_settings._rows import Section, Setting

HARDWARE = "Hardware Selection Arguments"
RESOURCES = "Resource Selection Arguments"
DISTRIBUTED = "Distributed GPUs"
TRAINING = "Training Settings (accel)"


def _rules(values: Mapping[str, Any], found: Mapping[str, Any], config: Any) -> dict[str, Any]:
    return {**found, "device": "cpu"} if values["use_cpu"] else dict(found)


SECTION = Section(
    name="",
    title=TRAINING,
    description="Settings recorded in every process's RunContext.",
    order=100,  # listed last in `accel launch --help`, as before the table
    rules=_rules,
    settings=(
        Setting(key="distributed_type", kind="distributed_type", default="NO", flag=False,
                help="Accelerate's run kind: NO, MULTI_CPU, MULTI_GPU, FSDP or DEEPSPEED"),
        Setting(key="num_processes", kind="count", default=1, group=RESOURCES,
                help="processes in total, over all machines"),
        Setting(key="num_machines", kind="count", default=1, group=RESOURCES,
                help="machines taking part"),
        Setting(key="machine_rank", kind="index", default=0, group=DISTRIBUTED,
                per_machine=True, help="this machine's index"),
        Setting(key="main_process_ip", kind="text", group=DISTRIBUTED, per_machine=True,
                help="address of machine 0 (the rendezvous host)"),
        Setting(key="main_process_port", kind="port", group=DISTRIBUTED,
                help="rendezvous port; 0 picks a free one (one machine only)"),
        Setting(key="rdzv_backend", kind="rdzv_backend", default="static", group=DISTRIBUTED,
                help="torchrun rendezvous backend: static or c10d"),
        Setting(key="rdzv_conf", kind="rdzv_conf", group=DISTRIBUTED,
                help="c10d rendezvous options, e.g. join_timeout=60,last_call_timeout=5"),
        Setting(key="mixed_precision", kind="precision", default="fp32", group=RESOURCES,
                field="precision", env="ACCEL_PRECISION",
                accelerate_env="ACCELERATE_MIXED_PRECISION",
                help="fp32 (or Accelerate's 'no'), bf16, fp16 or fp8"),
        Setting(key="gradient_accumulation_steps", kind="count", default=1,
                field="grad_accum_steps", env="ACCEL_GRAD_ACCUM_STEPS",
                accelerate_env="ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                flags=("grad_accum_steps",), help="micro-batches per optimizer step"),
        Setting(key="seed", kind="optional_index", field="seed", env="ACCEL_SEED",
                help="base seed recorded in every process's RunContext"),
        Setting(key="use_cpu", kind="bool", default=False, group=HARDWARE,
                accelerate_env="ACCELERATE_USE_CPU", accelerate_case="title", flags=("cpu",),
                help="run on the CPU even when GPUs are present"),
        Setting(key=None, kind="text", field="device", env="ACCEL_DEVICE",
                help="the device of every process (use_cpu writes cpu)"),
        Setting(key="gpu_ids", kind="text", default="all", group=DISTRIBUTED,
                env="CUDA_VISIBLE_DEVICES", per_machine=True,
                help="comma-separated GPU ids to use, or 'all'"),
        Setting(key="max_restarts", kind="index", default=0, group=DISTRIBUTED,
                help="how often the elastic agent restarts failed workers"),
        Setting(key="monitor_interval", kind="float", default=0.1, group=DISTRIBUTED,
                per_machine=True, help="seconds between the agent's checks on its workers"),
        Setting(key="shutdown_timeout", kind="optional_index", group=DISTRIBUTED,
                help="seconds the agent waits for its workers after passing on a stop signal, "
                     "then SIGKILL (torchrun's 30 by default; torch 2.12 or newer)"),
        Setting(key="num_cpu_threads_per_process", kind="optional_count", group=RESOURCES,
                env="OMP_NUM_THREADS", per_machine=True, help="OMP/torch threads per process"),
        Setting(key="log_with", kind="names", default=(), field="log_with", env="ACCEL_LOG_WITH",
                help="trackers init_trackers builds by default, e.g. wandb,mlflow"),
    ),
)  # fmt: skip
