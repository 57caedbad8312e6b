"""`accel launch` on several machines checks the machines against each other before training.

Two (or three) `accel launch` processes on the loopback play the machines, as the two-machine
tests of tests/cli/test_restart.py do. Each case injects one misconfiguration that, before
the preflight, hung in torchrun's rendezvous or the workers' first collective (or trained with
settings differing between machines); each must be named in one line, naming the machine and
the setting, on every machine that must name it, with no launcher left hanging (HUNG_S) and no
process behind. A machine that never arrives is bounded by the rendezvous timeout
(join_timeout=2 here). How many seconds naming takes is measured by benchmarks/preflight.py
(target: 10 s), not asserted here: a wall-clock bound fails on a loaded machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from accel.cli import _preflight
from accel.config import Config
from tests.cli.test_cli import _env, _free_port
from tests.processes import leftovers

SCRIPT = "raise SystemExit('the script must not start: the preflight should have failed')\n"
C10D = ("--rdzv_backend", "c10d", "--rdzv_conf", "join_timeout=2")
HUNG_S = 60
"""A launcher still running this long after the last start hangs (unchecked, these cases waited
for torchrun's 900 s static rendezvous or the workers' first collective's 30 minutes)."""


@dataclass(frozen=True)
class Case:
    name: str
    machines: Sequence[Sequence[str]]  # each machine's own flags, after the common ones
    expected: str  # a part of the line that names the misconfiguration
    named_by: Sequence[int]  # the machines (launchers, in order) whose output must name it
    env: Sequence[dict[str, str]] = field(default_factory=lambda: ({}, {}))
    common: Sequence[str] = ("--num_machines", "2", "--num_processes", "2")


CASES = (
    Case("the same machine_rank on two machines",
         [["--machine_rank", "0"], ["--machine_rank", "0"]],
         "machine_rank=0 is given to two machines", [0, 1]),
    Case("a machine_rank out of range",
         [["--machine_rank", "0", *C10D], ["--machine_rank", "2", *C10D]],
         "machine_rank=2 must be below num_machines=2", [1]),
    Case("another --num_processes",
         [["--machine_rank", "0"], ["--machine_rank", "1", "--num_processes", "4"]],
         "num_processes=4 differs from machine 0 (", [0, 1]),
    Case("another --mixed_precision",
         [["--machine_rank", "0"], ["--machine_rank", "1", "--mixed_precision", "bf16"]],
         "mixed_precision='bf16' differs from machine 0 (", [0, 1]),
    Case("other mesh sizes",
         [["--machine_rank", "0", "--parallelism_config_dp_shard_size", "2"],
          ["--machine_rank", "1", "--parallelism_config_dp_replicate_size", "2"]],
         "parallelism_config.parallelism_config_dp_replicate_size=", [0, 1]),
    Case("another config file's settings",
         [["--machine_rank", "0"], ["--machine_rank", "1", "--config_file", "{other_yaml}"]],
         "gradient_accumulation_steps=4 differs from machine 0 (", [0, 1]),
    Case("main_process_ip resolving to loopback on machine 1",
         [["--machine_rank", "0", "--main_process_ip", "127.0.0.1", *C10D],
          ["--machine_rank", "1", "--main_process_ip", "localhost", *C10D]],
         "main_process_ip='localhost' resolves to 127.0.0.1, this machine's own loopback", [1]),
    Case("a wrong port on machine 1: it never arrives",
         [["--machine_rank", "0", *C10D],
          ["--machine_rank", "1", "--main_process_port", "{other_port}", *C10D]],
         "never ", [0, 1]),
    Case("another --num_machines",
         [["--machine_rank", "0", "--num_machines", "2"],
          ["--machine_rank", "1", "--num_machines", "3"]],
         "num_machines=3 differs from machine 0 (", [0, 1],
         common=("--num_processes", "6")),
    Case("no network interface for gloo on machine 1",
         [["--machine_rank", "0"], ["--machine_rank", "1"]],
         "Unable to find address for: no-such-nic0", [0, 1],
         env=({}, {"GLOO_SOCKET_IFNAME": "no-such-nic0"})),
)  # fmt: skip


def _run(case: Case, tmp: Path, script: Path) -> tuple[float, list[str], list[int | None]]:
    """Start the case's launchers; return the seconds from the last start until every machine
    that must name the misconfiguration ended, and every launcher's output and exit code."""
    port, other_port = _free_port(), _free_port()
    other_yaml = tmp / "other.yaml"
    other_yaml.write_text("gradient_accumulation_steps: 4\n")
    subst = {"other_port": str(other_port), "other_yaml": str(other_yaml)}
    launches = []
    try:
        for flags, env in zip(case.machines, case.env, strict=True):
            argv = [sys.executable, "-m", "accel", "launch", *case.common,
                    "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                    *(f.format(**subst) for f in flags), str(script)]  # fmt: skip
            launches.append(subprocess.Popen(
                argv, env={**_env(tmp), **env}, cwd=tmp, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            ))  # fmt: skip
        started = time.monotonic()
        for index in case.named_by:
            try:
                launches[index].wait(timeout=max(HUNG_S - (time.monotonic() - started), 0.1))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{case.name}: machine {index} hung {HUNG_S} s") from None
        elapsed = time.monotonic() - started
        outputs = [launch.communicate(timeout=60)[0] for launch in launches]
    finally:
        for launch in launches:
            launch.kill()
            launch.communicate()
    return elapsed, outputs, [launch.returncode for launch in launches]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_misconfigured_machine_is_named_and_no_launcher_hangs(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    folders = [tmp_path / f"case-{i}" for i in range(len(CASES))]
    for folder in folders:
        folder.mkdir()
    results = [_run(case, folder, script) for case, folder in zip(CASES, folders, strict=True)]
    for case, (_, outputs, codes) in zip(CASES, results, strict=True):
        for index in case.named_by:
            lines = [line for line in outputs[index].splitlines() if case.expected in line]
            assert lines, (case.name, index, outputs)
            assert lines[0].startswith("accel launch: "), (case.name, outputs)
            assert codes[index] not in (0, None), (case.name, codes, outputs)
        assert "Traceback" not in "".join(outputs), (case.name, outputs)
        assert "the script must not start" not in "".join(outputs), (case.name, outputs)
    wrong_port = results[
        [c.name for c in CASES].index("a wrong port on machine 1: it never arrives")
    ]
    assert "(127.0.0.1 is this machine's loopback address: only a machine 0 on this machine " \
        "answers there)" in wrong_port[1][1]  # fmt: skip
    assert leftovers(os.getpid()) == []


def test_a_setting_that_differs_is_named_with_both_values() -> None:
    def machine(rank: int, config: Config) -> _preflight.Machine:
        return _preflight.Machine(machine_rank=rank, host="node", pid=rank, resolved="10.0.0.1",
                                  settings=_preflight.compared_settings(config))  # fmt: skip

    first = machine(0, Config(num_machines=2, num_processes=16, main_process_ip="a"))
    same = machine(1, Config(num_machines=2, num_processes=16, main_process_ip="b",
                             machine_rank=1, gpu_ids="0,1"))  # fmt: skip
    assert _preflight.compare(first, same) == []  # its own rank, address spelling and GPUs
    other = machine(1, Config(num_machines=2, num_processes=8, seed=3))
    assert _preflight.compare(first, other) == [
        "accel launch: machine 1 (node, pid 1): num_processes=8 differs from machine 0 (node, "
        "pid 0)'s 16; every machine runs with the same settings (flags and config file) but its "
        "own machine_rank. Launch every machine with the same num_processes.",
        "accel launch: machine 1 (node, pid 1): seed=3 differs from machine 0 (node, pid 0)'s "
        "None; every machine runs with the same settings (flags and config file) but its own "
        "machine_rank. Launch every machine with the same seed.",
    ]


@pytest.mark.slow  # waits twice for a greeting that does not come (3 s each)
def test_a_machine_rejoining_a_running_c10d_job_skips_the_preflight() -> None:
    # Under c10d with --max_restarts a machine's launcher may come back while the others train:
    # the endpoint is torchrun's store then, which does not greet; the machine joins it.
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=30), wait_for_workers=False)
    config = Config(num_machines=2, num_processes=2, machine_rank=1, main_process_ip="127.0.0.1",
                    main_process_port=store.port, rdzv_backend="c10d", max_restarts=1)  # fmt: skip
    assert _preflight.preflight(config) == []
    refused = _preflight.preflight(dataclasses.replace(config, max_restarts=0))
    assert len(refused) == 1 and "answers, but not as machine 0's accel launch" in refused[0]


class _LateReader:
    """Machine 1's side of machine 0's store, each read arriving `delay` s late: a loaded or
    distant machine."""

    def __init__(self, store: Any, delay: float) -> None:
        self._store, self._delay = store, delay

    def set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._store.wait(keys, timeout)

    def get(self, key: str) -> bytes:
        time.sleep(self._delay)
        return bytes(self._store.get(key))


def test_a_machine_reading_the_device_reports_late_still_names_the_interface(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 41, from a fresh-clone run: machine 0's launcher holds the all-reduce's store; it read
    # every machine's device report and exited while machine 1 was still reading them, so
    # machine 1 said "the all-reduce through gloo between the 2 machines failed" instead of
    # naming GLOO_SOCKET_IFNAME. Both machines are threads here, so both name no-such-nic0.
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-nic0")
    config = Config(num_machines=2, num_processes=2, main_process_ip="127.0.0.1")
    host_side, machine_side = socket.socketpair()
    said: dict[int, list[str]] = {}

    def machine_0() -> None:
        said[0] = _preflight._all_reduce_as_host(config, "127.0.0.1", [host_side])

    host = threading.Thread(target=machine_0)
    host.start()
    with machine_side:
        port = json.loads(machine_side.makefile().readline())["port"]
    store = TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    said[1] = _preflight._all_reduce(config, 1, "", 0, store=_LateReader(store, delay=1.0))
    host.join(timeout=60)
    assert not host.is_alive()
    for lines in said.values():
        assert len(lines) == 2 and all("no-such-nic0" in line for line in lines), said
        assert all("GLOO_SOCKET_IFNAME to an interface" in line for line in lines), said
