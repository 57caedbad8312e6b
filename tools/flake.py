"""Hunt an intermittent failure: run chosen tests many times, each run in a fresh pytest, alone
or in company, and keep every failed run's output.

    python tools/flake.py --runs 50 --load slow --out flake-out tests/x.py::test_y ...

`--load` chooses the company: `none` (the tests alone), `slow` (beside a second pytest that
keeps running the suite's process-starting tests, tests/dist and tests/cli in a shuffled order:
the suite's own kind of work, with its process count) or `burn` (beside one busy process per
CPU). Each run writes run-NNN.log (everything pytest printed) and run-NNN.xml (its JUnit
report) into `--out`, with the tests' temporary folders under tmp-NNN (kept only when the run
failed). With `--cores`, a process that dies of a signal leaves a core file in its working
folder; each one found in a failed run's folders is turned into core-NNN-*.txt (every thread's
native stack, with gdb) and deleted. Every worker runs with PYTHONFAULTHANDLER=1, so a fatal
signal also prints the Python stacks. At the end: each failed run, with its failed tests' last
lines. Exits 1 when a run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).parent))
from failures import describe, read_failures  # this folder's own module

ROOT = Path(__file__).resolve().parents[1]
_COMPANY_FOLDERS = ("tests/dist", "tests/cli")  # every test there starts processes
_LOADS = ("none", "slow", "burn")


def _pytest(python: str, out: Path, name: str, tests: list[str]) -> list[str]:
    return [
        python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
        f"--basetemp={out / ('tmp-' + name)}", f"--junitxml={out / (name + '.xml')}",
        "-o", "junit_logging=all", "-o", "junit_log_passing_tests=false", *tests,
    ]  # fmt: skip


def _core_limit(enabled: bool) -> None:
    if enabled:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


@contextmanager
def company(load: str, python: str, out: Path, exclude: list[str], seed: int) -> Iterator[None]:
    """Run the chosen load beside the body; stop it (its whole process group) after."""
    if load == "none":
        yield
        return
    if load == "burn":
        command = [python, "-c", "while True: pass"]
        procs = [_start(command, out / "company.log") for _ in range(os.cpu_count() or 1)]
    else:
        loop = _company_loop(python, out, exclude, seed)
        procs = [_start([python, "-c", loop], out / "company.log")]
    try:
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):  # it ended on its own
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):  # it ended on its own
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as sink:
        return subprocess.Popen(
            command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )


def _company_loop(python: str, out: Path, exclude: list[str], seed: int) -> str:
    """A program that runs the suite's process-starting test files, shuffled, until killed."""
    found = (p for folder in _COMPANY_FOLDERS for p in (ROOT / folder).glob("test_*.py"))
    files = sorted(str(p.relative_to(ROOT)) for p in found)
    deselect = [arg for test in exclude for arg in ("--deselect", test)]
    base = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-m", "slow",
            f"--basetemp={out / 'tmp-company'}", *deselect]  # fmt: skip
    return (
        "import random, subprocess\n"
        f"files, base = {files!r}, {base!r}\n"
        f"rng = random.Random({seed})\n"
        "while True:\n"
        "    rng.shuffle(files)\n"
        "    for i in range(0, len(files), 4):\n"
        "        subprocess.run(base + files[i:i + 4])\n"
    )


def _backtraces(folder: Path, out: Path, name: str, python: str) -> list[Path]:
    """Every core file under `folder` as a text file of its threads' native stacks."""
    written = []
    for n, core in enumerate(sorted(p for p in folder.rglob("core*") if p.is_file())):
        text = out / f"core-{name}-{n}.txt"
        gdb = shutil.which("gdb")
        if gdb is None:
            text.write_text(f"{core}: gdb is not installed; core kept\n")
            written.append(text)
            continue
        result = subprocess.run(
            [gdb, "-batch", "-ex", "info threads", "-ex", "thread apply all bt", python, str(core)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        text.write_text(f"core file {core}\n{result.stdout}\n{result.stderr}")
        core.unlink()
        written.append(text)
    return written


def _run(command: list[str], env: dict[str, str], log: IO[bytes], args: argparse.Namespace) -> int:
    """One run's exit code (-1: timed out). The run is a session of its own: at its timeout, or
    when the hunt is stopped, it is killed with every process it started (launched workers)."""
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True, preexec_fn=lambda: _core_limit(args.cores),
    )  # fmt: skip
    try:
        return proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return -1
    finally:
        with contextlib.suppress(ProcessLookupError):  # ended, with everything it started
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def hunt(args: argparse.Namespace) -> int:
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    failed: list[str] = []
    started = time.monotonic()
    with company(args.load, args.python, out, args.tests, args.seed):
        for n in range(args.runs):
            name = f"run-{n:03d}"
            t0 = time.monotonic()
            with (out / f"{name}.log").open("wb") as log:
                rc = _run(_pytest(args.python, out, name, args.tests), env, log, args)
            took = time.monotonic() - t0
            if rc == 0:
                shutil.rmtree(out / f"tmp-{name}", ignore_errors=True)
                print(f"{name}: passed ({took:.0f} s)", flush=True)
                continue
            failed.append(name)
            why = "timed out" if rc == -1 else f"exit code {rc}"
            print(f"{name}: FAILED, {why} ({took:.0f} s): {out / (name + '.log')}", flush=True)
            for core in _backtraces(out / f"tmp-{name}", out, name, args.python):
                print(f"  native stacks of a core dump: {core}", flush=True)
    total = time.monotonic() - started
    print(f"\n{args.runs} runs (load: {args.load}) in {total:.0f} s: {len(failed)} failed")
    for name in failed:
        report = out / f"{name}.xml"
        print(f"\n===== {name} ({out / (name + '.log')})")
        if report.is_file():
            print(describe(list(read_failures(report, ROOT)), args.lines))
        else:  # killed at the timeout: no report; the log's end says where it was
            tail = (out / f"{name}.log").read_text(errors="replace").splitlines()[-args.lines :]
            print("\n".join(tail))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="+", help="pytest node ids or files")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--load", choices=_LOADS, default="none")
    parser.add_argument("--out", type=Path, default=ROOT / "flake-out")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--cores", action="store_true", help="keep native stacks of crashes")
    parser.add_argument("--lines", type=int, default=30)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--seed", type=int, default=0, help="the company's shuffle")
    args = parser.parse_args(argv)
    # Stopped (timeout, kill): end as on Ctrl-C, so the company is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return hunt(args)


if __name__ == "__main__":
    sys.exit(main())
