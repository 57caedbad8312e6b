"""What `accel launch` checks of the script before any worker starts.

A script that cannot start fails the same way on every worker, each with its own traceback
under torchrun's agent log; checked once here, it is one line naming the module, or the file
and line, and no process starts.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
from pathlib import Path


def check_script(script: str, *, module: bool) -> None:
    """Raise a one-line error if `script` (a path, or a module name with `module`) cannot run."""
    if module:
        _check_module(script)
        return
    path = Path(script)  # that it exists is checked with the rest of the command line
    try:
        compile(path.read_bytes(), str(path), "exec")
    except SyntaxError as err:
        raise ValueError(
            f"script={script!r} does not compile: {err.msg} ({err.filename}, line "
            f"{err.lineno}); fix the script."
        ) from None


def _check_module(name: str) -> None:
    # `python -m` looks in the working folder first, then the path (installed packages
    # included, which may be found only by an editable install's finder: hence find_spec).
    # Only the top-level name is looked up: finding a submodule would import its package here.
    top = name.partition(".")[0]
    if importlib.util.find_spec(top) is not None:
        return
    if importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is not None:
        return
    raise ValueError(
        f"module={name!r} is not found: no module {top!r} in the working folder "
        f"{os.getcwd()} or on the Python path; check the name, or run accel launch from the "
        "folder that holds it."
    )


# Packages whose `*Trainer` classes are transformers' Trainer or built on it (TRL's SFTTrainer...).
_TRAINER_PACKAGES = frozenset({"transformers", "trl"})


def uses_trainer(script: str, *, module: bool) -> bool:
    """Whether the script imports a `*Trainer` from transformers (or a package built on it).

    The launcher warns about settings that do not reach such a Trainer only where they apply.
    Read, not run: the script's own syntax tree. A module whose file cannot be found here (a
    submodule, a compiled one) counts as using it, so the warning errs on the side of showing.
    """
    if module:
        spec = importlib.util.find_spec(script) if "." not in script else None
        if spec is None or not (spec.origin or "").endswith(".py"):
            return True
        script = str(spec.origin)
    tree = ast.parse(Path(script).read_bytes(), filename=script)
    packages: set[str] = set()  # names bound to transformers or trl (`import transformers as tf`)
    for node in ast.walk(tree):
        imported = node.names if isinstance(node, ast.ImportFrom) else ()
        if _is_trainer_package(getattr(node, "module", None)) and any(
            alias.name.endswith("Trainer") for alias in imported
        ):
            return True
        if isinstance(node, ast.Import):
            packages |= {a.asname or a.name for a in node.names if _is_trainer_package(a.name)}
    return any(
        isinstance(node, ast.Attribute)
        and node.attr.endswith("Trainer")
        and isinstance(node.value, ast.Name)
        and node.value.id in packages
        for node in ast.walk(tree)
    )


def _is_trainer_package(name: str | None) -> bool:
    return name is not None and name.partition(".")[0] in _TRAINER_PACKAGES
