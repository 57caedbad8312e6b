"""How run_world's ranks start: from a forkserver that has imported torch (fast), with the
caller's environment at the call, and spawned instead when a variable read only at start-up
(PYTHONHASHSEED, TORCH_*, OMP_*, ...) changed since the forkserver started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel import RunContext
from accel.testing import run_world

pytestmark = pytest.mark.dist


def _seen(ctx: RunContext, names: list[str]) -> dict[str, object]:
    return {
        "env": {n: os.environ.get(n) for n in names},
        "hash": hash("accel"),  # decided by PYTHONHASHSEED when the interpreter started
        "parent": os.getppid(),
    }


def _hash_in_a_fresh_interpreter(seed: str) -> int:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", "print(hash('accel'))"], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return int(out.stdout)


def test_ranks_see_the_environment_at_the_call_and_start_from_the_forkserver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_world(_seen, world_size=2, args=([],))  # the forkserver is running from here on
    monkeypatch.setenv("ACCEL_TEST_SET_AFTER_START", "yes")
    monkeypatch.delenv("HOME", raising=False)
    for rank in run_world(_seen, world_size=2, args=(["ACCEL_TEST_SET_AFTER_START", "HOME"],)):
        assert rank["env"] == {"ACCEL_TEST_SET_AFTER_START": "yes", "HOME": None}
        assert rank["parent"] != os.getpid()  # the forkserver's child, not a spawned one


@pytest.mark.parametrize("seed", ["1", "2"])
def test_a_start_up_variable_changed_since_the_forkserver_started_is_honoured(
    monkeypatch: pytest.MonkeyPatch, seed: str
) -> None:
    run_world(_seen, world_size=2, args=([],))  # the forkserver runs, with another seed
    monkeypatch.setenv("PYTHONHASHSEED", seed)
    expected = _hash_in_a_fresh_interpreter(seed)
    for rank in run_world(_seen, world_size=2, args=(["PYTHONHASHSEED"],)):
        assert rank["env"] == {"PYTHONHASHSEED": seed}
        assert rank["hash"] == expected  # a forkserver child would have the server's hash
        assert rank["parent"] == os.getpid()  # spawned by the caller


_STARTED_ELSEWHERE = """
import json, multiprocessing as mp, os
from accel.testing import run_world

def seen(ctx):
    return {"hash": hash("accel"), "parent": os.getppid()}

if __name__ == "__main__":
    # Other code starts multiprocessing's one forkserver first (a DataLoader with
    # multiprocessing_context="forkserver", say), with another PYTHONHASHSEED.
    os.environ["PYTHONHASHSEED"] = "1"
    worker = mp.get_context("forkserver").Process(target=os.getpid)
    worker.start()
    worker.join()
    os.environ["PYTHONHASHSEED"] = "2"
    print(json.dumps({"ranks": run_world(seen, world_size=2), "caller": os.getpid()}))
"""


def test_a_forkserver_started_by_other_code_is_not_trusted_with_the_ranks(tmp_path: Path) -> None:
    """Its start-up variables and preload are another's: run_world spawns the ranks."""
    script = tmp_path / "started_elsewhere.py"
    script.write_text(_STARTED_ELSEWHERE)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    seen = json.loads(out.stdout)
    expected = _hash_in_a_fresh_interpreter("2")
    for rank in seen["ranks"]:
        assert rank["hash"] == expected  # not the server's seed 1
        assert rank["parent"] == seen["caller"]  # spawned by the caller
