"""Write docs/api.md, the API reference, from the signatures and docstrings of accel's public names.

python tools/gen_api.py          # rewrite docs/api.md
python tools/gen_api.py --check  # exit 1 if docs/api.md is out of date
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import accel
import accel.testing

OUT = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _public_modules() -> dict[str, str]:
    """Each public name -> the public module whose `__all__` lists it (private modules are
    never named in the reference)."""
    owner: dict[str, str] = {}
    for info in pkgutil.walk_packages(accel.__path__, prefix="accel."):
        if any(part.startswith("_") for part in info.name.split(".")) or ".cli" in info.name:
            continue
        for name in getattr(importlib.import_module(info.name), "__all__", ()):
            owner[name] = info.name
    return owner


def _entries() -> dict[str, list[tuple[str, object]]]:
    by_module: dict[str, list[tuple[str, object]]] = {}
    owner = _public_modules()
    for name in sorted(accel.__all__):
        obj = getattr(accel, name)
        by_module.setdefault(owner[name], []).append((name, obj))
    by_module["accel.testing"] = [
        ("device_canary", accel.testing.device_canary),
        ("run_world", accel.testing.run_world),
    ]
    return by_module


def _signature(name: str, obj: object) -> str:
    if inspect.isclass(obj):
        try:
            return f"class {name}{inspect.signature(obj)}"
        except (TypeError, ValueError):
            return f"class {name}"
    try:
        return f"{name}{inspect.signature(obj)}"  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return name


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python tools/gen_api.py`; do not edit by hand.",
        "Every name below is importable from `accel` (and `device_canary` and `run_world` from "
        "`accel.testing`).",
        "",
    ]
    for module, entries in sorted(_entries().items()):
        lines += [f"## {module}", ""]
        doc = inspect.getdoc(sys.modules[module])
        if doc:
            lines += [doc.split("\n\n")[0].replace("\n", " "), ""]
        for name, obj in entries:
            lines += [f"### `{name}`", "", "```text", _signature(name, obj), "```", ""]
            text = inspect.getdoc(obj) or "(no docstring)"
            lines += ["```text", text, "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            sys.exit("docs/api.md is out of date: run `python tools/gen_api.py`")
        return
    OUT.write_text(text)


if __name__ == "__main__":
    main()
