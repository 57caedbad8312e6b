"""Accelerate's fsdp_config, parallelism_config and dynamo_config: honoured or refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from accel import FSDPOptions, Parallelism
from accel.config import config_settings, env_settings, load_config, parse_config

# Accelerate 1.10 `accelerate config` output for FSDP2 on one machine with 2 processes.
ACCELERATE_FSDP = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""

ACCELERATE_PARALLELISM = """\
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_transformer_layer_cls_to_wrap: Block
num_processes: 4
parallelism_config:
  parallelism_config_dp_replicate_size: 1
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
  parallelism_config_cp_size: 1
use_cpu: true
dynamo_config:
  dynamo_backend: INDUCTOR
  dynamo_use_regional_compilation: true
"""


def test_an_accelerate_fsdp_config_becomes_fsdp2_over_every_process(tmp_path: Path) -> None:
    path = tmp_path / "fsdp.yaml"
    path.write_text(ACCELERATE_FSDP)
    found = config_settings(load_config(path), "config")
    assert found["parallelism"] == (Parallelism(dp_shard=-1), "config")
    assert found["fsdp"] == (FSDPOptions(layer_classes=("Block",)), "config")
    # Activation checkpointing is wrap_model's, for every strategy: the context carries it.
    assert found["activation_checkpointing"] == (True, "config")
    assert "compile" not in found


def test_a_parallelism_config_sets_the_mesh_and_dynamo_the_compile(tmp_path: Path) -> None:
    path = tmp_path / "nd.yaml"
    path.write_text(ACCELERATE_PARALLELISM)
    found = config_settings(load_config(path), "config")
    assert found["parallelism"][0] == Parallelism(dp_shard=2, tp=2)
    assert found["compile"][0] == "regional"


def test_the_settings_travel_to_the_workers_through_accel_variables() -> None:
    from accel.cli import _launch

    config = parse_config(
        {"distributed_type": "FSDP", "num_processes": 4,
         "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "Block,Attention",
                         "fsdp_sharding_strategy": "SHARD_GRAD_OP"},
         "parallelism_config": {"parallelism_config_tp_size": 2,
                                "parallelism_config_dp_shard_size": 2},
         "dynamo_config": {"dynamo_backend": "inductor"}}
    )  # fmt: skip
    env = _launch.worker_environment(config)
    assert {k: v for k, v in env.items() if k.startswith(("ACCEL_DP", "ACCEL_TP", "ACCEL_CP"))} == {
        "ACCEL_DP_REPLICATE_SIZE": "1", "ACCEL_DP_SHARD_SIZE": "2", "ACCEL_CP_SIZE": "1",
        "ACCEL_TP_SIZE": "2",
    }  # fmt: skip
    assert env["ACCEL_COMPILE"] == "true"
    found = env_settings(env)
    assert found["parallelism"][0] == Parallelism(dp_shard=2, tp=2)
    assert found["fsdp"][0] == FSDPOptions(
        layer_classes=("Block", "Attention"), reshard_after_forward=False
    )
    assert found["compile"] == (True, "env ACCEL_COMPILE")


def test_activation_checkpointing_travels_to_the_workers_and_into_the_context() -> None:
    from accel.cli import _launch

    config = parse_config(
        {"distributed_type": "FSDP", "num_processes": 2,
         "fsdp_config": {"fsdp_activation_checkpointing": True}}
    )  # fmt: skip
    env = _launch.worker_environment(config)
    assert env["ACCEL_ACTIVATION_CHECKPOINTING"] == "true"
    assert "ACCEL_FSDP_ACTIVATION_CHECKPOINTING" not in env
    found = env_settings(env)
    assert found["activation_checkpointing"] == (True, "env ACCEL_ACTIVATION_CHECKPOINTING")
    with pytest.raises(ValueError, match=r"ACCEL_ACTIVATION_CHECKPOINTING='maybe' must be true"):
        env_settings({"ACCEL_ACTIVATION_CHECKPOINTING": "maybe"})


@pytest.mark.parametrize(
    ("section", "error", "match"),
    [
        (
            {"fsdp_config": {"fsdp_version": 1}},
            NotImplementedError,
            r"fsdp_version=1 is not supported: accel shards with FSDP2",
        ),
        (
            {"fsdp_config": {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}},
            NotImplementedError,
            r"fsdp_auto_wrap_policy='SIZE_BASED_WRAP'",
        ),
        (
            {"fsdp_config": {"fsdp_min_num_params": 1000}},
            NotImplementedError,
            r"fsdp_min_num_params=1000",
        ),
        (
            {"fsdp_config": {"fsdp_state_dict_type": "FULL_STATE_DICT"}},
            NotImplementedError,
            r"FULL_STATE_DICT.*accel.save_model",
        ),
        (
            {"fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD"}},
            NotImplementedError,
            r"HYBRID_SHARD.*dp_replicate_size",
        ),
        (
            {"fsdp_config": {"fsdp_forward_prefetch": True}},
            NotImplementedError,
            r"fsdp_forward_prefetch=True",
        ),
        (
            {"fsdp_config": {"fsdp_use_orig_params": False}},
            NotImplementedError,
            r"fsdp_use_orig_params=False",
        ),
        (
            {"fsdp_config": {"fsdp_activation_checkpointing": "maybe"}},
            ValueError,
            r"fsdp_activation_checkpointing='maybe' must be true or false",
        ),
        (
            {"fsdp_config": {"fsdp_wrap_everything": True}},
            ValueError,
            r"fsdp_config has unknown key 'fsdp_wrap_everything'",
        ),
        (
            {"parallelism_config": {"parallelism_config_sp_ulysses": 2}},
            ValueError,
            r"unknown key 'parallelism_config_sp_ulysses'",
        ),
        (
            {
                "parallelism_config": {
                    "parallelism_config_sp_size": 2,
                    "parallelism_config_sp_attn_implementation": "eager",
                }
            },
            NotImplementedError,
            r"sp_attn_implementation='eager'",
        ),
        (
            {
                "parallelism_config": {
                    "parallelism_config_sp_size": 2,
                    "parallelism_config_sp_seq_length": 7,
                }
            },
            ValueError,
            r"sp_seq_length=7 is not divisible by parallelism_config_sp_size=2",
        ),
        (
            {"parallelism_config": {"parallelism_config_cp_comm_strategy": "alltoall"}},
            NotImplementedError,
            r"cp_comm_strategy='alltoall'",
        ),
        (
            {"parallelism_config": {"parallelism_config_tp_size": 3}},
            ValueError,
            r"tp=3 does not multiply to world_size=2",
        ),
        (
            {"parallelism_config": {"parallelism_config_tp_size": 0}},
            ValueError,
            r"parallelism_config_tp_size=0 must be an integer",
        ),
        (
            {"dynamo_config": {"dynamo_backend": "EAGER"}},
            NotImplementedError,
            r"dynamo_backend='EAGER'.*inductor",
        ),
        (
            {"dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_use_fullgraph": True}},
            NotImplementedError,
            r"dynamo_use_fullgraph=True",
        ),
        (
            {"dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune"}},
            NotImplementedError,
            r"dynamo_mode='max-autotune'",
        ),
    ],
)
def test_each_setting_accel_cannot_honour_is_refused_by_name(
    section: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        parse_config({"distributed_type": "FSDP", "num_processes": 2, **section})


def test_accelerates_sequence_parallel_keys_become_the_sp_size() -> None:
    config = {"distributed_type": "FSDP", "num_processes": 4, "parallelism_config": {
        "parallelism_config_dp_shard_size": 2, "parallelism_config_sp_size": 2,
        "parallelism_config_sp_backend": "deepspeed", "parallelism_config_sp_seq_length": 256,
        "parallelism_config_sp_seq_length_is_variable": True,
        "parallelism_config_sp_attn_implementation": "sdpa"}}  # fmt: skip
    assert config_settings(parse_config(config), "file")["parallelism"][0] == Parallelism(
        dp_shard=2, sp=2
    )
    env = {"ACCEL_SP_SIZE": "2", "ACCEL_EP_SIZE": "2"}
    assert env_settings(env)["parallelism"][0] == Parallelism(sp=2, ep=2)


def test_fsdp_config_without_distributed_type_fsdp_is_refused() -> None:
    with pytest.raises(ValueError, match=r"fsdp_config is given but distributed_type='MULTI_CPU'"):
        parse_config({"distributed_type": "MULTI_CPU", "fsdp_config": {"fsdp_version": 2}})
