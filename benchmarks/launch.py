"""Start-up time of `accel launch` against torchrun for the same two-process script.

    python benchmarks/launch.py [--runs 11] [--quick]

Each run starts a whole two-process job from a fresh interpreter and times it until the
launcher exits: `python -m accel launch --num_processes 2 script.py` against
`python -m torch.distributed.run --nproc_per_node 2 script.py`, and torchrun with
`--standalone` (the rendezvous `accel launch` uses on one machine). The script creates the
gloo process group, meets the other rank once and exits. Runs are interleaved (accel, torchrun,
torchrun --standalone, then the next round in a rotated order) so load on the machine hits all of
them alike. The table gives medians of the wall time and of the CPU time the whole job used
(launcher and workers, user + system): on a busy machine the CPU time is the steadier measure of
what the launcher itself costs. Target: accel within 1.1x of torchrun.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _commands(script: str) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "accel launch": [py, "-m", "accel", "launch", "--num_processes", "2", script],
        "torchrun": [py, "-m", "torch.distributed.run", "--nproc_per_node", "2", script],
        "torchrun --standalone": [
            py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script
        ],
    }  # fmt: skip


def _time(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    if command[2] == "torch.distributed.run" and "--standalone" not in command:
        # Plain torchrun rendezvous on MASTER_PORT 29500 by default; pick a free one so
        # other jobs on the machine cannot collide with it (costs torchrun nothing).
        command = [*command[:3], "--master_port", str(_free_port()), *command[3:]]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=11, help="runs of each command")
    parser.add_argument("--quick", action="store_true", help="3 runs instead of --runs")
    opts = parser.parse_args()
    runs = 3 if opts.quick else opts.runs
    repo = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as folder:
        env["XDG_CONFIG_HOME"] = folder  # no user config file changes the accel run
        script = Path(folder) / "script.py"
        script.write_text(SCRIPT)
        commands = _commands(str(script))
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for command in commands.values():  # warm the file cache once, not timed
            _time(command, env)
        names = list(commands)
        for round_ in range(runs):
            for name in names[round_ % 3 :] + names[: round_ % 3]:
                samples[name].append(_time(commands[name], env))
    wall = {name: statistics.median(s[0] for s in times) for name, times in samples.items()}
    cpu = {name: statistics.median(s[1] for s in times) for name, times in samples.items()}
    print(
        f"| command ({runs} runs, interleaved) | wall (s) | vs torchrun | CPU (s) | vs torchrun |"
    )
    print("|---|---|---|---|---|")
    for name in names:
        print(f"| `{name}` | {wall[name]:.2f} | {wall[name] / wall['torchrun']:.3f}x "
              f"| {cpu[name]:.2f} | {cpu[name] / cpu['torchrun']:.3f}x |")  # fmt: skip
    for label, medians in (("wall", wall), ("CPU", cpu)):
        ratio = medians["accel launch"] / medians["torchrun"]
        verdict = "met" if ratio <= 1.1 else "MISSED"
        print(f"\n{label}: accel launch / torchrun = {ratio:.3f}x (target <= 1.1x: {verdict})")


if __name__ == "__main__":
    main()
