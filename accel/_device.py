"""Which device a process uses: the default for its local rank, and every spelling resolved.

Pure functions of their arguments (the GPU count is passed in), so every spelling is tested on
a CPU. `init_distributed` calls them with `torch.cuda.device_count()`.
"""

from __future__ import annotations

import torch

from accel._canary import canary_device


def default_device(local_rank: int) -> torch.device:
    """The device a process with this local rank should use: its GPU, else mps, else cpu.

    Under `accel.testing.device_canary()` the simulated accelerator stands where a GPU would.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if torch.backends.mps.is_available():
        return torch.device("mps")
    canary = canary_device()
    return canary if canary is not None else torch.device("cpu")


def resolve_device(
    spelling: str | torch.device | int,
    *,
    local_rank: int,
    device_count: int,
    name: str = "device",
) -> torch.device:
    """The indexed device that `spelling` names for a process with this local rank.

    As in torch: "cuda" (or `torch.device("cuda")`) is this process's own GPU, which is its
    local rank's (modulo the GPUs it sees, so a process that sees one GPU gets cuda:0); "cuda:N",
    `torch.device("cuda", N)` and the int N are GPU N. Other devices ("cpu", "mps", "meta") are
    torch's, unchanged. `name` is what the error messages call the setting (the argument or the
    variable it came from).

    Raises:
        ValueError: for a string torch cannot read, a negative index, or a GPU this machine
            lacks (one line: the value, the GPU count and the fix).
        TypeError: for anything but a string, a torch.device or an int.
    """
    shown = f"init_distributed: {name}={spelling!r}"
    if isinstance(spelling, bool) or not isinstance(spelling, (str, torch.device, int)):
        raise TypeError(
            f"{shown} must be a string such as 'cuda' or 'cuda:1', a torch.device or a GPU "
            "index (int)."
        )
    if isinstance(spelling, int):
        if spelling < 0:
            raise ValueError(f"{shown} is not a GPU index; pass 0 or more, or device='cuda'.")
        device = torch.device("cuda", spelling)
    elif isinstance(spelling, str):
        try:
            device = torch.device(spelling)
            readable = not spelling.strip().isdigit()  # torch reads "0" as no device
        except RuntimeError:
            readable = False
        if not readable:
            raise ValueError(
                f"{shown} is not a device torch knows; pass e.g. 'cuda' (this rank's GPU), "
                "'cuda:1', 'cpu' or 'mps'."
            )
    else:
        device = spelling
    if device.type != "cuda":
        return device
    if device_count < 1:
        raise ValueError(
            f"{shown} names a CUDA GPU but this machine has no CUDA GPU "
            "(torch.cuda.device_count() is 0); pass device='cpu', or run on a machine with a "
            "CUDA GPU and a CUDA build of torch."
        )
    index: int | None = device.index  # None for "cuda" (torch's stubs say int)
    if index is None:
        return torch.device("cuda", local_rank % device_count)
    if index >= device_count:
        last = device_count - 1
        plural = "GPU (cuda:0)" if device_count == 1 else f"GPUs (cuda:0 to cuda:{last})"
        raise ValueError(
            f"{shown} names GPU {device.index} but this machine has {device_count} {plural}; "
            f"pass device='cuda' for this rank's own GPU (local_rank), or an index below "
            f"{device_count}."
        )
    return device
