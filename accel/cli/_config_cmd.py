"""`accel config`: write a YAML launch config by answering questions, or take the defaults."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from accel import config as _config


def _ask(question: str, default: Any, parse: Callable[[str], Any]) -> Any:
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
            print(f"  {err}")


def _yes(text: str) -> bool:
    if text.lower() in ("y", "yes", "true"):
        return True
    if text.lower() in ("n", "no", "false"):
        return False
    raise ValueError(f"answer yes or no, not {text!r}")


def _questions() -> dict[str, Any]:
    values: dict[str, Any] = {}
    values["num_machines"] = _ask("How many machines?", 1, int)
    if values["num_machines"] > 1:
        values["machine_rank"] = _ask("Rank of this machine?", 0, int)
        values["main_process_ip"] = _ask("IP address of machine 0?", "127.0.0.1", str)
        values["main_process_port"] = _ask("Port on machine 0?", 29500, int)
    values["num_processes"] = _ask("How many processes in total?", values["num_machines"], int)
    values["use_cpu"] = _ask("Run on CPU only (yes/no)?", False, _yes)
    values["mixed_precision"] = _ask("Mixed precision (fp32/bf16/fp16)?", "fp32", str)
    values["gradient_accumulation_steps"] = _ask("Gradient accumulation steps?", 1, int)
    return values


def run(args: argparse.Namespace) -> int:
    path = Path(args.config_file) if args.config_file else _config.default_config_path()
    if args.show:
        if not path.is_file():
            print(f"No config at {path}; `accel launch` uses the defaults:")
            config = _config.Config()
        else:
            print(f"Config in force: {path}")
            config = _config.load_config(path)
        print(yaml.safe_dump(_config.as_mapping(config), sort_keys=False), end="")
        return 0
    if path.is_dir():
        raise ValueError(
            f"config_file={str(path)!r} is a folder, not a file; pass the file to write, e.g. "
            f"--config_file {path / 'default_config.yaml'}."
        )
    values = {} if args.default else _questions()
    config = _config.parse_config(values, origin="accel config")  # validate before writing
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(_config.as_mapping(config), sort_keys=False))
    print(f"accel config written to {path}")
    return 0
