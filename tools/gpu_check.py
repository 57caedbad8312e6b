"""`make gpu-check`: every path a GPU user takes, each part under its own time limit.

The parts: the GPU suite (`pytest tests/gpu`); every example under `accel launch
--num_processes 1 --mixed_precision bf16` with short arguments; README's training loop under
the same launch; `init_distributed(device=...)` with each spelling, a process each; a
transformers GPT-2 trained by hand, through accel and through Accelerate (losses and weights
bit-identical); that GPT-2 saved with save_pretrained and loaded by `dispatch_checkpoint` with
most of it offloaded; `estimate_memory`'s peak for the 1.2B step against
torch.cuda.max_memory_allocated of that step (the allocator's and NCCL's overhead measured
beside it); then, alone on the GPU, benchmarks/gpu.py's sections: the 1.2B step, the
GPT-2 loads and fp8 at dims 2048 and 4096. The correctness parts share the GPU (up to 4 at a
time, a core in four each); the timed ones run one after another.

On a GPU the whole check stays within 6 minutes (start-up excluded): each part has its limit,
the correctness parts must end within 150 s of the start and the timed ones within 360 s; a
part the budget cannot fit is reported as a timeout, not started. A failing part never stops
the others. --out gets at most five files: summary.json (versions; each part's status pass,
fail, timeout or skipped, seconds, limit, figures and, on failure, its log's tail), pytest.log,
pytest-junit.xml, benchmark.json (the benchmark's sections) and parts.log (every other part's
output). With --dry-run the same parts run on the CPU at tiny sizes, as CI runs them. Exits
non-zero when a part failed or ran out of time.

    PYTHONPATH=. python3 tools/gpu_check.py --out gpu-check-out
    PYTHONPATH=. python3 tools/gpu_check.py --out gpu-check-out --only fp8 --only offload
    PYTHONPATH=. python3 tools/gpu_check.py --out gpu-check-out --dry-run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUDGET_S = 360  # the whole check on one GPU, start-up excluded, so that a rerun fits beside it
SHARED_S = 150  # the correctness parts, which share the GPU, end by then
DRY_BUDGET_S, DRY_SHARED_S = 1800, 1200  # the dry run on a loaded 2-core CI machine
LOG_CAP = 1 << 20  # bytes of each part's log kept in parts.log (its tail)
FILE_CAP = 15 << 20  # no file in --out over 16 MiB

# Example -> (short arguments, a line its output must hold) at one process.
EXAMPLES = {
    "big_model_inference.py": (
        ["--out", "run"], r"\[rank 0\] prompts \[[\d, ]+\]: outputs equal the fully loaded model"
    ),
    "causal_lm_accumulation.py": (
        [], r"\[rank 0\] after 2 epochs the model matches the full-batch reference"
    ),
    "char_lm.py": (
        ["--steps", "12", "--ckpt_every", "6", "--eval_every", "6", "--out", "run"],
        r"step 12 train_loss \d+\.\d+ lr 0\.000000 val_loss \d+\.\d+",
    ),
    "fsdp2.py": (["--steps", "10", "--out", "run"], r"step 10 loss \d+\.\d+ grad_norm \d+\.\d+"),
    "one_piece.py": (["--epochs", "1"], r"epoch 0 accuracy \d\.\d+ on 200 samples"),
    "test_my_step.py": ([], r"\[rank 0\] parameters after 3 steps: -?\d+\.\d+"),
    "train_minimal.py": (["--steps", "20"], r"step 20 loss \d+\.\d+ stepped=True"),
}  # fmt: skip
LAUNCH = ["-m", "accel", "launch", "--num_processes", "1", "--mixed_precision", "bf16"]


@dataclass(frozen=True)
class Part:
    name: str
    cmd: list[str]
    limit: float  # seconds
    shared: bool  # runs beside other parts (correctness); False: alone (timed)
    kind: str  # how the outcome is read: "suite", "output", "json", "bench"
    expect: str = ""  # "output": a regex the log must match
    cwd: Path | None = None
    result: Path | None = None  # "json"/"bench": the file the part writes
    skip: str = ""  # why it does not run here


@dataclass
class Outcome:
    status: str
    seconds: float = 0.0
    limit_s: float = 0.0
    figures: Any = None
    log_tail: str = ""
    log: Path | None = field(default=None, repr=False)


def plan(dry_run: bool, work: Path, out: Path) -> list[Part]:
    """Every part, in the order they start; the correctness ones first."""
    py = sys.executable
    gpu = not dry_run

    def lim(on_gpu: float, dry: float) -> float:
        return on_gpu if gpu else dry

    junit = out / "pytest-junit.xml"
    parts = [Part("suite: pytest tests/gpu", [py, "-m", "pytest", "tests/gpu", "-p",
                  "no:cacheprovider", "-v", "-rA", "--durations=5", f"--junitxml={junit}"]
                  + (["--gpu-dry-run"] if dry_run else []), lim(150, 900), True, "suite",
                  result=junit)]  # fmt: skip
    parts.append(Part("GPT-2: hand = accel = Accelerate", [py, "tools/gpu_parts.py", "gpt2",
                      "--steps", "8" if gpu else "4", "--json", str(work / "gpt2.json")],
                      lim(90, 300), True, "json", result=work / "gpt2.json"))  # fmt: skip
    parts.append(Part("GPT-2 offload: dispatch_checkpoint", [py, "tools/gpu_parts.py", "offload",
                      "--json", str(work / "offload.json")], lim(60, 300), True, "json",
                      result=work / "offload.json"))  # fmt: skip
    parts.append(Part("estimate_memory vs the allocator: 1.2B step", [py, "tools/gpu_parts.py",
                      "estimate", "--json", str(work / "estimate.json")], lim(90, 300), True,
                      "json", result=work / "estimate.json"))  # fmt: skip
    for name in sorted(p.name for p in (ROOT / "examples").glob("*.py")):
        args, expect = EXAMPLES.get(name, ([], ""))
        cwd = work / name.removesuffix(".py")
        parts.append(Part(f"example: {name}", [py, *LAUNCH, str(ROOT / "examples" / name), *args],
                          lim(60, 300), True, "output", expect=expect, cwd=cwd))  # fmt: skip
    parts.append(Part("sp=1 step unchanged: hand / accel / Ulysses",
                      [py, "tools/gpu_parts.py", "ulysses", "--steps", "10" if gpu else "2",
                       "--json", str(work / "ulysses.json")], lim(90, 300), False, "json",
                      result=work / "ulysses.json"))  # fmt: skip
    parts.append(Part("README loop", [py, *LAUNCH, str(work / "readme_loop.py")], lim(60, 300),
                      True, "output", expect=r"(?m)^-?\d+\.\d+(e-?\d+)?$",
                      cwd=work / "readme"))  # fmt: skip
    from tools.gpu_parts import CPU_SPELLINGS, GPU_SPELLINGS

    for spelling in (*GPU_SPELLINGS, "bad-index") if gpu else CPU_SPELLINGS:
        kind, _, value = spelling.partition(":")
        labels = {"device": f"torch.device({value!r})", "int": value, "str": repr(value)}
        name = f"init_distributed(device={labels[kind]})" if kind in labels else (
            "init_distributed(device='cuda:N'), no such GPU")  # fmt: skip
        result = work / f"init-{len(parts)}.json"
        parts.append(Part(name, [py, "tools/gpu_parts.py", "init",
                          "--spelling", spelling, "--json", str(result)], lim(45, 120), True,
                          "json", result=result))  # fmt: skip
    bench = [py, "benchmarks/gpu.py"] + (["--dry-run"] if dry_run else [])
    no_ao = "" if importlib.util.find_spec("torchao") else "torchao not installed"
    for name, args, limit, skip in (
        ("bench: 1.2B step, hand/accel/Accelerate", ["--only", "step"], lim(60, 300), ""),
        ("bench: GPT-2 loads, accel/Accelerate", ["--only", "load"], lim(45, 300), ""),
        ("fp8: dim 2048, 4 layers", ["--only", "fp8", "--fp8-dims", "2048"], lim(110, 300), no_ao),
        ("fp8: dim 4096, 2 layers", ["--only", "fp8", "--fp8-dims", "4096"], lim(130, 300), no_ao),
    ):
        result = work / f"bench-{len(parts)}.json"
        parts.append(Part(name, [*bench, *args, "--out", str(result)], limit, False, "bench",
                          result=result, skip=skip))  # fmt: skip
    return parts


def run(part: Part, limit: float, log: Path) -> tuple[int, bool, float]:
    """Run the part in its own process group, output to `log`; kill the group at `limit`."""
    start = time.monotonic()
    (part.cwd or ROOT).mkdir(parents=True, exist_ok=True)
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    with log.open("w") as out:
        proc = subprocess.Popen(
            part.cmd, cwd=part.cwd or ROOT, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, env=env,
        )  # fmt: skip
        try:
            rc, timed_out = proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc, timed_out = proc.returncode, True
    return rc, timed_out, round(time.monotonic() - start, 1)


def judge(part: Part, rc: int, timed_out: bool, log: Path) -> tuple[str, Any]:
    """The part's status and figures from its exit code, log and result file."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    figures: Any = None
    if part.result is not None and part.result.is_file() and part.kind != "suite":
        figures = json.loads(part.result.read_text())
    if part.kind == "suite":
        figures = test_outcomes(part.result, text) if part.result else {}
    elif part.kind == "output" and part.expect:
        found = re.search(part.expect, text)
        figures = found.group(0).strip() if found else None
    if timed_out:
        return "timeout", figures
    fp8 = figures.get("fp8") if part.kind == "bench" and isinstance(figures, dict) else None
    if isinstance(fp8, dict) and "skipped" in fp8:
        return f"skipped: {fp8['skipped']}", figures
    ok = rc == 0
    if part.kind == "suite":
        ok = ok and figures["counts"]["passed"] > 0
    elif part.kind == "output":
        ok = ok and (not part.expect or figures is not None)
    elif part.kind == "bench":
        ok = ok and bool(figures and figures.get("complete"))
    elif part.kind == "json":
        ok = ok and figures is not None
    return ("pass" if ok else "fail"), figures


def test_outcomes(junit: Path, log: str) -> dict[str, Any]:
    """Counts and each test's outcome ("passed", "failed", "error", "skipped: reason"), from
    the JUnit XML; from the verbose log's lines when pytest was killed before writing it."""
    outcomes = {}
    if not junit.is_file():
        for name, outcome in re.findall(
            r"(?m)^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", log
        ):
            outcomes[name] = {"FAILED": "failed"}.get(outcome, outcome.lower())
    else:
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = child.tag if child.tag == "error" else "failed"
                elif child.tag == "skipped":
                    outcome = f"skipped: {child.get('message', '')}"
            outcomes[name] = outcome
    counts = {k: sum(v.split(":")[0] == k for v in outcomes.values())
              for k in ("passed", "failed", "error", "skipped")}  # fmt: skip
    return {"counts": counts, "tests": outcomes}


def versions() -> dict[str, Any]:
    import torch

    found = {}
    for name in ("accelerate", "transformers", "safetensors", "torchao", "pytest"):
        # the installed distribution's version, without importing it (seconds each)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if cuda else None,
        **found,
    }  # fmt: skip


def readme_loop() -> str:
    """README.md's python block that trains (calls init_distributed), found as test_docs does."""
    from tests.test_docs import python_blocks

    blocks = python_blocks(ROOT / "README.md")
    return next(code for _, code in blocks if "init_distributed(" in code)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-out"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (what CI runs)")
    parser.add_argument("--only", action="append", default=[],
                        help="run only the parts whose name holds this (repeatable)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=None, help="seconds for all (360)")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget or (DRY_BUDGET_S if args.dry_run else BUDGET_S)
    shared_s = min(budget, DRY_SHARED_S if args.dry_run else SHARED_S)
    start = time.monotonic()
    summary: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": args.dry_run, "budget_s": budget, "shared_s": shared_s,
        "versions": versions(), "parts": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        (work / "readme").mkdir()
        (work / "readme_loop.py").write_text(readme_loop())
        parts = plan(args.dry_run, work, out)
        outcomes: dict[str, Outcome] = {}

        def do(part: Part, deadline: float) -> Outcome:
            try:
                return attempt(part, deadline)
            except Exception:  # the check's own defect in one part: report it, run the rest
                return Outcome("fail", log_tail=traceback.format_exc()[-3000:])

        def attempt(part: Part, deadline: float) -> Outcome:
            chosen = not args.only or any(o.lower() in part.name.lower() for o in args.only)
            if not chosen:
                return Outcome("skipped: not chosen (--only)")
            if part.skip:
                return Outcome(f"skipped: {part.skip}")
            left = deadline - time.monotonic()
            if left < 5:
                return Outcome("timeout", log_tail="not started: its phase's time was spent")
            limit = min(part.limit, left)
            if part.result is not None:  # never read a result an earlier check left in --out
                part.result.unlink(missing_ok=True)
            log = work / f"log-{parts.index(part)}.txt"
            rc, timed_out, seconds = run(part, limit, log)
            status, figures = judge(part, rc, timed_out, log)
            tail = "" if status == "pass" or status.startswith("skipped") else _tail(log, 3000)
            if status == "fail" and rc == 0 and part.kind == "output":
                tail = f"exit 0, but no line matches {part.expect!r}; the log ends:\n{tail}"
            elif status == "timeout":
                tail = f"ran past its {limit:.0f} s limit; the log ends:\n{tail}"
            elif status != "pass" and not status.startswith("skipped"):
                tail = f"exit code {rc}; the log ends:\n{tail}"
            return Outcome(status, seconds, round(limit, 1), figures, tail, log)

        def record(part: Part, outcome: Outcome) -> None:
            outcomes[part.name] = outcome
            print(f"{outcome.status[:40]:<8} {outcome.seconds:6.1f}s  {part.name}", flush=True)
            summary["parts"] = {p.name: _entry(outcomes[p.name]) for p in parts
                                if p.name in outcomes}  # fmt: skip
            _write(out / "summary.json", summary)
            collect(parts, outcomes, out)  # the logs so far, should the check itself be killed

        workers = max(1, min(4, (os.cpu_count() or 1) // 4))  # 4 on 16 cores, 1 on CI's 2
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            shared = [p for p in parts if p.shared]
            futures = {pool.submit(do, p, start + shared_s): p for p in shared}
            for future in concurrent.futures.as_completed(futures):
                record(futures[future], future.result())
        for part in (p for p in parts if not p.shared):
            record(part, do(part, start + budget))
    summary["seconds"] = round(time.monotonic() - start, 1)
    failed = [n for n, o in outcomes.items() if o.status in ("fail", "timeout")]
    summary["ok"] = not failed
    _write(out / "summary.json", summary)
    print_table(parts, outcomes, summary["seconds"], budget, out)
    return 0 if summary["ok"] else 1


def collect(parts: list[Part], outcomes: dict[str, Outcome], out: Path) -> None:
    """pytest.log, benchmark.json (the sections merged) and parts.log (the rest) into out."""
    bench: dict[str, Any] = {}
    with (out / "parts.log").open("w") as log:
        for part in parts:
            o = outcomes.get(part.name)
            if o is None or o.log is None or not o.log.is_file():
                continue
            if part.kind == "suite":
                shutil.copyfile(o.log, out / "pytest.log")
                _cap(out / "pytest.log")
                continue
            log.write(f"==== {part.name}: {o.status}, {o.seconds} s\n$ {' '.join(part.cmd)}\n")
            log.write(_tail(o.log, LOG_CAP) + "\n")
    for part in parts:
        figures = outcomes[part.name].figures if part.name in outcomes else None
        if part.kind == "bench" and isinstance(figures, dict):
            for key, value in json.loads(json.dumps(figures)).items():  # a copy to merge into
                if key == "fp8" and isinstance(bench.get("fp8"), dict) and "widths" in value:
                    bench["fp8"]["widths"].update(value["widths"])
                else:
                    bench.setdefault(key, value)
    if bench:
        _write(out / "benchmark.json", bench)


def print_table(parts: list[Part], outcomes: dict[str, Outcome], seconds: float, budget: float,
                out: Path) -> None:  # fmt: skip
    print(f"\n{'part':<46} {'status':<8} {'s':>6}  note")
    for part in parts:
        o = outcomes[part.name]
        if o.status == "pass":
            note = _note(o)
        elif o.status == "timeout":  # how long it ran, or that it did not start
            note = o.log_tail.partition(";")[0].partition("\n")[0]
        else:  # the reason: a skip's, else the log's last line
            note = o.status.partition(": ")[2] or " ".join(o.log_tail.strip().splitlines()[-1:])
        print(f"{part.name[:46]:<46} {o.status.split(':')[0]:<8} {o.seconds:6.1f}  {note[:70]}")
    bad = sum(o.status in ("fail", "timeout") for o in outcomes.values())
    print(f"gpu-check: {len(parts) - bad} of {len(parts)} parts passed or skipped, {bad} failed; "
          f"{seconds:.0f} s of {budget:.0f}; summary: {out / 'summary.json'}")  # fmt: skip


def _note(o: Outcome) -> str:
    """One key figure of a passing part."""
    f = o.figures
    if isinstance(f, str):
        return f
    if not isinstance(f, dict):
        return ""
    if "counts" in f:
        return ", ".join(f"{v} {k}" for k, v in f["counts"].items() if v)
    if "losses" in f:
        return f"losses equal over {f['steps']} steps: {f['losses']['hand'][-1]:.4f} last"
    if "modules_per_device" in f:
        return f"{f['modules_per_device']}, max |diff| {f['max_abs_diff']:.1e}"
    if "ctx.device" in f or "error" in f:
        return str(f.get("ctx.device") or f["error"])
    if "step" in f and f["step"].get("variants"):
        v = f["step"]["variants"]
        return ", ".join(f"{k}: {x['ratio_to_hand']:.3f}x" for k, x in v.items() if "hand" not in k)
    if "load" in f:
        v = f["load"]["variants"]
        return "; ".join(f"{k}: {x['accel median_s']:.2f} s" for k, x in v.items())
    if "fp8" in f:
        return "; ".join(f"{n} {x['speedup_over_bf16']:.2f}x" for w in f["fp8"]["widths"].values()
                         for n, x in w["variants"].items() if "fp8" in n)  # fmt: skip
    return ""


def _entry(o: Outcome) -> dict[str, Any]:
    entry = {"status": o.status, "seconds": o.seconds, "limit_s": o.limit_s, "figures": o.figures}
    return {**entry, "log_tail": o.log_tail} if o.log_tail else entry


def _tail(path: Path, size: int) -> str:
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, 2) - size))
        return f.read().decode(errors="replace")


def _cap(path: Path) -> None:
    if path.stat().st_size > FILE_CAP:
        path.write_text("[head cut: the file's last 15 MiB]\n" + _tail(path, FILE_CAP))


def _write(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=2, default=str) + "\n")
    partial.replace(path)


if __name__ == "__main__":
    sys.exit(main())
