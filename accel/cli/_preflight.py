"""`accel launch` on several machines: before training, check in seconds what otherwise hangs.

A machine launched with another rank, world size or setting than the others, or one that looks
for machine 0 on its own loopback, does not fail under torchrun: its rendezvous or its first
collective waits (torchrun's static rendezvous for 900 s, c10d's for `join_timeout`, a
collective for the process group's timeout), or the run trains with settings that differ from
machine to machine. So before torchrun's agent starts, every `accel launch` meets machine 0's
at the rendezvous endpoint (`main_process_ip:main_process_port`, the address and port the
run uses anyway) and says who it is: machine rank, host, how it resolved the endpoint, and every
setting it read (flags and config file) but its own (`per_machine` rows). Machine 0 compares
them as they arrive (a digest first, then setting by setting) and answers every machine; then
the machines run one all-reduce through gloo between them, which needs what the workers'
collectives need (each machine reaching the others' ports on the interface gloo picks). Each
failure is one line naming the machine and the setting, printed on every machine.

The exchange is newline-terminated JSON over one TCP connection per machine, which machine 0's
launcher accepts while the workers do not exist yet. It closes its listening socket before it
answers, so a machine told to go on can only meet torchrun's own store on that port after it.
Nothing runs at `num_machines` 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import Any

from accel import config as _config
from accel._version import __version__
from accel_settings import KEYS

GREETING = MappingProxyType({"accel_preflight": 1})
"""What machine 0's launcher sends on every connection first (a TCPStore never speaks first)."""
GREETING_S = 3.0
"""How long a machine waits for that greeting before taking the endpoint for something else."""
ALL_REDUCE_S = 30
"""The timeout of the all-reduce between the machines (gloo's connections and the reduce)."""
STATIC_TIMEOUT_S = 900
"""torchrun's rendezvous timeout (torch.distributed.launcher.api), which static rendezvous uses."""
C10D_JOIN_TIMEOUT_S = 600
"""c10d's join_timeout when --rdzv_conf names none (torch's dynamic_rendezvous.py)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    """What one machine's launcher says about itself."""

    machine_rank: int
    host: str  # socket.gethostname()
    pid: int  # the launcher's process id
    resolved: str  # the address main_process_ip resolved to on this machine
    settings: tuple[tuple[str, str], ...]  # every setting but the per-machine ones, spelled

    @property
    def name(self) -> str:
        return f"machine {self.machine_rank} ({self.host}, pid {self.pid})"

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.settings).encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "digest": self.digest}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Machine:
        settings = tuple((str(k), str(v)) for k, v in data["settings"])
        return cls(machine_rank=int(data["machine_rank"]), host=str(data["host"]),
                   pid=int(data["pid"]), resolved=str(data["resolved"]),
                   settings=settings)  # fmt: skip


def compared_settings(config: _config.Config) -> tuple[tuple[str, str], ...]:
    """Every setting the launcher read, spelled, but a machine's own (`per_machine` rows); the
    versions of accel and torch with them, which every machine must run too."""
    import torch

    out = [("accel version", __version__), ("torch version", str(torch.__version__))]
    for key, value in _config.as_mapping(config).items():
        if key in KEYS and KEYS[key].per_machine:
            continue
        if isinstance(value, dict):  # a section: each of its keys on its own
            out += [(f"{key}.{k}", repr(v)) for k, v in sorted(value.items())]
        else:
            out.append((key, repr(value)))
    return tuple(out)


def compare(first: Machine, other: Machine) -> list[str]:
    """The lines for each setting in which `other` differs from `first` (machine 0)."""
    if other.digest == first.digest:
        return []
    mine, theirs = dict(first.settings), dict(other.settings)
    return [
        f"accel launch: {other.name}: {key}={theirs.get(key, '(not set)')} differs from "
        f"{first.name}'s {mine.get(key, '(not set)')}; every machine runs with the same "
        f"settings (flags and config file) but its own machine_rank. Launch every machine with "
        f"the same {key}."
        for key in sorted(set(mine) | set(theirs))
        if mine.get(key) != theirs.get(key)
    ]


def duplicate(seen: Machine, other: Machine, num_machines: int) -> str:
    """The line for two machines launched with the same machine_rank."""
    return (
        f"accel launch: machine_rank={other.machine_rank} is given to two machines, "
        f"{seen.host} (pid {seen.pid}) and {other.host} (pid {other.pid}); each machine takes "
        f"its own rank in 0..{num_machines - 1}. Pass --machine_rank {other.machine_rank} to "
        "one machine only."
    )


def timeout_s(config: _config.Config) -> int:
    """How long machines wait for each other: the rendezvous timeout torchrun would wait."""
    if config.rdzv_backend != "c10d":
        return STATIC_TIMEOUT_S
    conf = dict(p.split("=", 1) for p in (config.rdzv_conf or "").split(",") if p)
    return int(conf.get("join_timeout", C10D_JOIN_TIMEOUT_S))


def _longer(config: _config.Config) -> str:
    if config.rdzv_backend == "c10d":
        return "or wait longer with --rdzv_conf join_timeout=SECONDS"
    return "or start them within torchrun's static rendezvous timeout"


def resolve(config: _config.Config, me: str) -> tuple[str, str | None]:
    """The address main_process_ip resolves to here, and the line refusing it (or None): a name
    that does not resolve, or one that resolves to this machine's loopback on a machine that
    is not machine 0 (it would look for machine 0 on itself). A loopback address written as
    one (127.0.0.1) is taken as meant: every machine runs on this one."""
    ip, port = str(config.main_process_ip), config.main_process_port
    try:
        found = str(socket.getaddrinfo(ip, port, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as err:
        return "", (
            f"accel launch: {me}: main_process_ip={ip!r} does not resolve on this machine "
            f"({err}); it must name machine 0 as every machine reaches it. Pass machine 0's IP "
            "address, or a name this machine resolves."
        )
    if config.machine_rank == 0 or not ipaddress.ip_address(found).is_loopback:
        return found, None
    try:
        ipaddress.ip_address(ip)
        return found, None  # written as a loopback address: the machines share this one
    except ValueError:
        pass
    return found, (
        f"accel launch: {me}: main_process_ip={ip!r} resolves to {found}, this machine's own "
        f"loopback address, on machine {config.machine_rank}, which is not machine 0; it would "
        "look for machine 0 on itself. Pass machine 0's address as the other machines reach it "
        "(or fix this name in /etc/hosts), or 127.0.0.1 when every machine runs on this one."
    )


def preflight(config: _config.Config) -> list[str]:
    """Check the machines of a launch against each other; return the failure lines (none: go).

    Run by every machine's `accel launch` before torchrun, when num_machines > 1.
    """
    me = f"machine {config.machine_rank} ({socket.gethostname()}, pid {os.getpid()})"
    resolved, refused = resolve(config, me)
    if refused:
        return [refused]
    machine = Machine(machine_rank=config.machine_rank, host=socket.gethostname(),
                      pid=os.getpid(), resolved=resolved,
                      settings=compared_settings(config))  # fmt: skip
    deadline = time.monotonic() + timeout_s(config)
    if config.machine_rank == 0:
        try:
            server = _listen(int(config.main_process_port or 0))
        except OSError:  # another launcher hosts here (machine_rank 0 twice), or a program
            return _join(config, machine, deadline, host_busy=True)
        return _host(config, machine, server, deadline)
    return _join(config, machine, deadline, host_busy=False)


def _listen(port: int) -> socket.socket:
    # On every interface, as torch's TCPStore listens, and with SO_REUSEADDR as it binds.
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def _send(conn: socket.socket, data: Mapping[str, Any]) -> None:
    conn.sendall(json.dumps(data).encode() + b"\n")


def _receive(conn: socket.socket, seconds: float) -> dict[str, Any] | None:
    """One JSON line from `conn` within `seconds`, or None (nothing, or not accel's)."""
    conn.settimeout(max(seconds, 0.01))
    buffer = b""
    try:
        while not buffer.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                return None
            buffer += chunk
        data = json.loads(buffer)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _host(
    config: _config.Config, machine: Machine, server: socket.socket, deadline: float
) -> list[str]:
    """Machine 0: take every machine's report, compare, answer each, then the all-reduce."""
    num = config.num_machines
    machines: dict[int, Machine] = {0: machine}
    conns: list[socket.socket] = []
    failures: list[str] = []
    with server:
        while len(conns) < num - 1 and not failures:
            other, conn = _accept(server, deadline)
            if conn is None:
                break  # the deadline passed
            if other is None:
                conn.close()  # not a launcher: ignored
                continue
            conns.append(conn)
            if other.machine_rank in machines:
                failures.append(duplicate(machines[other.machine_rank], other, num))
            failures += compare(machine, other)
            machines.setdefault(other.machine_rank, other)
        if not failures and len(conns) < num - 1:
            failures.append(_missing(config, machines))
    # The listening socket is closed: a machine told to go on meets torchrun's store next.
    if failures:
        for conn in conns:
            with conn:
                _send(conn, {"failures": failures})
        return failures
    return _all_reduce_as_host(config, machine.resolved, conns)


def _accept(server: socket.socket, deadline: float) -> tuple[Machine | None, socket.socket | None]:
    """The next connection and the report it sends, or (None, None) at the deadline."""
    server.settimeout(max(deadline - time.monotonic(), 0.01))
    try:
        conn, _ = server.accept()
    except TimeoutError:
        return None, None
    try:
        _send(conn, dict(GREETING))
    except OSError:
        return None, conn
    data = _receive(conn, min(deadline - time.monotonic(), 10.0))
    if data is None or "machine_rank" not in data:
        return None, conn
    return Machine.from_json(data), conn


def _missing(config: _config.Config, machines: Mapping[int, Machine]) -> str:
    missing = sorted(set(range(config.num_machines)) - set(machines))
    arrived = ", ".join(m.name for _, m in sorted(machines.items()))
    endpoint = f"{config.main_process_ip}:{config.main_process_port}"
    return (
        f"accel launch: machine{'s' if len(missing) > 1 else ''} "
        f"{', '.join(map(str, missing))} never reached {endpoint} within {timeout_s(config)} s "
        f"(arrived: {arrived}); start `accel launch --machine_rank R` on every machine with the "
        f"same --main_process_ip and --main_process_port, check each reaches {endpoint}, "
        f"{_longer(config)}."
    )


def _join(
    config: _config.Config, machine: Machine, deadline: float, *, host_busy: bool
) -> list[str]:
    """A machine other than machine 0: report to machine 0's launcher and take its answer."""
    endpoint = f"{config.main_process_ip}:{config.main_process_port}"
    me = machine.name
    while True:
        try:
            conn = socket.create_connection(
                (machine.resolved, int(config.main_process_port or 0)),
                timeout=max(min(deadline - time.monotonic(), 5.0), 0.01),
            )
            break
        except OSError:
            if time.monotonic() >= deadline:
                loopback = ipaddress.ip_address(machine.resolved).is_loopback
                where = (
                    f" ({config.main_process_ip} is this machine's loopback address: only a "
                    "machine 0 on this machine answers there)"
                    if loopback
                    else ""
                )
                return [
                    f"accel launch: {me}: machine 0 never answered at {endpoint} within "
                    f"{timeout_s(config)} s{where}; start `accel launch --machine_rank 0` on "
                    f"machine 0 with the same --main_process_port, check this machine reaches "
                    f"{endpoint} (address, port, firewall), {_longer(config)}."
                ]
            time.sleep(0.2)
    with conn:
        if _receive(conn, GREETING_S) != dict(GREETING):
            if host_busy:
                return [
                    f"accel launch: {me}: main_process_port={config.main_process_port} is in use "
                    "on this machine; pass another port (the same on every machine)."
                ]
            if config.rdzv_backend == "c10d" and config.max_restarts:
                print(
                    f"accel launch: {me}: {endpoint} answers, but not as machine 0's accel "
                    "launch: taken for the c10d store of a run already training, which this "
                    "machine joins (--max_restarts) without the preflight.",
                    file=sys.stderr,
                )
                return []
            return [
                f"accel launch: {me}: {endpoint} answers, but not as machine 0's accel launch "
                f"(no greeting within {GREETING_S:g} s): another program listens there, or "
                "machine 0 started training already. Pass the port machine 0 was given, or "
                "start every machine again."
            ]
        _send(conn, machine.to_json())
        answer = _receive(conn, timeout_s(config) + GREETING_S)  # machine 0 waits as long
    if answer is None:
        return [f"accel launch: {me}: machine 0 at {endpoint} ended without answering; its "
                "output says why."]  # fmt: skip
    if answer.get("failures"):
        return [str(line) for line in answer["failures"]]
    return _all_reduce(config, machine.machine_rank, machine.resolved, int(answer["port"]))


def _all_reduce_as_host(
    config: _config.Config, address: str, conns: list[socket.socket]
) -> list[str]:
    """Host the all-reduce's store on a free port, tell every machine, and take part."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    wait = timedelta(seconds=ALL_REDUCE_S)
    store = TCPStore(address, 0, config.num_machines, True, wait, wait_for_workers=False)
    for conn in conns:
        with conn:
            _send(conn, {"port": store.port})
    return _all_reduce(config, 0, "", 0, store=store)


def _all_reduce(
    config: _config.Config, rank: int, address: str, port: int, store: Any = None
) -> list[str]:
    """One all-reduce through gloo, one process per machine, as the workers' groups connect:
    first each machine's own gloo device (GLOO_SOCKET_IFNAME), agreed through the store, so a
    machine that cannot make one is named on every machine at once; then the reduce."""
    import torch
    import torch.distributed as dist
    from torch.distributed import HashStore, TCPStore  # type: ignore[attr-defined]

    num, wait = config.num_machines, timedelta(seconds=ALL_REDUCE_S)
    me = f"machine {rank} ({socket.gethostname()}, pid {os.getpid()})"
    try:
        if store is None:
            store = TCPStore(address, port, num, False, wait)
        try:  # the device alone: a one-rank group on a store of its own
            dist.ProcessGroupGloo(HashStore(), 0, 1, wait)
            store.set(f"device/{rank}", "")
        except RuntimeError as err:
            said = str(err).splitlines()[-1].split("] ", 1)[-1]  # less gloo's source position
            store.set(f"device/{rank}", f"{me}: {said.removeprefix('ifa != nullptr. ')}")
        keys = [f"device/{r}" for r in range(num)]
        store.wait(keys, wait)
        bad = [text for key in keys if (text := store.get(key).decode())]
        if rank == 0:  # the store is this launcher's: it stays until every machine has read
            store.wait([f"read/{r}" for r in range(1, num)], wait)
        else:
            store.set(f"read/{rank}", "")
        if bad:
            return [
                f"accel launch: {line}; gloo cannot use this machine's network interface "
                "(GLOO_SOCKET_IFNAME, else the address its hostname resolves to). Set "
                "GLOO_SOCKET_IFNAME to an interface every machine reaches it on (see `ip addr`)."
                for line in bad
            ]
        group = dist.ProcessGroupGloo(store, rank, num, wait)
        value = torch.tensor([rank + 1])
        group.allreduce([value]).wait()  # type: ignore[attr-defined]
    except (RuntimeError, dist.DistError) as err:
        return [
            f"accel launch: {me}: the all-reduce through gloo between the {num} machines failed "
            f"({str(err).splitlines()[0]}); they reached the rendezvous endpoint but not each "
            "other on gloo's ports. Let the machines reach each other on any port (firewall), "
            "and set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on GPUs) to an interface they share."
        ]
    expected = num * (num + 1) // 2
    if int(value.item()) != expected:
        return [
            f"accel launch: {me}: the all-reduce between the machines gave {int(value.item())}, "
            f"not {expected}; the machines met another run's launchers. Pass another port."
        ]
    return []
