"""How long `import accel` takes on top of `import torch`, and how long `accel --help` takes,
in fresh processes.

    python benchmarks/import_time.py [--runs 21] [--quick]

Each import run is a new interpreter that times `import torch`, then `import accel`; the table
gives medians. Target: accel adds at most 50 ms. Each help run times the installed `accel`
command (`accel --help`, `accel launch --help`) from start to exit, next to `python -m accel
--help`, which imports accel and so torch. Target: under 0.1 s. Beside each wall time, the CPU
time: on a shared machine a process waits for a core, and its CPU time is the work itself.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROBE = (
    "import json, time; t0, c0 = time.perf_counter(), time.process_time(); import torch;"
    "t1, c1 = time.perf_counter(), time.process_time(); import accel;"
    "t2, c2 = time.perf_counter(), time.process_time();"
    "print(json.dumps([t1 - t0, t2 - t1, c2 - c1, c1 - c0]))"
)
# A user's interpreter reads accel's compiled bytecode (pip compiles a wheel's at install; a
# checkout's is written on first import). PYTHONDONTWRITEBYTECODE=1 in the caller's environment
# would make every run compile accel's ~90 modules from source, about three times the work.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
ACCEL = str(Path(sys.executable).parent / "accel")  # the console script `pip install` wrote
HELP_COMMANDS = (
    ("accel --help", [ACCEL, "--help"]),
    ("accel launch --help", [ACCEL, "launch", "--help"]),
    ("python -m accel --help", [sys.executable, "-m", "accel", "--help"]),
)


def _wall_and_cpu(argv: list[str]) -> tuple[float, float]:
    """Seconds from start to exit, and the CPU seconds (user + system) the command used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True, env=ENV)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--quick", action="store_true", help="5 runs instead of --runs")
    opts = parser.parse_args()
    runs = 5 if opts.quick else opts.runs
    samples = [
        json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                                  check=True, env=ENV).stdout)
        for _ in range(runs + 1)  # the first writes the bytecode caches where none are yet
    ][1:]  # fmt: skip
    torch_ms = statistics.median(s[0] for s in samples) * 1000
    accel_ms = statistics.median(s[1] for s in samples) * 1000
    accel_cpu_ms = statistics.median(s[2] for s in samples) * 1000
    torch_cpu_ms = statistics.median(s[3] for s in samples) * 1000
    print(
        "| runs | import torch: wall (ms) | CPU (ms) | import accel after torch: wall (ms) "
        "| CPU (ms) | target |"
    )
    print("|---|---|---|---|---|---|")
    verdict = "met" if accel_ms <= 50 else "MISSED"
    row = f"| {runs} | {torch_ms:.0f} | {torch_cpu_ms:.0f} | {accel_ms:.1f} | {accel_cpu_ms:.1f}"
    print(f"{row} | <= 50 ms: {verdict} |")
    # Interleaved, so a load spike on the machine hits every command alike.
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in HELP_COMMANDS}
    for _ in range(runs):
        for name, argv in HELP_COMMANDS:
            times[name].append(_wall_and_cpu(argv))
    print("\n| command | runs | wall, median (ms) | CPU, median (ms) | target (wall) |")
    print("|---|---|---|---|---|")
    for name, pairs in times.items():
        wall = statistics.median(w for w, _ in pairs) * 1000
        cpu = statistics.median(c for _, c in pairs) * 1000
        verdict = "met" if wall < 100 else "MISSED"
        target = "(for comparison)" if name.startswith("python") else f"< 100 ms: {verdict}"
        print(f"| `{name}` | {runs} | {wall:.0f} | {cpu:.0f} | {target} |")


if __name__ == "__main__":
    main()
