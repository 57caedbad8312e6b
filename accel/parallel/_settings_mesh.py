"""The mesh section of the settings table: Accelerate's `parallelism_config` keys (and accel's
pipeline size), `Parallelism` in RunContext, the `ACCEL_*_SIZE` variables.

Declarations import only the standard library and `accel_cli._setting`; see _settings_fsdp.
"""

from __future__ import annotations

from typing import Any

from accel_cli._setting import Section, Setting


def _size(dim: str, help: str, *flags: str) -> Setting:
    key = f"parallelism_config_{dim}_size"
    return Setting(key=key, kind="mesh_size", field="parallelism", part=dim,
                   env=f"ACCEL_{dim.upper()}_SIZE", accelerate_env=key.upper(), flags=flags,
                   help=help)  # fmt: skip


def _choice(name: str, help: str) -> Setting:
    """A key of Accelerate's section that builds no Parallelism part, checked in _build."""
    key = f"parallelism_config_{name}"
    return Setting(key=key, kind="any", accelerate_env=key.upper(), help=help)


def _build(config: Any) -> dict[str, Any]:
    from accel._parallelism import Parallelism  # on use
    from accel._settings.values import allow, known, parse  # on use

    values = known(config, SECTION)
    strategy = values.pop("parallelism_config_cp_comm_strategy", "allgather")
    allow("parallelism_config_cp_comm_strategy", strategy, ("allgather",),
          "torch's context_parallel rotates by all-gather here")  # fmt: skip
    _check_sp(values)
    parts = {
        str(s.part): parse(s.kind, s.key, values[s.key])
        for s in SECTION.settings
        if s.key in values
    }
    if parts:
        return {"parallelism": Parallelism(**parts)}
    if config.distributed_type == "FSDP":
        return {"parallelism": Parallelism(dp_shard=-1)}  # Accelerate's FSDP shards over all
    return {}


def _check_sp(values: dict[str, Any]) -> None:
    """Accelerate's sequence-parallel keys: honoured where they mean accel's Ulysses, refused
    where they ask for something else; they leave `values` (they build no Parallelism part)."""
    from accel._settings.values import allow, parse  # on use

    allow("parallelism_config_sp_backend", values.pop("parallelism_config_sp_backend",
          "deepspeed"), ("deepspeed",), "accel runs Ulysses itself, the algorithm of "
          "DeepSpeed's sequence parallelism (Accelerate's only sp_backend)")  # fmt: skip
    allow("parallelism_config_sp_attn_implementation",
          values.pop("parallelism_config_sp_attn_implementation", "sdpa"), ("sdpa",),
          "accel's Ulysses wraps torch's scaled_dot_product_attention, which transformers runs "
          "for attn_implementation='sdpa'")  # fmt: skip
    values.pop("parallelism_config_sp_seq_length_is_variable", None)  # every batch is checked
    length = values.pop("parallelism_config_sp_seq_length", None)
    size = parse("mesh_size", "parallelism_config_sp_size",
                 values.get("parallelism_config_sp_size", 1))  # fmt: skip
    if length not in (None, "None") and size > 1:
        length = parse("count", "parallelism_config_sp_seq_length", length)
        if length % size:
            raise ValueError(
                f"config: parallelism_config_sp_seq_length={length} is not divisible by "
                f"parallelism_config_sp_size={size}; each sp rank holds length / sp tokens. "
                "Use a length that is a multiple of the sp size."
            )


def _compose(field: str, parts: dict[str, Any]) -> Any:
    from accel._parallelism import Parallelism  # on use

    return Parallelism(**parts)


SECTION = Section(
    name="parallelism_config",
    title="ParallelismConfig Arguments",
    description="Arguments related to the ParallelismConfig used for distributed training.",
    order=60,
    accelerate_switch=(("ACCELERATE_USE_PARALLELISM_CONFIG", "true"),),
    active=lambda config: bool(config.parallelism_config),
    build=_build,
    compose=_compose,
    settings=(
        _size("pp", "pipeline stages (accel's key: Accelerate has no pipeline size)"),
        _size("dp_replicate", "replicas (DDP, or HSDP's outer dimension)"),
        _size("dp_shard", "ranks FSDP2 shards over (-1 fills the world)"),
        _size("cp", "context-parallel size (CUDA only)"),
        _size("tp", "tensor-parallel size", "tp_size"),
        _size("sp", "Ulysses sequence-parallel size (all-to-all around attention)"),
        _size("ep", "expert-parallel size (accel's key: experts split over ep ranks)"),
        _choice("sp_backend", "deepspeed: Ulysses, which accel runs itself"),
        _choice("sp_seq_length", "sequence length (checked: divisible by the sp size)"),
        _choice("sp_seq_length_is_variable", "accel checks every batch's length, variable or not"),
        _choice("sp_attn_implementation", "sdpa (torch's scaled_dot_product_attention)"),
        _choice("cp_comm_strategy", "allgather (torch's context_parallel rotation)"),
    ),
)  # fmt: skip
