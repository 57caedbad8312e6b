"""`accel config`: write a YAML launch config by answering questions, or take the defaults."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from accel import config as _config


def _ask(question: str, default: Any, parse: Callable[[str], Any]) -> Any:
    """Ask until the answer parses; an empty answer is `default`."""
    while True:
        try:
            answer = input(f"{question} [{default}]: ").strip()
        except EOFError:
            raise EOFError(
                f"input ended before {question!r} was answered; pipe an answer for every "
                "question, or use `accel config --default`."
            ) from None
        if not answer:
            return default
        try:
            return parse(answer)
        except ValueError as err:
            print(f"  {err} Please answer again.")


def _yes(text: str) -> bool:
    if text.lower() in ("y", "yes", "true"):
        return True
    if text.lower() in ("n", "no", "false"):
        return False
    raise ValueError(f"answer yes or no, not {text!r}.")


def _key(key: str, check: Callable[[int], str | None] | None = None) -> Callable[[str], Any]:
    """Parse an answer as the config file's `key` is parsed, then apply `check` (a message for a
    value that does not fit the answers before it)."""

    def parse(text: str) -> Any:
        value: Any = text
        if key not in ("main_process_ip", "mixed_precision"):
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{key}: {text!r} is not an integer.") from None
        value = _config.parse_value(key, value)
        problem = check(value) if check is not None else None
        if problem:
            raise ValueError(f"{key}={value!r} {problem}.")
        return value

    return parse


def _questions() -> dict[str, Any]:
    values: dict[str, Any] = {}
    machines = values["num_machines"] = _ask("How many machines?", 1, _key("num_machines"))
    if machines > 1:
        below = f"must be below num_machines={machines}"
        values["machine_rank"] = _ask(
            "Rank of this machine?",
            0,
            _key("machine_rank", lambda r: below if r >= machines else None),
        )
        values["main_process_ip"] = _ask(
            "IP address of machine 0?", "127.0.0.1", _key("main_process_ip")
        )
        values["main_process_port"] = _ask("Port on machine 0?", 29500, _key("main_process_port"))
    split = f"is not divisible by num_machines={machines}"
    values["num_processes"] = _ask(
        "How many processes in total?",
        machines,
        _key("num_processes", lambda n: split if n % machines else None),
    )
    values["use_cpu"] = _ask("Run on CPU only (yes/no)?", False, _yes)
    values["mixed_precision"] = _ask(
        "Mixed precision (fp32/bf16/fp16/fp8)?", "fp32", _key("mixed_precision")
    )
    values["gradient_accumulation_steps"] = _ask(
        "Gradient accumulation steps?", 1, _key("gradient_accumulation_steps")
    )
    # What `accelerate config` writes for the same answers, so either tool reads the file alike.
    if values["num_processes"] > 1 or machines > 1:
        values["distributed_type"] = "MULTI_CPU" if values["use_cpu"] else "MULTI_GPU"
    return values


def _show(explicit: str | None) -> None:
    path = _config.config_in_force(explicit)
    if path is None:
        print(
            f"No config file: neither {_config.default_config_path()} nor Accelerate's "
            f"{_config.accelerate_config_path()} exists; `accel launch` uses the defaults:"
        )
        config = _config.Config()
    else:
        print(f"Config in force: {path}")
        config = _config.load_config(path)
    print(yaml.safe_dump(_config.as_mapping(config), sort_keys=False), end="")


def run(args: argparse.Namespace) -> int:
    if args.show:
        _show(args.config_file)
        return 0
    path = Path(args.config_file) if args.config_file else _config.default_config_path()
    if path.is_dir():
        raise ValueError(
            f"config_file={str(path)!r} is a folder, not a file; pass the file to write, e.g. "
            f"--config_file {path / 'default_config.yaml'}."
        )
    if path.exists() and not args.force:  # checked before asking, so no answer is lost
        raise ValueError(
            f"config_file={str(path)!r} already exists; pass --force to overwrite it, or "
            "--config_file to write another file."
        )
    values = {} if args.default else _questions()
    config = _config.parse_config(values, origin="accel config")  # validate before writing
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(_config.as_mapping(config), sort_keys=False))
    print(f"accel config written to {path}")
    return 0
