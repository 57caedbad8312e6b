"""`make gpu-check`: the GPU suite and the GPU benchmark, each under its own time limit.

Runs `pytest tests/gpu` and then `benchmarks/gpu.py` with this interpreter (the machine's own
python and packages; `PYTHONPATH=.` finds accel), writes their logs, the suite's JUnit XML,
the benchmark's JSON and a summary (`summary.json`: versions, every test's outcome, the
benchmark's figures, time taken) into --out. With --dry-run both run on the CPU at tiny sizes,
as CI runs them. Exits non-zero when a part failed or ran out of time.

    PYTHONPATH=. python3 tools/gpu_check.py --out gpu-check-out
    PYTHONPATH=. python3 tools/gpu_check.py --out gpu-check-out --dry-run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], log: Path, limit: float) -> dict[str, Any]:
    """Run `cmd` in its own process group, output to `log`; kill the group at `limit` seconds."""
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc, timed_out = proc.returncode, True
    return {"rc": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - start, 1),
            "limit_s": limit, "log": log.name}  # fmt: skip


def test_outcomes(junit: Path) -> dict[str, str]:
    """Each test's outcome ("passed", "failed", "error", "skipped: reason") from JUnit XML."""
    if not junit.is_file():
        return {}
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = child.tag if child.tag == "error" else "failed"
            elif child.tag == "skipped":
                outcome = f"skipped: {child.get('message', '')}"
        outcomes[name] = outcome
    return outcomes


def versions() -> dict[str, Any]:
    import importlib.util

    import torch

    found = {}
    for name in ("accelerate", "transformers", "safetensors", "pytest"):
        if importlib.util.find_spec(name) is not None:
            module = __import__(name)
            found[name] = getattr(module, "__version__", "?")
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if cuda else None,
        **found,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-out"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (what CI runs)")
    parser.add_argument("--suite-limit", type=float, default=None, help="seconds (250; dry 900)")
    parser.add_argument("--bench-limit", type=float, default=None, help="seconds (210; dry 600)")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # On a GPU the two parts together stay under 8 minutes; a loaded 2-core CI machine gets more.
    suite_limit = args.suite_limit or (900 if args.dry_run else 250)
    bench_limit = args.bench_limit or (600 if args.dry_run else 210)
    summary: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": args.dry_run, "versions": versions(),
    }  # fmt: skip
    junit = out / "pytest-junit.xml"
    pytest_cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider", "-rA",
                  f"--junitxml={junit}"] + (["--gpu-dry-run"] if args.dry_run else [])  # fmt: skip
    suite = run(pytest_cmd, out / "pytest.log", suite_limit)
    tests = test_outcomes(junit)
    counts = {k: sum(v.split(":")[0] == k for v in tests.values()) for k in
              ("passed", "failed", "error", "skipped")}  # fmt: skip
    suite_ok = suite["rc"] == 0 and not suite["timed_out"] and counts["passed"] > 0
    summary["suite"] = {**suite, **counts, "ok": suite_ok, "tests": tests}
    _write(out / "summary.json", summary)

    bench_json = out / "benchmark.json"
    bench_cmd = [sys.executable, "benchmarks/gpu.py", "--out", str(bench_json)]
    bench = run(bench_cmd + (["--dry-run"] if args.dry_run else []), out / "benchmark.log",
                bench_limit)  # fmt: skip
    figures = json.loads(bench_json.read_text()) if bench_json.is_file() else None
    bench_ok = bench["rc"] == 0 and bool(figures and figures.get("complete"))
    summary["benchmark"] = {**bench, "ok": bench_ok, "results": figures}
    summary["ok"] = suite_ok and bench_ok
    _write(out / "summary.json", summary)
    for name, outcome in tests.items():
        print(f"{outcome:>8}  {name}")
    print(f"suite: {suite['seconds']}s rc={suite['rc']}; benchmark: {bench['seconds']}s "
          f"rc={bench['rc']} complete={bench_ok}; summary: {out / 'summary.json'}")  # fmt: skip
    print(f"gpu-check: {counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
          f"{counts['skipped']} skipped")  # fmt: skip
    return 0 if summary["ok"] else 1


def _write(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    partial.replace(path)


if __name__ == "__main__":
    sys.exit(main())
