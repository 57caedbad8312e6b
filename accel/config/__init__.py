"""User settings: YAML config files (accel's or Accelerate's) and the `ACCEL_*` variables.

This package and `accel.distributed` are the only places accel reads `os.environ`. Every
setting is declared once, as a row of the settings table (the `accel_settings` package, which
the `accel` command reads too), with its YAML key, flag, value type, default, RunContext
field, `ACCEL_*` variable and the variable Accelerate's launcher exports; reading a config,
writing and reading the workers' variables and Accelerate's are loops over it. `accel launch`
passes its settings to the processes it starts through these variables, and `init_distributed`
reads them once and records each value's source in `RunContext.sources`. The variables are the
rows' `env` (docs/cli.md lists them); `ACCEL_CONFIG_FILE` names a config file to read.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from accel._settings.table import build, read_environment
from accel._typing import Precision
from accel_settings import KEYS, SECTIONS
from accel_settings.values import Section, parse

__all__ = ["Config", "default_config_path", "load_config"]

# Keys Accelerate writes that have no effect in accel; accepted so its files load unchanged.
_IGNORED_KEYS = frozenset(
    {
        "compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity",
        "main_training_function", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "tpu_name",
        "tpu_zone", "commands", "command_file", "ipex_config", "mpirun_config",
        "megatron_lm_config", "use_mps_device", "same_network",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """A launch configuration, as read from YAML or built from `accel launch` flags.

    Field names are Accelerate's config keys, so its `default_config.yaml` reads unchanged.
    """

    distributed_type: str = "NO"
    """Accelerate's run kind: NO, MULTI_CPU, MULTI_GPU or FSDP."""
    num_processes: int = 1
    """Processes in total over all machines (as in Accelerate's files)."""
    num_machines: int = 1
    """Machines (nodes) taking part."""
    machine_rank: int = 0
    """This machine's index."""
    main_process_ip: str | None = None
    """Rendezvous host (machine rank 0). None on one machine."""
    main_process_port: int | None = None
    """Rendezvous port; 0 or None picks a free one on a single machine."""
    rdzv_backend: str = "static"
    """torchrun rendezvous backend: static or c10d."""
    rdzv_conf: str | None = None
    """c10d rendezvous options as torchrun's --rdzv-conf takes them ("join_timeout=60,...")."""
    mixed_precision: Precision = "fp32"
    """Autocast precision."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    seed: int | None = None
    """Base seed handed to the processes."""
    use_cpu: bool = False
    """Run on the CPU even when GPUs are present."""
    gpu_ids: str | None = "all"
    """GPUs to use, as CUDA_VISIBLE_DEVICES would list them, or 'all'."""
    max_restarts: int = 0
    """How often the elastic agent restarts failed workers."""
    monitor_interval: float = 0.1
    """Seconds between the agent's checks on its workers."""
    shutdown_timeout: int | None = None
    """Seconds torchrun's agent waits for its workers after a stop signal; None: torchrun's 30."""
    num_cpu_threads_per_process: int | None = None
    """OMP/torch threads per process; None lets torchrun decide."""
    fsdp_config: Section = ()
    """Accelerate's `fsdp_config` keys (`fsdp_transformer_layer_cls_to_wrap`, ...), as pairs."""
    parallelism_config: Section = ()
    """Accelerate's `parallelism_config` keys (`parallelism_config_tp_size`, ...), as pairs."""
    dynamo_config: Section = ()
    """Accelerate's `dynamo_config` keys (`dynamo_backend`, ...), as pairs."""
    fp8_config: Section = ()
    """Accelerate's `fp8_config` keys (`backend: AO`, ...), as pairs: checked, none carried."""
    deepspeed_config: Section = ()
    """Accelerate's `deepspeed_config` keys (`zero_stage`, ...), as pairs (DEEPSPEED runs)."""
    log_with: tuple[str, ...] = ()
    """Trackers `init_trackers(ctx, None, ...)` builds (Accelerate's `log_with`), by name."""


ENV_CONFIG_FILE = "ACCEL_CONFIG_FILE"
"""The config file `init_distributed` reads when given none (and `accel config` writes)."""
assert {f.name for f in fields(Config)} == set(KEYS) | set(SECTIONS), "Config and the table"


def parse_value(key: str, value: Any) -> Any:
    """Validate one config key's value as a config file's is validated (`accel config` checks
    each answer with it as it is typed).

    Example:
        >>> from accel.config import parse_value
        >>> parse_value("mixed_precision", "no")
        'fp32'
    """
    if key in SECTIONS:
        return parse("section", key, value)
    return parse(KEYS[key].kind, key, value)


def parse_config(data: Mapping[str, Any], *, origin: str = "config") -> Config:
    """Validate a mapping of config keys and return the `Config` it describes.

    Raises:
        ValueError: for an unknown key or a bad value, naming both.
    """
    return read_launch(data, origin=origin)[0]


def read_launch(data: Mapping[str, Any], *, origin: str) -> tuple[Config, dict[str, Any]]:
    """The `Config` a mapping of config keys describes, and the RunContext values it asks for,
    each section's read once: what `accel launch` hands its workers, refused here if bad."""
    config = parse_keys(data, origin)
    if config.machine_rank >= config.num_machines:
        raise ValueError(
            f"{origin}: machine_rank={config.machine_rank} must be below "
            f"num_machines={config.num_machines}."
        )
    settings = build(config)  # every section checked here, not in each worker
    if "parallelism" in settings:
        settings["parallelism"].resolve(config.num_processes)
    return config, settings


def parse_keys(data: Mapping[str, Any], origin: str) -> Config:
    """The `Config` of a mapping: every key known, every top-level value read by its row;
    the sections are read by `build` (or `read_launch`)."""
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in _IGNORED_KEYS:
            continue
        if key not in KEYS and key not in SECTIONS:
            keys = sorted([*KEYS, *SECTIONS])
            close = difflib.get_close_matches(str(key), keys, n=1, cutoff=0.6)
            if close:  # a typo: the key it is closest to, as a mistyped flag gets
                raise ValueError(
                    f"{origin}: unknown key {key!r}; did you mean {close[0]!r}? Rename it."
                )
            raise ValueError(
                f"{origin}: unknown key {key!r}; expected one of {keys} (or a key of "
                "Accelerate's that accel ignores). Remove or rename it."
            )
        values[key] = parse_value(key, value)
    return Config(**values)


def default_config_path() -> Path:
    """Return where `accel config` writes and `accel launch` looks for the config file.

    That is `$ACCEL_CONFIG_FILE` if set, else `$XDG_CONFIG_HOME/accel/default_config.yaml`
    (`~/.config/accel/default_config.yaml` by default). The file need not exist.

    Returns:
        The path of the default config file.

    Example:
        >>> from accel import default_config_path
        >>> default_config_path().name
        'default_config.yaml'
    """
    explicit = os.environ.get(ENV_CONFIG_FILE)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "accel" / "default_config.yaml"


def as_mapping(config: Config) -> dict[str, Any]:
    """The config as Accelerate's YAML keys, sections as nested mappings (what `accel config`
    writes).

    Example:
        >>> as_mapping(Config(fsdp_config=(("fsdp_version", 2),)))["fsdp_config"]
        {'fsdp_version': 2}
    """
    out: dict[str, Any] = {f.name: getattr(config, f.name) for f in fields(config)}
    for name in SECTIONS:
        out[name] = dict(out[name])
    out["log_with"] = list(config.log_with)
    return out


def accelerate_config_path() -> Path:
    """Where Accelerate keeps its default config: `$HF_HOME/accelerate/default_config.yaml`.

    `HF_HOME` defaults to `$XDG_CACHE_HOME/huggingface` (`~/.cache/huggingface`), as in
    Accelerate; `accel launch` reads this file when accel has no config of its own.
    """
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    home = os.environ.get("HF_HOME") or str(Path(cache) / "huggingface")
    return Path(home) / "accelerate" / "default_config.yaml"


def config_in_force(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The config file `accel launch` reads: `explicit` (its --config_file) when given, else
    accel's default file when it exists, else Accelerate's default file when it exists, else None
    (the defaults apply).

    Example:
        >>> from accel.config import config_in_force
        >>> config_in_force("my.yaml")
        PosixPath('my.yaml')
    """
    if explicit is not None:
        return Path(explicit)
    for path in (default_config_path(), accelerate_config_path()):
        if path.is_file():
            return path
    return None


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML config file (accel's or Accelerate's).

    Accelerate's spellings are mapped to accel's (`mixed_precision: 'no'` becomes "fp32"), and
    Accelerate's keys that accel has no use for are ignored. An empty file is the defaults.

    Args:
        path: the YAML file to read, for example `default_config_path()`.

    Returns:
        The validated `Config`.

    Raises:
        FileNotFoundError: when `path` does not exist.
        ValueError: for invalid YAML, a file that is not a mapping, an unknown key, or a bad
            value (naming the key).
        NotImplementedError: for an Accelerate `distributed_type` accel does not support
            (DeepSpeed, TPU, ...).

    Example:
        >>> from accel import load_config
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "c.yaml"
        >>> _ = p.write_text("num_processes: 2\\nmixed_precision: 'no'\\n")
        >>> load_config(p).mixed_precision
        'fp32'
    """
    return parse_config(read_yaml(path), origin=str(Path(path)))


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping a YAML config file holds (errors name the file); `load_config` reads it."""
    file = Path(path)
    if file.is_dir():
        raise ValueError(
            f"load_config: path={str(file)!r} is a folder, not a YAML file; pass the config "
            f"file itself, e.g. --config_file {file / 'default_config.yaml'}."
        )
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"load_config: path={str(file)!r} does not exist. Write one with `accel config`, "
            "or pass --config_file with an existing file."
        ) from None
    try:
        import yaml  # imported on use: it costs ~10 ms, and `import accel` should not pay it

        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(
            f"load_config: {str(file)!r} is not valid YAML{where}: {problem}."
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(
            f"load_config: {str(file)!r} must hold a mapping of keys to values, "
            f"not a {type(data).__name__}."
        )
    return data


def config_settings(config: Config, source: str) -> dict[str, tuple[Any, str]]:
    """Return the RunContext settings a `Config` carries, each labelled with `source`."""
    return {name: (value, source) for name, value in build(config).items()}


def env_settings(
    environ: Mapping[str, str], *, fn: str = "init_distributed"
) -> dict[str, tuple[Any, str]]:
    """Return the RunContext settings found in `environ` (the `ACCEL_*` variables `accel launch`
    writes), each with its source label.

    `fn` names the caller in errors: the workers' `init_distributed`, or `accel launch`, which
    checks its own environment the same way before it starts them.
    """
    return read_environment(environ, fn)


def check_launch_environment(config: Config, settings: Mapping[str, Any] | None = None) -> None:
    """Check this launcher's `ACCEL_*` variables as `init_distributed` will read them in each
    worker, so a bad value is refused before any process starts, as the same flag would be.
    `settings` are what the config asks for (`read_launch`'s), read again when not given.

    Raises:
        ValueError: for a value `init_distributed` would refuse, mesh sizes that do not fill
            `config.num_processes`, or mesh sizes that contradict the config's or flags'.
    """
    _check_torchrun_variables(config, os.environ)
    found = env_settings(os.environ, fn="accel launch")
    if "parallelism" not in found:
        return
    sizes, source = found["parallelism"]
    variables = source.removeprefix("env ")
    configured = (build(config) if settings is None else settings).get("parallelism")
    if configured is not None and configured != sizes:
        raise ValueError(
            f"accel launch: {variables} set the mesh to {sizes}, and the config or flags set "
            f"{configured}; unset the variables, or drop the parallelism flags/config keys."
        )
    try:
        sizes.resolve(config.num_processes)
    except ValueError as err:
        raise ValueError(f"accel launch: {variables}: {err}") from None


def _check_torchrun_variables(config: Config, environ: Mapping[str, str]) -> None:
    """Refuse torchrun's `PET_*` defaults (Kubeflow's PyTorchJob and TrainJob set them) that
    disagree with the launch settings: accel launch passes its own, which torchrun would take."""
    machines = config.num_machines
    ours = {
        "PET_NNODES": ("num_machines", str(machines)),
        "PET_NPROC_PER_NODE": ("num_processes", str(config.num_processes // machines)),
        "PET_NODE_RANK": ("machine_rank", str(config.machine_rank)),
        "PET_MASTER_ADDR": ("main_process_ip", config.main_process_ip),
        "PET_MASTER_PORT": ("main_process_port", config.main_process_port),
    }
    wrong = []
    for var, (key, value) in ours.items():
        theirs = environ.get(var, "").strip()
        comparable = theirs.isdigit() or var == "PET_MASTER_ADDR"  # not "1:4", "auto", "gpu"
        if theirs and comparable and value is not None and theirs != str(value):
            shown = f"{key}={value}" + (" per machine" if var == "PET_NPROC_PER_NODE" else "")
            wrong.append(f"{var}={theirs} but {shown}")
    if wrong:
        raise ValueError(
            f"accel launch: torchrun's variables (set by Kubeflow's PyTorchJob since "
            "training-operator 1.7, and by its TrainJob) disagree with the "
            f"launch settings: {'; '.join(wrong)}. Pass the same values as flags (e.g. "
            "--num_machines $PET_NNODES --num_processes $((PET_NNODES*PET_NPROC_PER_NODE)) "
            "--machine_rank $PET_NODE_RANK --main_process_ip $PET_MASTER_ADDR "
            "--main_process_port $PET_MASTER_PORT), or unset them."
        )


def resolve_settings(
    arguments: Mapping[str, Any], environ: Mapping[str, str], config: Any
) -> dict[str, tuple[Any, str]]:
    """The RunContext settings with their sources, by precedence: argument, launcher variable,
    config file, default."""
    settings: dict[str, tuple[Any, str]] = {"precision": ("fp32", "default")}
    settings["grad_accum_steps"] = (1, "default")
    settings["seed"] = (None, "default")
    if config is None and ENV_CONFIG_FILE in environ:
        config = environ[ENV_CONFIG_FILE]
    if isinstance(config, Config):
        settings.update(config_settings(config, "config"))
    elif config is not None:
        found = read_launch(read_yaml(config), origin=str(Path(config)))[1]
        settings.update({name: (value, f"config {config}") for name, value in found.items()})
    settings.update(env_settings(environ))
    for name, value in arguments.items():
        if value is not None:
            settings[name] = (value, "argument")
    return settings
