"""`accel env`: versions, devices, memory and the config in force, for bug reports.

The versions come first and are printed before the config is read, so a config that does not
parse still leaves them on the screen above its one-line error.
"""

from __future__ import annotations

import argparse
import os
import platform
from importlib import metadata

from accel import config as _config

# The distribution name accel is installed under; `import accel` is unchanged.
DISTRIBUTION = "accel-train"
# accel's optional integrations (its extras: pyproject.toml), and the libraries scripts that
# come from Accelerate pair it with; each is reported with its version or "not installed".
OPTIONAL_PACKAGES = (
    "tensorboard", "tqdm", "wandb", "mlflow-skinny", "trackio", "torchao", "deepspeed",
    "ray", "transformers", "accelerate", "datasets",
)  # fmt: skip


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _memory_gib() -> str:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return "unknown"
    return f"{pages * size / 2**30:.1f} GiB"


def versions() -> str:
    """Versions of accel, torch, Python and every optional package, devices and memory."""
    import torch

    import accel  # imported on use: `accel --help` should not pay for torch

    lines = [
        f"- accel ({DISTRIBUTION}): {_version(DISTRIBUTION)}, imported from {accel.__file__}",
        f"- torch: {torch.__version__}",
        f"- Python: {platform.python_version()} ({platform.platform()})",
        *(f"- {p}: {_version(p)}" for p in ("numpy", "safetensors", "pyyaml")),
        "- optional packages:",
        *(f"  - {p}: {_version(p)}" for p in OPTIONAL_PACKAGES),
        f"- CPU cores: {os.cpu_count()}, memory: {_memory_gib()}",
        f"- torch.distributed: {torch.distributed.is_available()}, gloo: "
        f"{torch.distributed.is_gloo_available()}, nccl: {torch.distributed.is_nccl_available()}",
        f"- CUDA available: {torch.cuda.is_available()}",
    ]
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"  - cuda:{i}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
    lines.append(f"- MPS available: {torch.backends.mps.is_available()}")
    return "\n".join(lines)


def settings() -> str:
    """The config in force and the `ACCEL_*` variables; raises on a config that does not parse."""
    lines = []
    path = _config.config_in_force()  # the file `accel launch` reads, Accelerate's included
    if path is not None:
        lines.append(f"- Config in force: {path}")
        config = _config.load_config(path)
        lines += [f"  - {k}: {v}" for k, v in _config.as_mapping(config).items()]
    else:
        lines.append(
            f"- Config in force: none (neither {_config.default_config_path()} nor "
            f"{_config.accelerate_config_path()} exists; defaults apply)"
        )
    settings = {k: v for k, v in os.environ.items() if k.startswith("ACCEL_")}
    lines += [f"- {k}={v}" for k, v in sorted(settings.items())]
    return "\n".join(lines)


def report() -> str:
    return f"{versions()}\n{settings()}"


def run(args: argparse.Namespace) -> int:
    print(versions(), flush=True)  # before the config, which may be the problem reported
    print(settings())
    return 0
