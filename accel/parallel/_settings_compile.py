"""The compile section of the settings table: Accelerate's `dynamo_config` keys, RunContext's
`compile`, `ACCEL_COMPILE`.

Declarations import only the standard library and `accel_cli._setting`; see _settings_fsdp.
"""

from __future__ import annotations

from typing import Any

from accel_cli._setting import Section, Setting


def _dynamo(key: str, help: str, **more: Any) -> Setting:
    # True exported as "True", as accel launch wrote Accelerate's dynamo variables before.
    more = {"kind": "any", "accelerate_case": "title", **more}
    return Setting(key=key, accelerate_env=f"ACCELERATE_{key.upper()}", help=help, **more)


def _build(config: Any) -> dict[str, Any]:
    from accel._settings.values import allow, known, parse, refuse  # on use

    values = known(config, SECTION)
    backend = str(values.get("dynamo_backend", "NO")).upper()
    if backend == "NO":
        return {}
    if backend != "INDUCTOR":
        refuse("dynamo_backend", values["dynamo_backend"], "accel compiles with inductor")
    allow("dynamo_mode", values.get("dynamo_mode", "default"), ("default", "None"),
          "accel compiles with the default mode")  # fmt: skip
    if parse("optional_bool", "dynamo_use_fullgraph", values.get("dynamo_use_fullgraph")):
        refuse("dynamo_use_fullgraph", values["dynamo_use_fullgraph"],
               "accel compiles with torch.compile's defaults")  # fmt: skip
    regional = parse("bool", "dynamo_use_regional_compilation",
                     values.get("dynamo_use_regional_compilation", False))  # fmt: skip
    found: dict[str, Any] = {"compile": "regional" if regional else True}
    dynamic = parse("optional_bool", "dynamo_use_dynamic", values.get("dynamo_use_dynamic"))
    if dynamic is not None:  # unset: torch's automatic dynamic shapes, as in Accelerate
        found["compile_dynamic"] = dynamic
    return found


SECTION = Section(
    name="dynamo_config",
    title="Resource Selection Arguments",
    description="Arguments for fine-tuning how available hardware should be used.",
    order=10,
    active=lambda config: str(dict(config.dynamo_config).get("dynamo_backend", "NO")).upper()
    != "NO",
    build=_build,
    settings=(
        _dynamo("dynamo_backend", "INDUCTOR compiles the model (NO: off)", accelerate_case="upper"),
        _dynamo("dynamo_mode", "torch.compile mode: default"),
        _dynamo("dynamo_use_fullgraph", "refused when true: accel compiles with the defaults"),
        _dynamo("dynamo_use_dynamic", "trace dynamic shapes (torch.compile's dynamic=): true, "
                "false; unset: recompile once a shape changes, then dynamic",
                kind="optional_bool", field="compile_dynamic", env="ACCEL_COMPILE_DYNAMIC"),
        _dynamo("dynamo_use_regional_compilation", "compile each repeated block (true/false)"),
        Setting(key=None, kind="compile", default=False, field="compile", env="ACCEL_COMPILE",
                help="what wrap_model compiles: false, true or regional"),
    ),
)  # fmt: skip
