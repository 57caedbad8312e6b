"""Accelerate's `dynamo_use_dynamic`, end to end: flag, accel's and Accelerate's YAML, the
workers' variable, `ctx.wrap.compile_dynamic`, `describe()`, `wrap_model` compiling with it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import accel
from accel._settings.table import accelerate_variables, build, environment
from accel.config import env_settings, load_config
from tests.cli.test_cli import accel_cli
from tests.test_settings_table import _parse_flags

DYNAMO = ["--dynamo_backend", "inductor", "--dynamo_use_dynamic"]


@pytest.mark.parametrize("value", [True, False])
def test_flag_yaml_accelerate_yaml_and_variable_give_the_field(tmp_path: Path, value: bool) -> None:
    config = _parse_flags([*DYNAMO, str(value).lower()], tmp_path)
    assert build(config)["compile_dynamic"] is value
    accelerate_yaml = tmp_path / "accelerate.yaml"  # as `accelerate config` writes the section
    accelerate_yaml.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: 'no'\n"
        f"dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_use_dynamic: {str(value).lower()}\n"
    )
    assert build(load_config(accelerate_yaml))["compile_dynamic"] is value
    env = environment(build(config), config)
    assert env["ACCEL_COMPILE_DYNAMIC"] == str(value).lower()
    assert env_settings(env)["compile_dynamic"] == (value, "env ACCEL_COMPILE_DYNAMIC")
    exported = accelerate_variables(config)["ACCELERATE_DYNAMO_USE_DYNAMIC"]
    assert exported.lower() == str(value).lower()  # Accelerate reads it with str_to_bool


def test_unset_is_torchs_default_and_a_bad_value_is_refused(tmp_path: Path) -> None:
    config = _parse_flags(DYNAMO[:2], tmp_path)
    assert "compile_dynamic" not in build(config)
    assert "ACCEL_COMPILE_DYNAMIC" not in environment(build(config), config)
    with pytest.raises(ValueError, match=r"dynamo_use_dynamic='maybe' must be true or false"):
        _parse_flags([*DYNAMO, "maybe"], tmp_path)
    with pytest.raises(ValueError, match=r"ACCEL_COMPILE_DYNAMIC='yes' must be true or false"):
        env_settings({"ACCEL_COMPILE_DYNAMIC": "yes"})
    with pytest.raises(TypeError, match=r"compile_dynamic=1 must be True, False or None"):
        accel.WrapDefaults(compile_dynamic=1)  # type: ignore[arg-type]


def _graphs(dynamic: bool, compile: bool | str = True) -> int:
    """Graphs torch.compile made for a model wrapped under ctx.wrap.compile_dynamic=`dynamic` and
    called on two batch sizes."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    wrap = accel.WrapDefaults(compile=compile, compile_dynamic=dynamic)  # type: ignore[arg-type]
    ctx = accel.RunContext(wrap=wrap)
    model = accel.wrap_model(ctx, nn.Sequential(nn.Linear(4, 3)))
    for rows in (2, 3):
        model(torch.randn(rows, 4))
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.slow
def test_wrap_model_compiles_with_the_dynamic_setting() -> None:
    # Dynamic shapes trace one graph for every batch size; static ones a graph per size.
    leak = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"  # inductor sets it on its first run
    had = leak in os.environ
    try:
        assert (_graphs(True), _graphs(False)) == (1, 2)
    finally:
        if not had:
            os.environ.pop(leak, None)  # torch's, not accel's: the no-leak check is for accel


@pytest.mark.slow
def test_a_launched_script_and_accelerates_own_plugin_see_it(tmp_path: Path) -> None:
    script = tmp_path / "report.py"
    script.write_text(
        "import json, sys\nimport accel\nfrom accelerate.utils import TorchDynamoPlugin\n"
        "ctx = accel.init_distributed()\n"
        "line = [x for x in ctx.describe().splitlines() if x.startswith('wrap')][0]\n"
        "json.dump({'field': ctx.wrap.compile_dynamic, 'describe': line,\n"
        "           'accelerate': TorchDynamoPlugin().dynamic}, open(sys.argv[1], 'w'))\n"
        "accel.shutdown(ctx)\n"
    )
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"dynamo_config": {"dynamo_backend": "INDUCTOR"}}))
    out = accel_cli(
        tmp_path, "launch", "--config_file", str(config), "--dynamo_use_dynamic", "true",
        str(script), str(tmp_path / "seen.json"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {
        "field": True,
        "describe": "wrap             = WrapDefaults(fsdp=None, activation_checkpointing=False, "
        "compile=True, compile_dynamic=True, deepspeed=None)  "
        "(env ACCEL_COMPILE, env ACCEL_COMPILE_DYNAMIC)",
        "accelerate": True,
    }
