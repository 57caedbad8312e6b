"""How long `accel launch` on several machines takes to name each misconfiguration.

    python benchmarks/preflight.py [--rounds 5]

Runs the ten cases of tests/cli/test_preflight.py (two or three `accel launch` processes on
the loopback playing the machines, one misconfiguration each) and, beside them, a correct
two-machine launch of an empty script, the reference: the time a launch takes when nothing is
wrong. Each is timed from the last launcher's start until every launcher that must name the
misconfiguration has ended (for the reference: until both launches exited 0). Cases run one at
a time, in rounds whose order rotates, so load on the machine hits them alike; the table gives
the best and the median round. Every run's output is checked for the expected line, so a
case that stopped naming its misconfiguration fails here rather than timing something else.
Target: each case within 10 s on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cli.test_preflight import CASES, Case, _run

REFERENCE = Case("a correct launch (the reference)",
                 [["--machine_rank", "0"], ["--machine_rank", "1"]], "", [0, 1])  # fmt: skip


def _once(case: Case, folder: Path) -> float:
    folder.mkdir()
    script = folder / "train.py"
    script.write_text("" if case is REFERENCE else "raise SystemExit('must not start')\n")
    elapsed, outputs, codes = _run(case, folder, script)
    if case is REFERENCE:
        ok = codes == [0, 0]
    else:
        ok = all(
            any(case.expected in line for line in outputs[i].splitlines()) and codes[i] != 0
            for i in case.named_by
        )
    if not ok:
        raise SystemExit(f"{case.name}: not named as expected (exit codes {codes}): {outputs}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cases = [REFERENCE, *CASES]
    times: dict[str, list[float]] = {case.name: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            shift = r % len(cases)
            for i, case in enumerate(cases[shift:] + cases[:shift]):
                times[case.name].append(_once(case, Path(tmp) / f"round-{r}-case-{i}"))
    print(f"{args.rounds} rounds, load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| case | best (s) | median (s) |\n|---|---|---|")
    for case in cases:
        t = times[case.name]
        print(f"| {case.name} | {min(t):.2f} | {statistics.median(t):.2f} |")
    worst = max(statistics.median(times[c.name]) for c in CASES)
    print(f"\nslowest case's median: {worst:.2f} s (target: within 10 s)")


if __name__ == "__main__":
    main()
