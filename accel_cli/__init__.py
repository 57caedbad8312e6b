"""The `accel` command's parser and entry point, kept outside the `accel` package.

`import accel` imports torch, which takes seconds; parsing a command line needs only argparse.
So `accel --help`, `accel launch --help`, a mistyped flag or a bad value are answered here
without importing torch, and only a command line that parses imports `accel.cli` to run it.
Every usage error is one line naming the flag or value and the fix; a mistyped flag or command
gets the closest match.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from accel_cli._refused import add_refused

if TYPE_CHECKING:
    from accel_settings import Setting  # a type only: `accel --help` reads no table

__all__ = ["answer_help_early", "build_parser", "main"]

# `accel launch --help` groups its flags as `accelerate launch --help` does (same titles): these
# groups first, with the flags that are the command's own (not settings); the settings table
# (`accel_settings`, which imports neither accel nor torch) fills them and adds its sections'.
_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Hardware Selection Arguments", "Arguments for selecting the hardware to be used.",
     ("multi_gpu",)),
    ("Resource Selection Arguments",
     "Arguments for fine-tuning how available hardware should be used.", ()),
    ("Training Paradigm Arguments",
     "Arguments for selecting which training paradigm to be used. `accel launch --use_fsdp "
     "--help` also lists the FSDP arguments, `--use_deepspeed --help` the DeepSpeed ones.",
     ("use_deepspeed", "use_fsdp", "use_parallelism_config")),
    ("Distributed GPUs", "Arguments related to distributed training (GPUs or CPUs).",
     ("same_network", "tee", "log_dir")),
)  # fmt: skip

_FLAG_HELP = {
    "multi_gpu": "distributed on GPUs",
    "use_fsdp": "shard with FSDP2",
    "use_deepspeed": "train through a DeepSpeed ZeRO engine (wrap_model, strategy 'auto')",
    "use_parallelism_config": "accepted for Accelerate; parallelism_config_* flags set the mesh",
    "same_network": "accepted for Accelerate: machine 0's address is always passed to torchrun",
    "log_dir": "write each worker's output under this folder",
    "tee": "also copy workers' output into --log_dir: 0 none, 1 stdout, 2 stderr, 3 both",
}
_SWITCHES = ("same_network", "multi_gpu", "use_fsdp", "use_deepspeed", "use_parallelism_config")
_EXAMPLES = {"int": "2", "float": "0.5"}
_METAVARS = {int: "N", float: "SECONDS"}
_TYPE_NAMES = {"int": "a whole number", "float": "a number"}
# How a top-level setting's value type reads from the command line (sections take text, which
# their parsers read as YAML's values).
_FLAG_TYPES = {"count": int, "index": int, "optional_count": int, "optional_index": int,
               "port": int, "float": float, "mesh_size": int}  # fmt: skip


class _HelpFormatter(argparse.HelpFormatter):
    """Lists each flag once, in its underscore spelling (the hyphenated one works as well)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        strings = action.option_strings
        underscored = [s for s in strings if not (s.startswith("--") and "-" in s[2:])]
        if strings and underscored != strings:
            action = argparse.Action(
                underscored, action.dest, nargs=action.nargs, metavar=action.metavar
            )
        return super()._format_action_invocation(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line naming the flag and the fix."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # reported by the subcommand that was given them, with its own flags
            chosen = next(
                (sub for a in self._actions if isinstance(a, argparse._SubParsersAction)
                 for name, sub in a.choices.items() if name == getattr(parsed, "command", None)),
                self,
            )  # fmt: skip
            chosen.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_explain(self, message)}\n")


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of `parser` and of its subcommands."""
    found: list[str] = []
    for action in parser._actions:
        found += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _options(sub)
    return found


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    return [
        name
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    ]


def _did_you_mean(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _explain(parser: argparse.ArgumentParser, message: str) -> str:
    """Rewrite an argparse message into one line naming the flag or value and the fix."""
    lists = f"`{parser.prog} --help` lists them"
    if match := re.match(r"unrecognized arguments: (.*)", message):
        words = match.group(1).split()
        flag = next((w for w in words if w.startswith("-")), None)
        if flag is None:
            return f"unexpected argument {words[0]!r}; `{parser.prog} --help` describes them."
        name = flag.split("=")[0]
        hint = _did_you_mean(name, _options(parser)) or f"; {lists}"
        return f"{name} is not a flag of `{parser.prog}`{hint}"
    if match := re.match(r"argument ([^:]+): invalid (\w+) value: (.*)", message):
        flag = match.group(1).split("/")[0]
        kind, value = match.group(2), match.group(3)
        example = _EXAMPLES.get(kind, "VALUE")
        what = _TYPE_NAMES.get(kind, f"a {kind}")
        return f"{flag}={value} is not {what}; pass {what}, e.g. {flag} {example}."
    if match := re.match(r"argument (\S+): invalid choice: (\S+) \(choose from (.*)\)", message):
        flag, value, allowed = match.groups()
        if flag == "COMMAND":
            hint = _did_you_mean(value.strip("'"), _commands(parser)) or f"; {lists}"
            return f"unknown command {value}{hint} (commands: {allowed})"
        flag = flag.split("/")[0]
        return f"{flag}={value} is not allowed (invalid choice); expected one of {allowed}."
    if match := re.match(r"the following arguments are required: (.*)", message):
        missing = match.group(1)
        if missing.startswith("COMMAND"):
            return f"no command given; expected one of {tuple(_commands(parser))}. {lists}."
        if missing.startswith("script"):
            return (
                "no script given; pass the training script after the flags, e.g. "
                f"`{parser.prog} --num_processes 2 train.py`."
            )
        return f"missing the argument {missing}; `{parser.prog} --help` describes it."
    if match := re.match(r"argument ([^:]+): expected one argument", message):
        return f"{match.group(1).split('/')[0]} needs a value; {lists} with their values."
    return f"{message}; {lists}."


def _add_flag(parser: Any, name: str, **options: Any) -> None:
    """Add `--name_with_underscores` and its `--hyphenated-spelling` as one option."""
    spellings = [f"--{name}"]
    if "_" in name:
        spellings.append(f"--{name.replace('_', '-')}")
    parser.add_argument(*spellings, dest=name, **options)


def _own_flag(name: str) -> dict[str, Any]:
    """The add_argument options of one of the command's own `accel launch` flags."""
    if name in _SWITCHES:
        return {"action": "store_true", "help": _FLAG_HELP[name]}
    if name == "tee":
        return {"choices": ("0", "1", "2", "3"), "help": _FLAG_HELP[name]}
    return {"help": _FLAG_HELP[name], "metavar": "VALUE"}


def _setting_flag(setting: Setting, top_level: bool) -> dict[str, Any]:
    """The add_argument options of a setting's flag, from its row of the table."""
    if top_level and setting.kind == "bool":
        return {"action": "store_true", "help": setting.help}
    kind = _FLAG_TYPES.get(setting.kind) if top_level else None
    options: dict[str, Any] = {"help": setting.help, "metavar": "VALUE"}
    if kind is not None:
        options |= {"type": kind, "metavar": _METAVARS[kind]}
    return options


def _launch_groups(argv: Sequence[str]) -> list[tuple[str, str, bool, list[Any]]]:
    """(title, description, shown, flags) of each help group: the command's own flags as
    names, the table's as (Setting, top_level)."""
    from accel_settings import TABLE  # only when launch is parsed: `accel --help` needs none

    groups: dict[str, tuple[str, bool, list[Any]]] = {
        title: (description, True, list(names)) for title, description, names in _GROUPS
    }
    for section in TABLE:
        shown = section.shown_with is None or any(
            a in (f"--{section.shown_with}", f"--{section.shown_with.replace('_', '-')}")
            for a in argv
        )
        for setting in section.settings:
            if setting.key is None or not setting.flag:
                continue
            title = setting.group or section.title
            entry = groups.setdefault(title, (section.description, shown, []))
            entry[2].append((setting, section.name == ""))
    return [(title, d, shown, flags) for title, (d, shown, flags) in groups.items()]


def _add_launch(commands: Any, argv: Sequence[str]) -> None:
    parser = commands.add_parser(
        "launch",
        help="run a script on every process of the run",
        usage="%(prog)s [flags] script [script_args ...]",
        description="Run a script on every process of the run through torch.distributed.run. "
        "accel translates its flags and config file (accel's or Accelerate's YAML) into "
        "torchrun's arguments and `ACCEL_*` variables for the workers; torchrun's elastic agent "
        "does the spawning, restarts and rendezvous. Each flag may also be spelled with "
        "hyphens (--num-processes).",
        formatter_class=_HelpFormatter,
    )
    _add_flag(
        parser, "config_file", default=None, metavar="FILE",
        help="YAML config (accel's or Accelerate's)",
    )  # fmt: skip
    parser.add_argument("-m", "--module", action="store_true", help="run script as a module")
    if argv and "launch" not in argv:
        return  # another command (or `accel --help`): launch's flags would only cost time
    _add_setting_flags(parser, argv)
    add_refused(parser)
    parser.add_argument("script", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    # Every flag of accel launch, in each spelling, for the launcher's warning about one of its
    # flags typed after the script (accel.cli takes it from here: it imports nothing of ours).
    parser.set_defaults(launcher_flags=frozenset(f for f in _options(parser) if f[:2] == "--"))


def _add_setting_flags(parser: Any, argv: Sequence[str], skip: tuple[str, ...] = ()) -> None:
    """Add `accel launch`'s flags for the settings table (the layout: processes, mesh sizes,
    FSDP, DeepSpeed, precision) to `parser`, but the command's own flags named in `skip`;
    `accel estimate-memory` takes the same."""
    for title, description, shown, flags in _launch_groups(argv):
        flags = [f for f in flags if f not in skip]
        # As `accelerate launch --help`: the FSDP (DeepSpeed) flags are listed once --use_fsdp
        # (--use_deepspeed) is given.
        group = parser.add_argument_group(title, description) if shown else parser
        for flag in flags:
            if isinstance(flag, str):
                names, options = [(flag, _own_flag(flag))], {}
            else:
                setting, top_level = flag
                names = [(setting.key, _setting_flag(setting, top_level))]
                # Another name of the setting (--cpu, --tp_size) is its own flag, typed even in a
                # section, so an error names the flag that was typed; accel launch merges them.
                for alias in setting.flags:
                    options = _setting_flag(setting, True) | {"help": f"same as --{setting.key}"}
                    names.append((alias, options))
            for name, options in names:
                if not shown:
                    options["help"] = argparse.SUPPRESS
                _add_flag(group, name, default=None, **options)


def _add_config(commands: Any) -> None:
    config = commands.add_parser(
        "config",
        help="write a launch config (interactive, or --default)",
        description="Write a YAML config that `accel launch` reads. Questions are plain "
        "prompts, so answers can be piped in; an empty answer takes the default shown, and an "
        "answer that is not allowed is asked again.",
    )
    _add_flag(config, "config_file", default=None, help="where to write (default: see --show)")
    config.add_argument("--default", action="store_true", help="write defaults, ask nothing")
    config.add_argument("--force", action="store_true", help="overwrite an existing config file")
    config.add_argument(
        "--show", action="store_true", help="print the config `accel launch` uses, and its file"
    )


def _add_estimate(commands: Any, argv: Sequence[str]) -> None:
    estimate = commands.add_parser(
        "estimate-memory",
        help="estimate each rank's memory for a layout, on this CPU",
        usage="%(prog)s [layout flags] model [--batch SHAPE] [--json]",
        description="With --batch: build the model on fake tensors (no memory), wrap it as "
        "`accel launch` with the same flags or config file would (processes, mesh sizes, FSDP, "
        "precision, activation checkpointing), run a training step in a fake world of that "
        "size, and print each distinct rank's parameters, gradients, optimizer "
        "state, activations, communication buffers and peak. Without --batch: the model's "
        "size per dtype and Adam's weights + gradients + moments, as Accelerate estimates it.",
        formatter_class=_HelpFormatter,
    )
    estimate.add_argument(
        "model",
        help="'package.module:callable' returning an nn.Module (imported as `python -m` would, "
        "the current folder first), or a Hugging Face config.json or its folder (needs "
        "transformers; nothing is downloaded)",
    )
    own = (
        ("batch", "one rank's batch: token ids of this shape (4x2048), or "
         "'package.module:callable' returning it"),
        ("optimizer", "adamw (default), adam, sgd (no state), or 'package.module:callable' "
         "making it from the parameters"),
        ("loss", "'package.module:callable' taking (output, batch); default: the model's own "
         ".loss, else token cross entropy"),
        ("tp_plan", "'package.module:name' of wrap_model's tp_plan (default: auto, a Hugging "
         "Face model's own)"),
        ("microbatches", "with a pp size > 1: microbatches a step splits the batch into "
         "(default: one per stage)"),
        ("pp_schedule", "with a pp size > 1: pipeline_stages' schedule (1f1b, the default; "
         "gpipe, interleaved_1f1b, zbv, ...)"),
    )  # fmt: skip
    for name, text in own:
        _add_flag(estimate, name, default=None, metavar="VALUE", help=text)
    estimate.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda",
        help="the device type the run trains on (cuda rounds to the allocator's 512 B blocks)",
    )  # fmt: skip
    estimate.add_argument("--json", action="store_true", help="print the estimate as JSON")
    _add_flag(
        estimate, "config_file", default=None, metavar="FILE",
        help="YAML config (accel's or Accelerate's), as accel launch reads it",
    )  # fmt: skip
    if argv and "estimate-memory" not in argv:
        return
    _add_setting_flags(estimate, argv, skip=("tee", "log_dir", "same_network"))


def _add_others(commands: Any, argv: Sequence[str]) -> None:
    commands.add_parser(
        "env",
        help="print versions, devices and config for bug reports",
        description="Print accel, torch and Python versions, devices, memory, the config in "
        "force and the ACCEL_* variables set, as Markdown to paste into a bug report.",
    )
    selftest = commands.add_parser(
        "test",
        help="check collectives, a DDP step and a checkpoint round trip on the configured world",
        description="Launch a short self-check on every process of the configured world (the "
        "config in force, or --config_file, and --num_processes): a gather and a reduce, one "
        "DDP step against the full-batch step, a safetensors round trip. Exits 1 on failure.",
    )
    _add_flag(selftest, "config_file", default=None, help="YAML config (default: the one in force)")
    _add_flag(selftest, "num_processes", type=int, default=None, help="override the process count")
    _add_estimate(commands, argv)
    merge = commands.add_parser(
        "merge-weights",
        help="merge a sharded (DCP) checkpoint into Hugging Face safetensors files",
        description="Read the model of a save_state checkpoint of a sharded model (FSDP2, "
        "tensor parallel), or a DCP folder, and write model.safetensors (or shards and an "
        "index) with an accel manifest, in one process, one tensor in memory at a time.",
    )
    merge.add_argument("src", help="a save_state directory (or its dcp/ folder), or its URL")
    merge.add_argument("dst", help="the folder (or URL) to write the safetensors files into")
    _add_flag(merge, "model", default=None, help="the name the model was saved under")
    _add_flag(merge, "max_shard_size", default="5GB", help="most bytes per file (default 5GB)")
    _add_flag(
        merge, "trust_pickle", action="store_true",
        help="read a DeepSpeed ZeRO checkpoint (torch.save pickles: only one you trust)",
    )  # fmt: skip


class _Version(argparse.Action):
    """`accel --version`: the version written in accel/_version.py, read without importing
    accel (and torch), and only when asked."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        spec = importlib.util.find_spec("accel")  # the package's folder; nothing imported
        if spec is None or not spec.submodule_search_locations:
            parser.exit(1, "accel: the accel package is not installed beside accel_cli.\n")
        folder = next(iter(spec.submodule_search_locations))
        tree = ast.parse(Path(folder, "_version.py").read_text())
        version = next(
            str(node.value.value)
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and any(getattr(t, "id", None) == "__version__" for t in node.targets)
        )  # fmt: skip
        print(f"accel {version}")
        parser.exit()


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser of the `accel` command; `argv` decides which optional help groups show."""
    parser = Parser(
        prog="accel",
        description="Launch and inspect accel training runs (built on torch.distributed.run).",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="print accel's version")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_config(commands)
    _add_launch(commands, argv)
    _add_others(commands, argv)
    return parser


def answer_help_early() -> None:
    """Answer `python -m accel ... --help` (or `--version`) before the `accel` package imports
    torch; any other command line returns here and runs as usual.

    Python imports a package before running its `__main__`, and `accel/__init__.py` imports
    torch (seconds); so the package calls this first while Python is locating the module of
    `-m` (`sys.argv[0]` is then "-m"). A help or version request exits in argparse, as under
    the `accel` command; a line that parses (`launch train.py --help` is the script's flag)
    returns, to be run by `accel.__main__` once the package is imported.
    """
    line = sys.orig_argv
    start = line.index("-m") + 1 if "-m" in line else len(line)
    if line[start : start + 1] != ["accel"]:
        return  # another module is being located (its package imports accel)
    argv = line[start + 1 :]
    if {"-h", "--help", "--version"} & set(argv):
        build_parser(argv).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `accel` command line and return its exit code."""
    args = build_parser(sys.argv[1:] if argv is None else argv).parse_args(argv)
    from accel.cli import run  # imports torch: only for a command line that parsed

    try:
        code = run(args)
        sys.stdout.flush()  # a reader gone early fails here, not at the interpreter's exit
    except BrokenPipeError:
        # `accel env | head`: the reader stopped reading, which is no error of the command's.
        # End quietly, as Unix tools do (killed by SIGPIPE: 128 + 13); what is still buffered
        # goes nowhere, so the interpreter's own flush at exit has nothing to complain about.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return code
