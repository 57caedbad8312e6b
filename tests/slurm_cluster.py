"""A real one-node SLURM cluster for the tests: munged, slurmctld and slurmd on 127.0.0.1.

Debian's packages (slurm-wlm, munge: `make cluster-engines` installs them where apt is
available). The daemons run in the foreground as children of the test session, from a
folder of their own (config, munge key and socket, state, logs): nothing outside it is
written, and nothing is left running when the session ends. No cgroups: processes are tracked
by /proc (proctrack/linuxproc, task/none), so it runs in a container. No slurmdbd (it needs a
MariaDB server: seconds to start and a large install for one check): each job's end is
recorded by SLURM's job completion log (jobcomp/filetxt: a line per run of a job, the
requeued ones included) and `scontrol show job` (JobState, Restarts). A requeued job waits
cred_expire + 1 s before it may start again (job_mgr.c, `batch_requeue_fini`; 120 s by
default): 5 s here.

A step that has not ended UnkillableStepTimeout (60 s) after SLURM's SIGKILL drains the node
("Kill task failed"), and every later job stays pending. SLURM then runs UnkillableStepProgram:
here it writes every process with its state and kernel wait channel, the kernel stack of each
thread in D, Z or T state and of slurmstepd's threads, to `unkillable-<job>.<step>.log`, whose
last 20,000 characters `Cluster.logs()` shows after the daemons' logs.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.dist.test_cluster_envs_dist import _ports

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "squeue")
CPUS = 8  # more than this machine may have (config_overrides): tasks plus a launcher each

# UnkillableStepProgram (slurmstepd runs it with SLURM_JOB_ID and SLURM_STEP_ID set)
UNKILLABLE = """#!/bin/bash
exec > "{root}/unkillable-$SLURM_JOB_ID.$SLURM_STEP_ID.log" 2>&1
date --iso-8601=ns
ps -eo pid,ppid,pgid,sid,stat,wchan:24,etime,args --forest
for stat in /proc/[0-9]*/task/[0-9]*/stat; do  # every thread: one stuck thread holds its process
    task=${{stat%/stat}}; pid=${{task#/proc/}}; pid=${{pid%%/*}}
    case "$(cut -d' ' -f3 "$stat" 2>/dev/null)" in
        D|Z|T|t) echo "--- pid $pid thread ${{task##*/}} $(cut -d' ' -f2-3 "$stat")" \\
                      "$(tr '\\0' ' ' < /proc/$pid/cmdline 2>/dev/null)"
                 cat "$task/stack" 2>/dev/null ;;
    esac
done
for task in $(pgrep -x slurmstepd | sed 's|.*|/proc/&/task/*|'); do  # or slurmstepd itself waits
    echo "--- slurmstepd thread $task $(cut -d' ' -f3 "$task/stat" 2>/dev/null)"
    cat "$task/stack" 2>/dev/null
done
"""


def missing() -> list[str]:
    """The SLURM and munge programs this machine lacks (empty: a cluster can start)."""
    return [name for name in (*DAEMONS, *CLIENTS, "munge") if shutil.which(name) is None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """A running cluster: its folder and the environment its client commands need."""

    root: Path
    env: Mapping[str, str] = field(default_factory=dict)

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command (sbatch, scontrol, ...) against this cluster."""
        return subprocess.run(
            argv, env={**os.environ, **self.env}, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields of one job (JobState, Restarts, ExitCode, ...)."""
        shown = self.run("scontrol", "show", "job", "--oneliner", job_id)
        assert shown.returncode == 0, shown.stderr
        return dict(p.split("=", 1) for p in shown.stdout.split() if "=" in p)

    def completions(self, job_id: str) -> list[dict[str, str]]:
        """The job completion log's records of one job, oldest first: one per run."""
        log = self.root / "jobcomp.txt"
        lines = log.read_text().splitlines() if log.exists() else []
        records = [dict(p.split("=", 1) for p in line.split() if "=" in p) for line in lines]
        return [r for r in records if r.get("JobId") == job_id]

    def wait_done(self, job_id: str, timeout: float = 120) -> dict[str, str]:
        """Wait until the job has ended for good (not pending, running or requeued)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.job(job_id)
            if state["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                return state
            assert time.monotonic() < deadline, (state, self.logs())
            time.sleep(0.2)

    def logs(self) -> str:
        """The daemons' logs (last 3,000 chars), then each unkillable-step record (last 20,000)."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-20000 if 'unkillable' in p.name else -3000 :]}"
            for p in sorted(self.root.glob("*.log"), key=lambda p: ("unkillable" in p.name, p))
        )


def _config(root: Path, node: str, ports: list[int]) -> str:
    return "\n".join([
        "ClusterName=accel-tests",
        f"SlurmctldHost={node}(127.0.0.1)",
        "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={ports[0]}", f"SlurmdPort={ports[1]}",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge.socket,cred_expire=5",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt", f"JobCompLoc={root}/jobcomp.txt",
        "SchedulerType=sched/builtin", "SchedulerParameters=sched_interval=1",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "SlurmdParameters=config_overrides",
        "MpiDefault=none", "ReturnToService=2", "JobRequeue=1", "KillWait=5", "MinJobAge=600",
        "SlurmctldDebug=info", "SlurmdDebug=info", f"UnkillableStepProgram={root}/unkillable.sh",
        f"NodeName={node} NodeHostname={node} NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        "",
    ])  # fmt: skip


@contextmanager
def slurm_cluster(root: Path) -> Iterator[Cluster]:
    """Start munged, slurmctld and slurmd in `root`; stop them (and every job) on the way out."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # munged wants its socket's folder searchable, not writable by others
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    node = socket.gethostname()
    unkillable = root / "unkillable.sh"
    unkillable.write_text(UNKILLABLE.format(root=root))
    unkillable.chmod(0o755)
    (root / "slurm.conf").write_text(_config(root, node, [int(p) for p in _ports(2)]))
    env = {"SLURM_CONF": str(root / "slurm.conf")}
    daemons: list[subprocess.Popen[bytes]] = []
    out = (root / "daemons.out").open("ab")
    cluster = Cluster(root=root, env=env)
    try:
        daemons.append(subprocess.Popen(
            ["munged", "-F", "--force", f"--socket={root}/munge.socket", f"--key-file={key}",
             f"--log-file={root}/munged.log", f"--pid-file={root}/munged.pid",
             f"--seed-file={root}/munged.seed"], stdout=out, stderr=out,
        ))  # fmt: skip
        _wait_for(lambda: (root / "munge.socket").exists(), "munged", cluster)
        for argv in (["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", node]):
            daemons.append(subprocess.Popen(argv, env={**os.environ, **env}, stdout=out,
                                            stderr=out))  # fmt: skip
        _wait_for(lambda: _node_idle(cluster, node), "slurmd registering as idle", cluster)
        yield cluster
    finally:
        cluster.run("scancel", "--full", "--user", "root", timeout=30)
        for daemon in reversed(daemons):  # slurmd first: it ends the jobs' step daemons
            daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        out.close()


def _node_idle(cluster: Cluster, node: str) -> bool:
    shown = cluster.run("scontrol", "show", "node", node)
    return shown.returncode == 0 and "State=IDLE" in shown.stdout


def _wait_for(ready: object, what: str, cluster: Cluster, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test SLURM cluster: {what} did not happen\n{cluster.logs()}")
        time.sleep(0.1)
