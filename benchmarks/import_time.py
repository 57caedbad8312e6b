"""How long `import accel` takes on top of `import torch`, in fresh processes.

    python benchmarks/import_time.py [--runs 21] [--quick]

Each run is a new interpreter that times `import torch`, then `import accel`; the table gives
medians. Target: accel adds at most 50 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBE = (
    "import json, time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter();"
    "import accel; t2 = time.perf_counter(); print(json.dumps([t1 - t0, t2 - t1]))"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--quick", action="store_true", help="5 runs instead of --runs")
    opts = parser.parse_args()
    runs = 5 if opts.quick else opts.runs
    samples = [
        json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                                  check=True).stdout)
        for _ in range(runs)
    ]  # fmt: skip
    torch_ms = statistics.median(s[0] for s in samples) * 1000
    accel_ms = statistics.median(s[1] for s in samples) * 1000
    print("| runs | import torch (ms) | import accel after torch (ms) | target |")
    print("|---|---|---|---|")
    verdict = "met" if accel_ms <= 50 else "MISSED"
    print(f"| {runs} | {torch_ms:.0f} | {accel_ms:.1f} | <= 50 ms: {verdict} |")


if __name__ == "__main__":
    main()
