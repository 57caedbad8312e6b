"""The `accel` command as a user runs it: real subprocesses, real files, real launches."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from accel.cli import _launch
from accel.config import Config
from tests.test_config import ACCELERATE_SAMPLE

REPO = Path(__file__).resolve().parents[2]

REPORT_SCRIPT = """
import json, sys
import accel
ctx = accel.init_distributed()
ranks = accel.gather_object(ctx, ctx.rank)
with open(f"{sys.argv[1]}/{ctx.rank}.json", "w") as f:
    json.dump({"rank": ctx.rank, "world_size": ctx.world_size, "precision": ctx.precision,
               "grad_accum_steps": ctx.grad_accum_steps, "seen": ranks, "device": str(ctx.device),
               "sources": dict(ctx.sources), "describe": ctx.describe()}, f)
accel.shutdown(ctx)
"""


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "RANK", "WORLD"))}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")  # no user config leaks in
    env["HF_HOME"] = str(tmp_path / "hf")  # nor Accelerate's, which `accel launch` also reads
    env["PYTHONPATH"] = str(REPO)
    return env


def accel_cli(
    tmp_path: Path, *argv: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "accel", *argv], env={**_env(tmp_path), **(env or {})},
        input=stdin, capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip


def _reports(folder: Path, n: int) -> list[dict]:
    return [json.loads((folder / f"{r}.json").read_text()) for r in range(n)]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "report.py"
    path.write_text(REPORT_SCRIPT)
    return path


def test_launch_two_processes_with_flags(tmp_path: Path, script: Path) -> None:
    out = accel_cli(
        tmp_path, "launch", "--num-processes", "2", "--mixed_precision", "bf16",
        "--gradient-accumulation-steps", "4", "--seed", "7", str(script), str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for rank, report in enumerate(_reports(tmp_path, 2)):
        assert (report["rank"], report["world_size"], report["seen"]) == (rank, 2, [0, 1])
        assert (report["precision"], report["grad_accum_steps"]) == ("bf16", 4)
        assert report["sources"]["precision"] == "env ACCEL_PRECISION"
    # docs/cli.md shows what rank 0's ctx.describe() prints under this very command.
    documented = (REPO / "docs" / "cli.md").read_text().split("rank 0 prints:\n\n```text\n")[1]
    assert _reports(tmp_path, 1)[0]["describe"] + "\n" == documented.split("```")[0]


def test_launch_reads_an_accelerate_config_file(tmp_path: Path, script: Path) -> None:
    config = tmp_path / "default_config.yaml"
    config.write_text(ACCELERATE_SAMPLE)  # num_processes: 2, mixed_precision: fp16, use_cpu
    out = accel_cli(tmp_path, "launch", "--config_file", str(config), str(script), str(tmp_path))
    assert out.returncode == 0, out.stderr
    reports = _reports(tmp_path, 2)
    assert [(r["world_size"], r["precision"], r["device"]) for r in reports] == [
        (2, "fp16", "cpu")
    ] * 2


def test_flags_override_the_default_config_written_by_accel_config(
    tmp_path: Path, script: Path
) -> None:
    answers = "1\n2\nyes\nbf16\n3\n"  # machines, processes, cpu, precision, accumulation
    written = accel_cli(tmp_path, "config", stdin=answers)
    assert written.returncode == 0, written.stderr
    default = tmp_path / "xdg" / "accel" / "default_config.yaml"
    shown = accel_cli(tmp_path, "config", "--show")
    assert f"Config in force: {default}" in shown.stdout and "mixed_precision: bf16" in shown.stdout
    out = accel_cli(tmp_path, "launch", "--mixed_precision", "fp32", str(script), str(tmp_path))
    assert out.returncode == 0, out.stderr
    reports = _reports(tmp_path, 2)
    assert [(r["precision"], r["grad_accum_steps"]) for r in reports] == [("fp32", 3)] * 2


def test_config_default_and_truncated_answers(tmp_path: Path) -> None:
    target = tmp_path / "c.yaml"
    assert accel_cli(tmp_path, "config", "--default", "--config-file", str(target)).returncode == 0
    assert "num_processes: 1" in target.read_text()
    out = accel_cli(tmp_path, "config", "--config_file", str(target), "--force", stdin="1\n")
    assert out.returncode == 2
    assert "input ended before 'How many processes in total?' was answered" in out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TRAIN_SCRIPT = """
import json, sys, torch
import accel
from torch.nn.parallel import DistributedDataParallel
ctx = accel.init_distributed()
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
ddp = DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    g = torch.Generator().manual_seed(10 * step + ctx.rank)
    x, y = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    opt.zero_grad()
with open(f"{sys.argv[1]}/{ctx.rank}.json", "w") as f:
    json.dump({"node": ctx.node_rank, "world": ctx.world_size,
               "params": [p.tolist() for p in model.parameters()]}, f)
accel.shutdown(ctx)
"""


def test_two_machines_on_one_host_train_and_agree(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    port = str(_free_port())
    common = ["launch", "--num_machines", "2", "--num_processes", "2", "--main_process_ip",
              "127.0.0.1", "--main_process_port", port]  # fmt: skip
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "accel",
                *common,
                "--machine_rank",
                str(r),
                str(script),
                str(tmp_path),
            ],
            env=_env(tmp_path),
            cwd=tmp_path,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    errors = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    reports = _reports(tmp_path, 2)
    assert [(r["node"], r["world"]) for r in reports] == [(0, 2), (1, 2)]
    assert reports[0]["params"] == reports[1]["params"]


@pytest.mark.parametrize(
    ("config", "flags", "message"),
    [
        ("num_processes: [2\n", [], "is not valid YAML"),
        ("num_procs: 2\n", [], "unknown key 'num_procs'"),
        ("num_processes: -3\n", [], "num_processes=-3 must be an integer >= 1"),
        ("", ["--num_processes", "-3"], "num_processes=-3 must be an integer >= 1"),
        (
            "",
            [
                "--num_processes",
                "3",
                "--num_machines",
                "2",
                "--main_process_ip",
                "h",
                "--main_process_port",
                "1",
            ],
            "num_processes=3 is not divisible by num_machines=2",
        ),
    ],
)
def test_bad_input_is_one_line_and_a_non_zero_exit(
    tmp_path: Path, script: Path, config: str, flags: list[str], message: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(config)
    out = accel_cli(tmp_path, "launch", "--config_file", str(path), *flags, str(script))
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_missing_script_and_busy_port(tmp_path: Path) -> None:
    out = accel_cli(tmp_path, "launch", "--num_processes", "2", "nope.py")
    assert out.returncode == 2 and out.stderr.strip() == (
        f"accel launch: error: script='nope.py' does not exist in {tmp_path}; pass the path of "
        "the training script (or -m with a module name)."
    )
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = accel_cli(tmp_path, "launch", "--main_process_port", str(port), "x.py")
    assert out.returncode == 2 and f"main_process_port={port} is in use" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_failing_script_exits_non_zero(tmp_path: Path) -> None:
    failing = tmp_path / "fail.py"
    failing.write_text("raise SystemExit(3)\n")
    out = accel_cli(tmp_path, "launch", "--num_processes", "2", str(failing))
    assert out.returncode == 1 and "accel launch: the script failed" in out.stderr


def test_env_and_help_and_selftest(tmp_path: Path) -> None:
    env = accel_cli(tmp_path, "env")
    assert (
        env.returncode == 0 and "- torch: " in env.stdout and "Config in force: none" in env.stdout
    )
    for command in ("config", "launch", "env", "test", "estimate-memory"):
        assert accel_cli(tmp_path, command, "--help").returncode == 0
    selftest = accel_cli(tmp_path, "test", "--num_processes", "2")
    assert selftest.returncode == 0, selftest.stderr
    assert "rank 1 of 2 ok" in selftest.stdout and "accel test: passed" in selftest.stdout


def test_estimate_memory_counts_tied_weights_once(tmp_path: Path) -> None:
    out = accel_cli(tmp_path, "estimate-memory", "tests.models:tied_lm")
    assert out.returncode == 0, out.stderr
    # 100*16 (tied, once) + 16*32+32 + 32*16+16 + 8 (buffer) = 2680 elements
    assert "2,680 elements; largest layer '0' (1,600)" in out.stdout
    assert "| float32 | 6.25 KiB | 10.47 KiB | 41.88 KiB |" in out.stdout
    bad = accel_cli(tmp_path, "estimate-memory", "tests.models")
    assert bad.returncode == 2 and "must look like 'package.module:callable'" in bad.stderr


def test_torchrun_arguments_for_each_topology() -> None:
    args = argparse.Namespace(log_dir=None, tee=None, module=True, script="m", script_args=["--x"])
    worker = ["--module", "accel_cli._worker"]  # runs the script, recording its exception
    # One machine, nothing to restart: static rendezvous on a free port (the quickest start).
    single = _launch.torchrun_argv(Config(num_processes=4), args)
    assert single[:4] == ["--nnodes", "1", "--nproc-per-node", "4"]
    assert single[8:10] == ["--master-addr", "127.0.0.1"] and single[10] == "--master-port"
    assert 0 < int(single[11]) < 65536
    assert single[-5:] == [*worker, "-m", "m", "--x"]
    port = _free_port()
    fixed = _launch.torchrun_argv(Config(num_processes=2, main_process_port=port), args)
    assert fixed[8:12] == ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    # With restarts: c10d rendezvous, where every attempt gets a fresh store.
    restarts = _launch.torchrun_argv(Config(num_processes=2, max_restarts=1), args)
    assert restarts[8] == "--standalone"
    both = _launch.torchrun_argv(Config(max_restarts=1, main_process_port=port), args)
    assert both[8:12] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    static = _launch.torchrun_argv(
        Config(num_processes=4, num_machines=2, machine_rank=1, main_process_ip="h",
               main_process_port=9, max_restarts=2), args)  # fmt: skip
    assert static[:8] == ["--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "2",
                          "--monitor-interval", "0.1"]  # fmt: skip
    assert static[8:14] == ["--node-rank", "1", "--master-addr", "h", "--master-port", "9"]
    c10d = _launch.torchrun_argv(
        Config(num_processes=2, num_machines=2, main_process_ip="h", main_process_port=9,
               rdzv_backend="c10d"), args)  # fmt: skip
    assert "--rdzv-endpoint" in c10d and c10d[c10d.index("--rdzv-endpoint") + 1] == "h:9"


def test_worker_environment_carries_the_settings() -> None:
    env = _launch.worker_environment(
        Config(
            mixed_precision="fp16",
            gradient_accumulation_steps=2,
            seed=5,
            use_cpu=True,
            gpu_ids="0,1",
            num_cpu_threads_per_process=3,
        )
    )
    assert env == {
        "ACCEL_PRECISION": "fp16", "ACCEL_GRAD_ACCUM_STEPS": "2", "ACCEL_SEED": "5",
        "ACCEL_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "0,1", "OMP_NUM_THREADS": "3",
    }  # fmt: skip


MODULE_SCRIPT = """
import json, os, sys, torch
import accel
ctx = accel.init_distributed()
print(f"hello from rank {ctx.rank}", flush=True)
with open(f"{sys.argv[1]}/{ctx.rank}.json", "w") as f:
    json.dump({"rank": ctx.rank, "threads": torch.get_num_threads(),
               "omp": os.environ.get("OMP_NUM_THREADS"), "name": __name__}, f)
accel.shutdown(ctx)
"""


def test_launch_a_module_with_threads_and_a_log_dir(tmp_path: Path) -> None:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "report.py").write_text(MODULE_SCRIPT)
    logs = tmp_path / "logs"
    out = accel_cli(
        tmp_path, "launch", "--num-processes", "2", "--num-cpu-threads-per-process", "2",
        "--log-dir", str(logs), "--tee", "3", "-m", "mypkg.report", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    reports = _reports(tmp_path, 2)
    assert [(r["rank"], r["threads"], r["omp"], r["name"]) for r in reports] == [
        (0, 2, "2", "__main__"),
        (1, 2, "2", "__main__"),
    ]
    # --tee 3: each worker's output is on the console and in its own file under --log-dir.
    assert "hello from rank 0" in out.stdout and "hello from rank 1" in out.stdout
    logged = sorted(p.read_text().strip() for p in logs.rglob("stdout.log"))
    assert logged == ["hello from rank 0", "hello from rank 1"]


RESTART_SCRIPT = """
import os, sys
from pathlib import Path
import accel
marker = Path(sys.argv[1]) / "failed-once"
ctx = accel.init_distributed()
if ctx.rank == 1 and not marker.exists():
    marker.write_text(os.environ["TORCHELASTIC_RESTART_COUNT"])
    raise SystemExit(1)
accel.wait_for_everyone(ctx)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
(Path(sys.argv[1]) / f"done-{ctx.rank}").write_text(attempt)
accel.shutdown(ctx)
"""


def test_max_restarts_restarts_a_script_that_fails_once(tmp_path: Path) -> None:
    script = tmp_path / "flaky.py"
    script.write_text(RESTART_SCRIPT)
    out = accel_cli(
        tmp_path, "launch", "--num_processes", "2", "--max-restarts", "1", str(script),
        str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # Rank 1 failed on attempt 0; the agent restarted both workers, which finished attempt 1.
    assert (tmp_path / "failed-once").read_text() == "0"
    assert [(tmp_path / f"done-{r}").read_text() for r in (0, 1)] == ["1", "1"]


def test_every_flag_reaches_torchrun_in_either_spelling(tmp_path: Path) -> None:
    from accel_cli import build_parser

    script = tmp_path / "s.py"
    script.write_text("")
    args = build_parser().parse_args(
        ["launch", "--max-restarts", "3", "--monitor_interval", "0.5", "--num-processes", "4",
         "--log_dir", "L", "--tee", "1", str(script), "--lr", "3"]
    )  # fmt: skip
    argv = _launch.torchrun_argv(_launch.resolve_config(args), args)
    assert argv[:8] == ["--nnodes", "1", "--nproc-per-node", "4", "--max-restarts", "3",
                        "--monitor-interval", "0.5"]  # fmt: skip
    assert argv[-9:] == ["--log-dir", "L", "--tee", "1", "--module", "accel_cli._worker",
                         str(script), "--lr", "3"]  # fmt: skip


def test_help_lists_every_subcommand_and_bad_tee_is_refused(tmp_path: Path) -> None:
    top = accel_cli(tmp_path, "--help")
    assert top.returncode == 0
    for command in ("config", "launch", "env", "test", "estimate-memory"):
        assert command in top.stdout
    launch_help = accel_cli(tmp_path, "launch", "--help").stdout
    for flag in ("--num_processes", "--num-processes", "--max_restarts", "--monitor_interval",
                 "--num_cpu_threads_per_process", "--log_dir", "--tee", "--module"):  # fmt: skip
        assert flag in launch_help
    # The installed `accel` command is the same entry point as `python -m accel`.
    script = subprocess.run(
        [str(Path(sys.executable).parent / "accel"), "--help"], env=_env(tmp_path),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert script.returncode == 0 and script.stdout == top.stdout
    bad = accel_cli(tmp_path, "launch", "--tee", "7", "x.py")
    assert bad.returncode == 2 and "--tee" in bad.stderr and "invalid choice" in bad.stderr


FIRST_FAILURE_SCRIPT = """
import atexit, os, sys, time
from pathlib import Path
import accel
ctx = accel.init_distributed()
folder = Path(sys.argv[1])
marker, rank_0_pid = folder / "rank1-raised", folder / "rank0-pid"


def exit_once_the_agent_has_reaped_rank_0():
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pid = rank_0_pid.read_text() if rank_0_pid.exists() else ""
        if pid and not Path("/proc", pid).exists():  # gone, not a zombie: the agent saw it exit
            return
        time.sleep(0.05)


if ctx.rank == 1:
    atexit.register(exit_once_the_agent_has_reaped_rank_0)  # the agent sees rank 0 fail first
    marker.write_text("")
    raise ValueError("boom on rank 1")
rank_0_pid.write_text(str(os.getpid()))
while not marker.exists():
    time.sleep(0.05)
time.sleep(0.5)
raise RuntimeError("rank 0 fails because rank 1 did")
"""


def test_the_last_line_of_a_failed_launch_names_the_rank_that_failed_first(
    tmp_path: Path,
) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FIRST_FAILURE_SCRIPT)
    out = accel_cli(tmp_path, "launch", "--num_processes", "2", str(script), str(tmp_path))
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines[-1] == "accel launch: rank 1 failed first: ValueError: boom on rank 1", lines[-8:]
    assert "accel launch: the script failed on ranks 0 (exited with code 1), 1" in lines[-2]
    # The tracebacks stay above, the script's own frames first (the runner's are not shown).
    line = FIRST_FAILURE_SCRIPT.splitlines().index('    raise ValueError("boom on rank 1")') + 1
    assert f'[rank1]:   File "{script}", line {line}, in <module>' in lines, lines


def test_help_and_usage_errors_do_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys, accel_cli\n"
        "for argv in (['--help'], ['launch', '--help'], ['launch', '--num_processes', 'x']):\n"
        "    try:\n        accel_cli.main(argv)\n    except SystemExit:\n        pass\n"
        "print(sorted(m for m in ('torch', 'accel') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True,
        timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_launch_help_groups_flags_as_accelerate_and_lists_each_once(tmp_path: Path) -> None:
    text = accel_cli(tmp_path, "launch", "--help").stdout
    titles = ["Hardware Selection Arguments:", "Resource Selection Arguments:",
              "Training Paradigm Arguments:", "Distributed GPUs:",
              "ParallelismConfig Arguments:"]  # fmt: skip
    positions = [text.index(t) for t in titles]
    assert positions == sorted(positions)
    assert "--num_processes N" in text and "--num-processes N" not in text
    assert "--fsdp_version" not in text  # as Accelerate: listed once --use_fsdp is given
    with_fsdp = accel_cli(tmp_path, "launch", "--use_fsdp", "--help").stdout
    assert "FSDP Arguments:" in with_fsdp and "--fsdp_version VALUE" in with_fsdp
    assert "--zero_stage" not in text
    with_ds = accel_cli(tmp_path, "launch", "--use_deepspeed", "--help").stdout
    assert "DeepSpeed Arguments:" in with_ds and "--zero_stage VALUE" in with_ds


def test_launch_flags_cover_every_accelerate_section_key() -> None:
    from accel_cli import _options, build_parser
    from accel_settings import SECTIONS, section_keys

    options = set(_options(build_parser(["launch"])))
    for name in SECTIONS:
        flags = {f"--{k}" for k in section_keys(name, flags=True)}
        assert flags <= options, sorted(flags - options)
