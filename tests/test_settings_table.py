"""The settings table itself: every setting travels flag -> YAML -> workers' variables ->
RunContext and back unchanged, every entry has help, and no two share a flag, key or variable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from accel import FSDPOptions, Parallelism, init_distributed, shutdown
from accel._settings.table import accelerate_variables, build, environment
from accel.cli import _launch
from accel.config import as_mapping, env_settings, load_config, parse_config
from accel_cli import build_parser
from accel_settings import KEYS, SECTIONS, TABLE

SETTINGS = [s for section in TABLE for s in section.settings]

# One launch per RunContext field the table carries, as flags; each value differs from the
# default, so a setting that did not travel would show its default instead.
FLAGS = [
    "--num_processes", "4", "--mixed_precision", "bf16", "--gradient_accumulation_steps", "3",
    "--seed", "11", "--log_with", "jsonl", "--use_cpu", "--use_fsdp",
    "--fsdp_transformer_layer_cls_to_wrap", "Block", "--fsdp_offload_params", "true",
    "--fsdp_reshard_after_forward", "false", "--fsdp_sync_module_states", "true",
    "--fsdp_activation_checkpointing", "true",
    "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2",
    "--dynamo_backend", "inductor", "--dynamo_use_regional_compilation", "true",
]  # fmt: skip
EXPECTED = {
    "precision": "bf16",
    "grad_accum_steps": 3,
    "seed": 11,
    "log_with": ("jsonl",),
    "device": "cpu",
    "fsdp": FSDPOptions(
        layer_classes=("Block",), offload_params=True, reshard_after_forward=False,
        sync_module_states=True,
    ),
    "activation_checkpointing": True,
    "parallelism": Parallelism(dp_shard=2, tp=2),
    "compile": "regional",
}  # fmt: skip


def _parse_flags(argv: list[str], tmp_path: Path) -> Any:
    args = build_parser(["launch", *argv]).parse_args(["launch", *argv, "train.py"])
    args.config_file = str(tmp_path / "none.yaml")
    (tmp_path / "none.yaml").write_text("")
    return _launch.resolve_config(args)


def test_each_setting_round_trips_flag_yaml_env_runcontext(tmp_path: Path) -> None:
    config = _parse_flags(FLAGS, tmp_path)
    assert build(config) == EXPECTED
    # The YAML `accel config` would write for it reads back to the same config and values.
    path = tmp_path / "written.yaml"
    path.write_text(yaml.safe_dump(as_mapping(config), sort_keys=False))
    again = load_config(path)
    assert build(again) == EXPECTED
    # The workers' variables carry every value, and init_distributed reads them back.
    env = environment(build(again), again)
    found = {name: value for name, (value, _) in env_settings(env).items()}
    assert found == {**EXPECTED, "parallelism": Parallelism(dp_shard=2, tp=2)}
    assert all(source.startswith("env ACCEL_") for _, source in env_settings(env).values())


def test_a_worker_sees_the_settings_in_its_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One process reads the variables of the run above (its mesh sized for one process).
    config = _parse_flags(FLAGS[:11], tmp_path)  # up to --use_cpu: the settings of any run
    env = _launch.worker_environment(config)
    for name, text in env.items():
        monkeypatch.setenv(name, text)
    ctx = init_distributed()
    try:
        assert (ctx.precision, ctx.grad_accum_steps, ctx.seed, ctx.log_with) == (
            "bf16", 3, 11, ("jsonl",),
        )  # fmt: skip
        assert ctx.sources["precision"] == "env ACCEL_PRECISION"
        assert "precision" in ctx.describe() and "env ACCEL_SEED" in ctx.describe()
    finally:
        shutdown(ctx)


def test_accelerate_yaml_gives_the_same_values_as_the_flags(tmp_path: Path) -> None:
    accelerate_yaml = {
        "distributed_type": "FSDP", "num_processes": 4, "mixed_precision": "bf16",
        "gradient_accumulation_steps": 3, "seed": 11, "log_with": "jsonl", "use_cpu": True,
        "compute_environment": "LOCAL_MACHINE",  # Accelerate's, accepted and ignored
        "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "Block",
                        "fsdp_offload_params": True, "fsdp_reshard_after_forward": False,
                        "fsdp_sync_module_states": True, "fsdp_activation_checkpointing": True},
        "parallelism_config": {"parallelism_config_dp_shard_size": 2,
                               "parallelism_config_tp_size": 2},
        "dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": True},
    }  # fmt: skip
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(accelerate_yaml))
    assert build(load_config(path)) == EXPECTED


def test_accelerates_variables_come_from_the_table() -> None:
    config = parse_config(
        {"distributed_type": "FSDP", "num_processes": 2, "mixed_precision": "bf16",
         "fsdp_config": {"fsdp_offload_params": True}}
    )  # fmt: skip
    env = accelerate_variables(config)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_OFFLOAD_PARAMS"] == "true"
    assert "ACCELERATE_USE_DEEPSPEED" not in env  # an inactive section exports nothing


def test_every_entry_has_help_and_a_known_value_type() -> None:
    from accel_settings.values import PARSERS

    for setting in SETTINGS:
        assert setting.help.strip(), setting
        assert setting.kind in PARSERS, setting
        assert setting.key is not None or setting.env is not None, setting


def test_no_two_entries_share_a_flag_key_or_variable() -> None:
    def no_repeats(names: list[str]) -> None:
        assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)

    no_repeats([f for s in SETTINGS if s.key and s.flag for f in (s.key, *s.flags)])
    no_repeats([s.env for s in SETTINGS if s.env])
    no_repeats([s.accelerate_env for s in SETTINGS if s.accelerate_env])
    no_repeats([*KEYS, *SECTIONS])
    for name, section in SECTIONS.items():
        no_repeats([s.key for s in section.settings if s.key])
        assert name not in KEYS


def test_every_flag_of_the_table_is_a_flag_of_accel_launch() -> None:
    from accel_cli import _options

    options = set(_options(build_parser(["launch"])))
    for setting in SETTINGS:
        if setting.key and setting.flag:
            assert {f"--{n}" for n in (setting.key, *setting.flags)} <= options, setting.key


@pytest.mark.slow
def test_the_command_reads_the_table_without_importing_accel() -> None:
    code = (
        "import sys, accel_settings\n"
        "sections = accel_settings.TABLE\n"
        "print(len(sections), 'accel' in sys.modules, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(len(TABLE)), "False", "False"]


@pytest.mark.slow
def test_the_library_imports_the_table_and_not_the_command() -> None:
    # What the launcher and the workers import (accel, its config and launch modules) reaches
    # the table's package and never the command's: no arrow from accel into accel_cli.
    code = (
        "import sys, accel, accel.config, accel.cli._launch, accel.parallel._deepspeed_config\n"
        "print('accel_cli' in sys.modules, 'accel_settings' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_the_import_graph_runs_from_accel_and_the_command_to_the_table() -> None:
    from tests.test_conventions import _graph

    graph = _graph()
    # `python -m accel` is the command itself: accel/__main__.py is its entry from accel, and
    # the package's `-m` hook (answering `python -m accel --help` before torch is imported) the
    # one import of the command a plain `import accel` never runs.
    into_command = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.split(".")[0] == "accel" and m not in ("accel", "accel.__main__")
        for d in deps
        if d.split(".")[0] == "accel_cli"
    )
    assert into_command == []
    table = {m: deps for m, deps in graph.items() if m.split(".")[0] == "accel_settings"}
    assert table and all(d.split(".")[0] == "accel_settings" for ds in table.values() for d in ds)
    assert any(d.startswith("accel_settings") for d in graph["accel_cli"])
    assert any(d.startswith("accel_settings") for d in graph["accel._settings.table"])


def test_a_section_value_overrides_the_top_level_one_it_refines() -> None:
    # Accelerate's rule: deepspeed_config's gradient_accumulation_steps is the run's when the
    # top-level key is left at 1; the workers must get it too.
    config = parse_config(
        {"distributed_type": "DEEPSPEED", "num_processes": 2,
         "deepspeed_config": {"zero_stage": 2, "gradient_accumulation_steps": 2}}
    )  # fmt: skip
    assert build(config)["grad_accum_steps"] == 2
    assert _launch.worker_environment(config)["ACCEL_GRAD_ACCUM_STEPS"] == "2"


def test_the_deepspeed_section_reaches_the_workers_as_the_launcher_read_it(
    tmp_path: Path,
) -> None:
    flags = ["--use_deepspeed", "--zero_stage", "3", "--offload_optimizer_device", "cpu",
             "--gradient_clipping", "0.5"]  # fmt: skip
    config = _parse_flags(flags, tmp_path)
    read = build(config)["deepspeed"]  # each flag's text read by its row: typed, checked
    assert dict(read) == {"zero_stage": 3, "offload_optimizer_device": "cpu",
                          "gradient_clipping": 0.5}  # fmt: skip
    env = environment(build(config), config)
    assert env_settings(env)["deepspeed"] == (read, "env ACCEL_DEEPSPEED_CONFIG")
    with pytest.raises(ValueError, match=r"ACCEL_DEEPSPEED_CONFIG: zero_stage='x' must be an"):
        env_settings({"ACCEL_DEEPSPEED_CONFIG": '{"zero_stage": "x"}'})
