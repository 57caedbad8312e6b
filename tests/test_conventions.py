"""The conventions of STYLE.md that code can check: frozen dataclasses, no mutable module
state, annotated public functions, a side-effect-free import."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import setuptools

import accel

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(accel.__path__, prefix="accel.") if ".cli" not in m.name
)


def _module(name: str) -> types.ModuleType:
    return importlib.import_module(name)


@pytest.mark.parametrize("name", MODULES)
def test_every_dataclass_is_frozen_and_slotted(name: str) -> None:
    for obj in vars(_module(name)).values():
        if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == name:
            params = obj.__dataclass_params__  # type: ignore[attr-defined]
            assert params.frozen, f"{name}.{obj.__name__} must be frozen"
            assert hasattr(obj, "__slots__"), f"{name}.{obj.__name__} must use slots=True"


@pytest.mark.parametrize("name", MODULES)
def test_no_mutable_module_state(name: str) -> None:
    for attr, value in vars(_module(name)).items():
        if attr == "__all__" or attr.startswith("__"):
            continue
        assert not isinstance(value, (list, dict, set, bytearray)), (
            f"{name}.{attr} is a mutable {type(value).__name__}; use a tuple, frozenset or "
            "MappingProxyType, or pass the state explicitly"
        )


@pytest.mark.parametrize("name", MODULES)
def test_public_functions_are_annotated_and_documented(name: str) -> None:
    module = _module(name)
    undocumented = []
    for attr in getattr(module, "__all__", ()):
        obj = getattr(module, attr)
        if not inspect.isfunction(obj):
            continue
        signature = inspect.signature(obj)
        missing = [
            p for p, v in signature.parameters.items() if v.annotation is inspect.Parameter.empty
        ]
        assert not missing, f"{name}.{attr}: parameters {missing} are not annotated"
        assert signature.return_annotation is not inspect.Signature.empty, f"{name}.{attr} return"
        if lacking := _missing_docstring_sections(obj.__doc__ or "", signature):
            undocumented.append(f"{attr} lacks {', '.join(lacking)}")
    assert not undocumented, f"{name} (STYLE.md 9, Google style): " + "; ".join(undocumented)


def _missing_docstring_sections(doc: str, signature: inspect.Signature) -> list[str]:
    """What `doc` lacks of STYLE.md 9: an `Args:` entry per parameter, `Returns:` or `Yields:`
    unless the function returns None, and an `Example:`."""
    lines = inspect.cleandoc(doc).splitlines()
    headers = {line for line in lines if line and not line[0].isspace()}
    missing = []
    sections = ("Args:", "Returns:", "Yields:", "Raises:", "Example:", "Examples:")
    missing += [f"one {h} (it has {lines.count(h)})" for h in sections if lines.count(h) > 1]
    if signature.parameters:
        if "Args:" not in headers:
            missing.append("Args:")
        else:
            listed = _args_entries(lines)
            if absent := [p for p in signature.parameters if p not in listed]:
                missing.append(f"Args: entries for {absent}")
    # `from __future__ import annotations` leaves every annotation a string.
    if signature.return_annotation not in (None, "None") and not headers & {"Returns:", "Yields:"}:
        missing.append("Returns:/Yields:")
    if not headers & {"Example:", "Examples:"}:
        missing.append("Example:")
    return missing


def _args_entries(lines: list[str]) -> set[str]:
    """The names the `Args:` section describes (`name: ...`, `*args: ...`, `**kwargs: ...`)."""
    body = lines[lines.index("Args:") + 1 :]
    body = body[: next((i for i, line in enumerate(body) if line and not line[0].isspace()), None)]
    indent = min((len(line) - len(line.lstrip()) for line in body if line.strip()), default=0)
    names = set()
    for line in body:
        if line.strip() and len(line) - len(line.lstrip()) == indent:
            name, colon, _ = line.strip().lstrip("*").partition(":")
            if colon and name.isidentifier():
                names.add(name)
    return names


def test_the_docstring_check_finds_missing_sections() -> None:
    def undocumented(x: int) -> int:
        """Return `x`."""
        return x

    def half_documented(x: int, *rest: int, scale: float = 1.0, **options: str) -> int:
        """Return `x`.

        Args:
            x: a number,
                described over two lines.
            *rest: more numbers.
            **options: ignored.

        Returns:
            `x`.

        Example:
            >>> half_documented(1)
            1
        """
        return x

    def documented(x: int) -> None:
        """Do nothing with `x`.

        Args:
            x: ignored.

        Example:
            >>> documented(1)
        """

    def check(fn: Any) -> list[str]:
        return _missing_docstring_sections(fn.__doc__ or "", inspect.signature(fn))

    assert check(undocumented) == ["Args:", "Returns:/Yields:", "Example:"]
    assert check(half_documented) == ["Args: entries for ['scale']"]
    assert check(documented) == []
    twice = "Do nothing.\n\nArgs:\n    x: ignored.\n\nArgs:\n    x: again.\n\nExample:\n    >>> 1\n"
    assert _missing_docstring_sections(twice, inspect.signature(documented)) == [
        "one Args: (it has 2)"
    ]


def test_init_reexports_exactly_the_public_modules() -> None:
    public = set()
    for name in MODULES:
        # accel.testing is its own namespace (accel.testing.run_world), as torch.testing is.
        if not name.rsplit(".", 1)[1].startswith("_") and name != "accel.testing":
            public |= set(getattr(_module(name), "__all__", ()))
    assert set(accel.__all__) == public


@pytest.mark.slow
def test_import_starts_no_cuda_no_process_group_and_writes_no_environment() -> None:
    probe = (
        "import json, os, sys; before = dict(os.environ); import torch;"
        "import torch.distributed as dist; loaded = set(sys.modules); import accel;"
        "print(json.dumps({'cuda': torch.cuda.is_initialized(), 'pg': dist.is_initialized(),"
        " 'env': dict(os.environ) == before,"
        " 'optional': sorted(m for m in set(sys.modules) - loaded"
        "                    if m.split('.')[0] in ('tqdm', 'tensorboard', 'transformers')),"
        f" 'slow': sorted(m for m in set(sys.modules) - loaded if m.startswith({SLOW!r}))}}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert got == {"cuda": False, "pg": False, "env": True, "optional": [], "slow": []}


# What `import accel` leaves to the call that needs it (DESIGN: at most 50 ms over torch; each
# of these costs from 10 ms to seconds): imported inside the function, with a comment saying so.
SLOW = (
    "torch._dynamo", "torch._inductor", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.distributed.pipelining", "torch.distributed.checkpoint", "torch.distributed.run",
    "safetensors", "yaml", "deepspeed", "torchao",
)  # fmt: skip


# ------------------------------------------------------------------------------ layout

PACKAGE = Path(accel.__file__).parent
# Private modules at the top of the package serve several concerns; a private module of one
# concern lives in that concern's subpackage (checkpoint/, big_model/, data/, parallel/, cli/).
SHARED_PRIVATE = frozenset(
    {
        "_agreement",
        # background checkpoint saves: started by checkpoint/, waited for by shutdown()
        "_background",
        "_deepspeed_flags",
        "_canary",  # the device canary's mode: read by default_device, entered by accel.testing
        "_device",  # default_device and resolve_device: used by context.py and distributed.py
        "_dtensor",
        "_exit",
        "_groups",
        "_launcher",
        "_mesh",
        "_model_spec",  # the model a command line names: read by the CLI and estimate_memory
        # FSDPOptions and the compile mode: RunContext holds them, parallel/ applies them
        "_options",
        "_parallelism",
        "_rerun",  # how a pre-empted run ends: preemption acts on it, init_distributed holds
        "_size",
        "_tree",
        "_typing",
        "_version",
        "_world",
    }
)


ROOT = PACKAGE.parent


def _distribution_packages() -> tuple[Path, ...]:
    """The folder of every top-level package the distribution installs, as pyproject's
    `[tool.setuptools.packages.find]` finds them (`accel`, `accel_cli`)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    names = setuptools.find_packages(where=str(ROOT), include=include)
    return tuple(ROOT / top for top in sorted({name.split(".")[0] for name in names}))


def _distribution_files() -> dict[str, Path]:
    """Module name -> file, for every module of every package the distribution installs."""
    return {
        _module_name(p): p for package in _distribution_packages() for p in package.rglob("*.py")
    }


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> list[tuple[str, int, bool]]:
    """(imported accel module, line, inside a function) for every import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from accel.x import y` imports the module accel.x.y when there is one.
            names = [f"{node.module}.{a.name}" for a in node.names]
            names = [n if n in modules else node.module for n in names]
        for name in names:
            if name in modules:
                found.append((name, node.lineno, node.col_offset > 0))
    return found


def _graph() -> dict[str, set[str]]:
    files = _distribution_files()
    return {m: {dep for dep, _, _ in _imports(p, set(files))} - {m} for m, p in files.items()}


def _find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in `graph` (module -> modules it imports), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                return [*path[path.index(dep) :], dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (circle := visit(module)):
            return circle
    return None


def test_the_import_graph_has_no_circle() -> None:
    # Imports inside functions count too: they run, and hiding a circle in one is still a circle.
    # The graph spans every package the distribution installs: a circle may pass through the
    # `accel` command's own package.
    assert {p.name for p in _distribution_packages()} >= {"accel", "accel_cli"}
    circle = _find_circle(_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_circle_check_finds_circles() -> None:
    assert _find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_circle({"p": {"p._x"}, "p._x": {"q"}, "q": set()}) is None
    # A package's own module counts: the command's circle of last turn, through a deferred
    # import in accel_cli and accel.cli's __init__.
    cli = {"accel_cli": {"accel.cli"}, "accel.cli": {"accel.cli._main"},
           "accel.cli._main": {"accel_cli"}}  # fmt: skip
    assert _find_circle(cli) == ["accel.cli", "accel.cli._main", "accel_cli", "accel.cli"]
    # accel's own circle of last turn, hidden in a function of context.py:
    old = {"collectives": {"context"}, "context": {"distributed"}, "distributed": {"collectives"}}
    assert _find_circle(old) == ["collectives", "context", "distributed", "collectives"]


def test_accel_imports_inside_functions_say_why() -> None:
    files = _distribution_files()
    for module, path in files.items():
        lines = path.read_text().splitlines()
        for dep, line, nested in _imports(path, set(files)):
            if nested:
                assert "#" in lines[line - 1], (
                    f"{module}:{line} imports {dep} inside a function; import it at the top, or "
                    "say in a comment why not (an optional dependency, start-up cost)"
                )


def test_no_module_is_over_450_lines() -> None:
    # Every line counts, docstrings too: a reader reads them all.
    long = {
        _module_name(p): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 450
    }
    assert not long, f"split these modules by sub-concern: {long}"


def test_private_modules_live_in_the_subpackage_of_their_concern() -> None:
    top = {p.stem for p in PACKAGE.glob("_*.py") if not p.stem.startswith("__")}
    assert top == SHARED_PRIVATE, (
        f"private modules at the top of accel/: {sorted(top - SHARED_PRIVATE)} are new; put a "
        "module of one concern in that concern's subpackage (or list it here if it is shared)"
    )


# A subpackage's private modules and names are its own. The shared ones live at the top of accel/
# (`accel._groups`, `accel._safetensors`); each entry here is a reason, not a habit.
CROSS_PACKAGE_PRIVATE = frozenset(
    {
        # The command is a shell over the one merge; the function is not public API.
        ("accel.cli._merge", "accel.checkpoint._merge"),
    }
)


def _package(module: str) -> str:
    """The subpackage a module belongs to: "" for the top of accel and its private packages."""
    parts = module.split(".")
    is_subpackage = len(parts) > 1 and (PACKAGE / parts[1]).is_dir()
    return parts[1] if is_subpackage and not parts[1].startswith("_") else ""


def _is_module(name: str) -> bool:
    path = PACKAGE.joinpath(*name.split(".")[1:])
    return path.is_dir() or path.with_suffix(".py").is_file()


def _private_imports(module: str, source: str) -> list[str]:
    """Imports in `source` of another subpackage's private modules or private names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for full in targets:
            if not full.startswith("accel."):
                continue
            target, name = (full, "") if _is_module(full) else full.rsplit(".", 1)
            parts = target.split(".")
            owner = _package(target)
            private = next((i for i, p in enumerate(parts) if i >= 2 and p.startswith("_")), None)
            private_module = ".".join(parts[: private + 1]) if private is not None else None
            bad_module = private_module is not None and owner not in ("", _package(module))
            bad_name = name.startswith("_") and not name.startswith("__")
            bad_name = bad_name and owner != _package(module)
            key = (module, private_module if bad_module else target)
            if (bad_module or bad_name) and key not in CROSS_PACKAGE_PRIVATE:
                found.append(f"{module}:{node.lineno} imports {full}")
    return found


def test_no_private_import_across_packages() -> None:
    found = [
        hit
        for path in PACKAGE.rglob("*.py")
        for hit in _private_imports(_module_name(path), path.read_text())
    ]
    assert not found, (
        "private imports across packages (move the module to the package that uses it, or to "
        f"the top of accel/ when several do): {found}"
    )


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("accel.checkpoint._model_io", "from accel.parallel._fsdp import REPLACED"),
        ("accel.data", "from accel.collectives import _pad"),
        ("accel.cli._launch", "import accel.checkpoint._steps"),
        ("accel.precision", "from accel.parallel import _ddp"),
    ],
)
def test_the_private_import_check_finds_planted_imports(module: str, line: str) -> None:
    assert _private_imports(module, line), line


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("accel.checkpoint._model_io", "from accel.checkpoint._atomic import write_at"),
        ("accel.data", "from accel._groups import require_group"),
        ("accel.big_model._dispatch", "from accel._safetensors.files import resolve_checkpoint"),
        ("accel.cli._merge", "from accel.checkpoint._merge import merge_weights"),
    ],
)
def test_the_private_import_check_allows_own_and_shared_modules(module: str, line: str) -> None:
    assert not _private_imports(module, line), line


# Names a public module defines for accel's own use, outside its `__all__`, that other modules
# import. STYLE.md names the first two homes; the others are helpers of a public function that
# `data/` shares, listed so that a new one is a decision, not a habit.
INTERNAL_NAMES_OF_PUBLIC_MODULES = frozenset(
    {
        ("accel.context", "default_device"),  # STYLE.md 1: beside RunContext
        ("accel.errors", "NOT_INITIALIZED_MSG"),  # STYLE.md 5: message constants
        ("accel.collectives", "gather_leaves"),
        ("accel.collectives", "gather_parts"),
        ("accel.collectives", "pad_tensor"),
        ("accel.seeding", "check_seed"),
    }
)


def _is_public_module(name: str) -> bool:
    return _is_module(name) and not any(p.startswith("_") for p in name.split(".")[1:])


def _internal_names_imported(source: str) -> list[tuple[str, str, int]]:
    """(public module, name, line) for each `from <public accel module> import <name>` of a
    name outside that module's `__all__` (a submodule is not a name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
            continue
        if not node.module.startswith("accel.") or not _is_public_module(node.module):
            continue
        exported = set(getattr(_module(node.module), "__all__", ()))
        for alias in node.names:
            if alias.name not in exported and not _is_module(f"{node.module}.{alias.name}"):
                found.append((node.module, alias.name, node.lineno))
    return found


def test_nothing_private_is_defined_in_a_public_module() -> None:
    # A name others import but users must not belongs in a private module (accel._deepspeed_flags,
    # accel._world): a public module holds its `__all__` and what only it uses.
    found = [
        f"{_module_name(path)}:{line} imports {module}.{name}"
        for path in PACKAGE.rglob("*.py")
        for module, name, line in _internal_names_imported(path.read_text())
        if (module, name) not in INTERNAL_NAMES_OF_PUBLIC_MODULES
    ]
    assert not found, (
        "names outside a public module's __all__ imported elsewhere (move them to a private "
        f"module that the users share): {found}"
    )


def test_the_internal_name_check_finds_planted_imports() -> None:
    assert _internal_names_imported("from accel.testing import _start_world")
    assert _internal_names_imported("from accel.parallel.deepspeed import ENGINE_REF")
    assert not _internal_names_imported("from accel.parallel.deepspeed import deepspeed_engine")
    assert not _internal_names_imported("from accel.parallel import deepspeed")
