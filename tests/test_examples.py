"""Every example runs a few steps under `accel launch` at 2 CPU processes, as its docstring says."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli.test_cli import accel_cli

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Example -> (arguments for a short run, a line its output must contain).
SMOKE = {
    "train_minimal.py": (["--steps", "20"], r"\[rank 0\] step 20 loss (\d+\.\d+)"),
    "one_piece.py": (["--epochs", "1"], r"epoch 0 accuracy \d\.\d+ on 200 samples"),
    "test_my_step.py": ([], r"\[rank 1\] parameters after 3 steps"),
    "char_lm.py": (
        ["--steps", "12", "--ckpt_every", "6", "--eval_every", "6", "--out", "run"],
        r"step 12 train_loss \d+\.\d+ lr 0\.000000 val_loss \d+\.\d+",
    ),
    "fsdp2.py": (["--steps", "10", "--out", "run"], r"step 10 loss \d+\.\d+ grad_norm \d+\.\d+"),
    "causal_lm_accumulation.py": (
        [],
        r"\[rank 1\] after 2 epochs the model matches the full-batch reference",
    ),
    "big_model_inference.py": (
        ["--out", "run"],
        r"\[rank 1\] prompts \[4, 5, 6, 7\]: outputs equal the fully loaded model",
    ),
}


def test_every_example_has_a_smoke_run_and_a_launch_command() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts, "no examples found"
    assert sorted(SMOKE) == scripts, "add each new example to SMOKE"
    for name in scripts:
        doc = (EXAMPLES / name).read_text()
        assert f"accel launch --num_processes 2 examples/{name}" in doc, name


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_example_runs_on_two_processes(tmp_path: Path, name: str) -> None:
    argv, expected = SMOKE[name]
    result = accel_cli(tmp_path, "launch", "--num_processes", "2", str(EXAMPLES / name), *argv)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(expected, result.stdout + result.stderr), result.stdout + result.stderr
    if name == "fsdp2.py":  # torch's FSDP2 warning about a module returning a view is avoided
        assert "Warning" not in result.stderr, result.stderr
    if name == "char_lm.py":  # the demo says where its outputs are and shows what it learned
        assert "outputs in run/: checkpoints/, metrics.jsonl, loss.csv" in result.stdout
        assert "generated sample:\nFirst Citizen:\n" in result.stdout
        lines = (tmp_path / "run" / "loss.csv").read_text().splitlines()
        assert lines[0] == "step,train_loss,val_loss" and len(lines) == 1 + 12
        try:
            import matplotlib  # noqa: F401  (the dev extra installs it)
        except ImportError:
            assert "matplotlib is not installed" in result.stdout
        else:
            assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_example_runs_under_the_device_canary(tmp_path: Path, name: str) -> None:
    # On a GPU, `accel launch` puts the model on the rank's GPU; a tensor an example made on the
    # default device (the host) then crashed it (issue 34 item 2), and a host tensor handed to
    # a collective fails on NCCL. The canary makes both fail here; two processes, so that the
    # collectives run.
    argv, expected = SMOKE[name]
    result = accel_cli(
        tmp_path, "launch", "--num_processes", "2", str(EXAMPLES / name), *argv,
        env={"ACCEL_DEVICE_CANARY": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert re.search(expected, result.stdout + result.stderr), result.stdout + result.stderr


@pytest.mark.slow
def test_train_minimal_learns_in_one_process(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_minimal.py"), "--steps", "40"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", run.stderr + run.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] / 4, losses


@pytest.mark.slow
def test_causal_lm_accumulation_matches_the_full_batch_reference_in_one_process() -> None:
    # The same recipe at 1 process (the 2-process run is in the smoke runs above): iter() per
    # epoch, shifted token counts, the remainder window at each epoch's end.
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "causal_lm_accumulation.py"), "--epochs", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "[rank 0] after 3 epochs the model matches the full-batch reference" in run.stdout


@pytest.mark.slow
def test_the_users_pytest_example_passes() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_step.py"],
        capture_output=True, text=True, timeout=300, cwd=EXAMPLES,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout


def _char_lm(tmp_path: Path, out: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "accel", "launch", "--num_processes", "2",
        "--gradient_accumulation_steps", "2", str(EXAMPLES / "char_lm.py"), "--out", out,
        "--steps", "40", "--ckpt_every", "10", "--eval_every", "20", *extra,
    ]  # fmt: skip


def _last_metrics(folder: Path) -> dict[str, float]:
    return json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.slow
def test_char_lm_killed_mid_run_and_resumed_ends_like_an_uninterrupted_run(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent)}
    done = subprocess.run(
        _char_lm(tmp_path, "straight"), cwd=tmp_path, env=env, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    # The same run, killed (SIGKILL, the whole process group) once its first checkpoint exists.
    victim = subprocess.Popen(
        _char_lm(tmp_path, "killed"), cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not (tmp_path / "killed" / "checkpoints" / "step-10").exists():
        assert victim.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    steps_before = len((tmp_path / "killed" / "metrics.jsonl").read_text().splitlines())
    assert steps_before < 40, "the run finished before it was killed"
    resumed = subprocess.run(
        _char_lm(tmp_path, "killed", "--resume"),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-3000:]
    final, reference = _last_metrics(tmp_path / "killed"), _last_metrics(tmp_path / "straight")
    assert final["step"] == 40
    assert final == reference  # bit-identical losses, learning rate and validation loss


@pytest.mark.slow
def test_char_lm_run_twice_into_one_folder_draws_the_same_curve(tmp_path: Path) -> None:
    """A second `make demo` appended its losses to the first's, so loss.png drew a line from
    the last step back to step 1: a fresh run starts its own record (issue 37 item 6)."""
    argv = ["--steps", "6", "--ckpt_every", "6", "--eval_every", "3", "--out", "run"]
    curves = []
    for _ in range(2):
        run = accel_cli(
            tmp_path, "launch", "--num_processes", "2", "--gradient_accumulation_steps", "2",
            str(EXAMPLES / "char_lm.py"), *argv,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr[-3000:]
        curves.append((tmp_path / "run" / "loss.csv").read_text())
    assert [len(c.splitlines()) for c in curves] == [1 + 6, 1 + 6]
    assert curves[1] == curves[0]
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r).get("step") for r in records] == [None, 1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_fsdp2_resumed_at_its_last_step_says_so_and_trains_on_with_more_steps(
    tmp_path: Path,
) -> None:
    """Issue 44 item 10: resumed with the default --steps, the example trained nothing and said
    nothing (then wrote the same model again)."""
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent)}

    def run(*argv: str) -> str:
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / "fsdp2.py"), "--out", "run", *argv],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    assert "step 10 loss" in run("--steps", "10")
    again = run("--steps", "10", "--resume")
    assert "resumed at step 10" in again and "nothing to train" in again, again
    assert "--steps" in again  # names the fix
    more = run("--steps", "20", "--resume")
    assert "resumed at step 10" in more and "step 20 loss" in more, more
