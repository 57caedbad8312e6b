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
from collections.abc import Collection, Sequence
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
    if _find_module(name) is not None:
        return
    top, found = name.partition(".")[0], ""
    for part in name.split("."):  # the longest leading part that is found, for the message
        if _find_module(f"{found}.{part}" if found else part) is None:
            break
        found = f"{found}.{part}" if found else part
    missing = f"no module {top!r}" if not found else f"no module {name!r} in package {found!r}"
    raise ValueError(
        f"module={name!r} is not found: {missing} in the working folder {os.getcwd()} or on "
        "the Python path; check the name, or run accel launch from the folder that holds it."
    )


def _find_module(name: str) -> importlib.machinery.ModuleSpec | None:
    """Where `python -m name` would find `name`, without importing anything.

    `python -m` looks in the working folder first, then the path (installed packages included,
    which may be found only by an editable install's finder: hence find_spec for the top-level
    name). A submodule is looked up in its package's folders by the path finder, not by
    `find_spec("pkg.sub")`, which would import the package (its `__init__`) here.
    """
    top, *rest = name.split(".")
    spec = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()])
    if spec is None or spec.origin is None:
        # Nothing there, or a folder without __init__.py (a namespace portion, such as a
        # checkout named like the package): Python keeps looking, and a regular package or
        # module found on the path wins over it.
        spec = importlib.util.find_spec(top) or spec
    for part in rest:
        locations = spec.submodule_search_locations if spec is not None else None
        if not locations:
            return None
        spec = importlib.machinery.PathFinder.find_spec(part, list(locations))
    return spec


def misplaced_flags(
    script: str, *, module: bool, script_args: Sequence[str], launcher_flags: Collection[str]
) -> list[str]:
    """The flags of `accel launch` among `script_args` that the script never names.

    Everything after the script is the script's, so `accel launch train.py --num_processes 2`
    runs one process. A script that takes such a flag names it somewhere (an `add_argument`
    string, a parameter or field that a parser reads by name); one whose source names it
    nowhere was most likely given it for the launcher. Read, not run. A script that builds its
    flags from classes elsewhere (transformers' `HfArgumentParser`) or that cannot be read here
    is not judged.
    """
    given = [arg.split("=", 1)[0] for arg in script_args if arg.startswith("--")]
    candidates = [flag for flag in given if flag in launcher_flags]
    path = _source_path(script, module=module) if candidates else None
    if path is None:
        return []
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    strings: list[str] = []
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.append(node.value)
        elif (name := _identifier(node)) is not None:
            names.add(name)
    if "HfArgumentParser" in names:
        return []
    return [flag for flag in candidates if not _names(flag, strings, names)]


def _identifier(node: ast.AST) -> str | None:
    """The name a node binds or reads: a variable, attribute, parameter or imported name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.arg):
        return node.arg
    if isinstance(node, ast.alias):
        return node.name.rpartition(".")[2]
    return None


def _names(flag: str, strings: list[str], names: set[str]) -> bool:
    word = flag.lstrip("-")
    snake, kebab = word.replace("-", "_"), word.replace("_", "-")
    return snake in names or any(
        text in (snake, kebab) or f"--{snake}" in text or f"--{kebab}" in text for text in strings
    )


def _source_path(script: str, *, module: bool) -> Path | None:
    if not module:
        return Path(script)
    spec = _find_module(script)
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


# Packages whose `*Trainer` classes are transformers' Trainer or built on it (TRL's SFTTrainer...).
_TRAINER_PACKAGES = frozenset({"transformers", "trl"})


def uses_trainer(script: str, *, module: bool) -> bool:
    """Whether the script imports a `*Trainer` from transformers (or a package built on it).

    The launcher warns about settings that do not reach such a Trainer only where they apply.
    Read, not run: the script's own syntax tree (a submodule's too, found without importing
    its package). A module whose source cannot be found here (a compiled one) counts as using
    it, so the warning errs on the side of showing.
    """
    path = _source_path(script, module=module)
    if path is None:
        return True
    tree = ast.parse(path.read_bytes(), filename=str(path))
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
