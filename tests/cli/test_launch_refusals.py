"""`accel launch` refuses a bad value of every section of the settings table before any worker
starts: one line naming the key, exit code 2, and the script never runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.cli.test_cli import accel_cli

pytestmark = pytest.mark.slow  # each case starts `accel launch` (it imports torch)

# Section -> (the YAML of the launch, a fragment of the one line that must name the key).
CASES = {
    "core": ({"mixed_precision": "fp64"}, "mixed_precision='fp64'"),
    "mesh": (
        {"parallelism_config": {"parallelism_config_tp_size": "x"}},
        "parallelism_config_tp_size='x'",
    ),
    "fsdp": (
        {"distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": "maybe"}},
        "fsdp_offload_params='maybe'",
    ),
    "deepspeed": (
        {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": "x"}},
        "zero_stage='x'",
    ),
    "deepspeed_device": (
        {"distributed_type": "DEEPSPEED", "deepspeed_config": {"offload_param_device": "disk"}},
        "offload_param_device='disk'",
    ),
    "deepspeed_launcher": (
        {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_hostfile": "/h"}},
        "deepspeed_hostfile='/h'",
    ),
    "fp8": ({"mixed_precision": "fp8", "fp8_config": {"backend": "XYZ"}}, "backend='XYZ'"),
    "compile": (
        {"dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_use_dynamic": "maybe"}},
        "dynamo_use_dynamic='maybe'",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_value_of_each_section_is_refused_before_any_worker(
    tmp_path: Path, case: str
) -> None:
    data, named = CASES[case]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"use_cpu": True, **data}))
    (tmp_path / "x.py").write_text("print('ran')\n")
    out = accel_cli(tmp_path, "launch", "--config_file", "c.yaml", "x.py")
    assert "ran" not in out.stdout, out.stdout[-2000:]
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("accel launch: error: ") and named in out.stderr, out.stderr
