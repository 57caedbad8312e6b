"""The compile section of the settings table: Accelerate's `dynamo_config` keys, `compile` and
`compile_dynamic` of RunContext's `wrap`, `ACCEL_COMPILE` and `ACCEL_COMPILE_DYNAMIC`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accel_settings._rows import Section, Setting
from accel_settings.values import allow, refuse


def _dynamo(key: str, help: str, **more: Any) -> Setting:
    # True exported as "True", as accel launch wrote Accelerate's dynamo variables before.
    more = {"kind": "any", "accelerate_case": "title", **more}
    return Setting(key=key, accelerate_env=f"ACCELERATE_{key.upper()}", help=help, **more)


def _rules(values: Mapping[str, Any], found: Mapping[str, Any], config: Any) -> dict[str, Any]:
    backend = str(values.get("dynamo_backend", "NO")).upper()
    if backend == "NO":
        return {}  # nothing compiles, so nothing of the section applies
    if backend != "INDUCTOR":
        refuse("dynamo_backend", values["dynamo_backend"], "accel compiles with inductor")
    allow("dynamo_mode", values.get("dynamo_mode", "default"), ("default", "None"),
          "accel compiles with the default mode")  # fmt: skip
    if values.get("dynamo_use_fullgraph"):
        refuse("dynamo_use_fullgraph", values["dynamo_use_fullgraph"],
               "accel compiles with torch.compile's defaults")  # fmt: skip
    regional = values.get("dynamo_use_regional_compilation", False)
    # compile_dynamic, when given, is its row's; unset is torch's automatic dynamic shapes.
    return {**found, "compile": "regional" if regional else True}


SECTION = Section(
    name="dynamo_config",
    title="Resource Selection Arguments",
    description="Arguments for fine-tuning how available hardware should be used.",
    order=10,
    active=lambda config: str(dict(config.dynamo_config).get("dynamo_backend", "NO")).upper()
    != "NO",
    rules=_rules,
    settings=(
        _dynamo("dynamo_backend", "INDUCTOR compiles the model (NO: off)", accelerate_case="upper"),
        _dynamo("dynamo_mode", "torch.compile mode: default"),
        _dynamo("dynamo_use_fullgraph", "refused when true: accel compiles with the defaults",
                kind="optional_bool"),
        _dynamo("dynamo_use_dynamic", "trace dynamic shapes (torch.compile's dynamic=): true, "
                "false; unset: recompile once a shape changes, then dynamic",
                kind="optional_bool", field="compile_dynamic", env="ACCEL_COMPILE_DYNAMIC"),
        _dynamo("dynamo_use_regional_compilation", "compile each repeated block (true/false)",
                kind="bool"),
        Setting(key=None, kind="compile", default=False, field="compile", env="ACCEL_COMPILE",
                help="what wrap_model compiles: false, true or regional"),
    ),
)  # fmt: skip
