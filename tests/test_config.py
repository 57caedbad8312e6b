from __future__ import annotations

from pathlib import Path

import pytest

from accel.config import Config, config_settings, env_settings, load_config, parse_config

# Accelerate 1.x `accelerate config` output for two CPU processes with fp16, unchanged.
ACCELERATE_SAMPLE = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


def test_accelerate_config_file_reads_as_is(tmp_path: Path) -> None:
    path = tmp_path / "default_config.yaml"
    path.write_text(ACCELERATE_SAMPLE)
    config = load_config(path)
    assert config == Config(
        distributed_type="MULTI_CPU", num_processes=2, mixed_precision="fp16", use_cpu=True
    )


@pytest.mark.parametrize(("raw", "expected"), [("no", "fp32"), ("bf16", "bf16"), ("fp32", "fp32")])
def test_precision_spellings(tmp_path: Path, raw: str, expected: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"mixed_precision: {raw}\n")  # a bare `no` is YAML's False
    assert load_config(path).mixed_precision == expected


def test_a_key_typo_gets_the_closest_key_not_all_of_them() -> None:
    """Issue 44 item 6: `num_procs: 2` listed all 23 keys."""
    with pytest.raises(ValueError) as caught:
        parse_config({"num_procs": 2}, origin="my.yaml")
    assert "'num_processes'" in str(caught.value) and "deepspeed_config" not in str(caught.value)


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        ({"num_procs": 2}, ValueError, r"unknown key 'num_procs'; did you mean 'num_processes'\?"),
        ({"zzz": 2}, ValueError, r"unknown key 'zzz'; expected one of \['deepspeed_config'"),
        ({"num_processes": -3}, ValueError, r"num_processes=-3 must be an integer >= 1"),
        ({"mixed_precision": "fp4"}, ValueError, r"mixed_precision='fp4' is not a precision"),
        ({"rdzv_backend": "etcd"}, ValueError, r"rdzv_backend='etcd' is not allowed"),
        ({"use_cpu": "yes"}, ValueError, r"use_cpu='yes' must be true or false"),
        ({"distributed_type": "MEGATRON_LM"}, NotImplementedError, r"does not wrap Megatron"),
        ({"deepspeed_config": {"zero_stage": 2}}, ValueError, r"distributed_type='NO'; set"),
        (
            {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stag": 2}},
            ValueError,
            r"deepspeed_config has unknown key 'zero_stag'",
        ),
        (
            {
                "distributed_type": "DEEPSPEED",
                "gradient_accumulation_steps": 4,
                "deepspeed_config": {"gradient_accumulation_steps": 2},
            },
            ValueError,
            r"gradient_accumulation_steps=4 but deepspeed_config has gradient_accumulation_steps=2",
        ),
        ({"machine_rank": 2, "num_machines": 2}, ValueError, r"machine_rank=2 must be below"),
    ],
)
def test_bad_config_values_name_the_key(data: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        parse_config(data)


def test_malformed_and_missing_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_processes: [2\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(bad)
    with pytest.raises(FileNotFoundError, match=r"does not exist\. Write one with `accel config`"):
        load_config(tmp_path / "missing.yaml")


def test_env_settings_parse_and_label_their_source() -> None:
    found = env_settings(
        {"ACCEL_PRECISION": "no", "ACCEL_GRAD_ACCUM_STEPS": "4", "ACCEL_SEED": "7"}
    )
    assert found == {
        "precision": ("fp32", "env ACCEL_PRECISION"),
        "grad_accum_steps": (4, "env ACCEL_GRAD_ACCUM_STEPS"),
        "seed": (7, "env ACCEL_SEED"),
    }
    with pytest.raises(ValueError, match=r"ACCEL_SEED='x' must be an integer"):
        env_settings({"ACCEL_SEED": "x"})


def test_config_settings_carry_precision_accumulation_and_seed() -> None:
    found = config_settings(Config(mixed_precision="bf16", seed=3), "config f.yaml")
    assert found["precision"] == ("bf16", "config f.yaml")
    assert found["seed"] == (3, "config f.yaml")
