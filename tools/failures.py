"""Print each failed test of a pytest JUnit XML report: its name, then the last lines of its
error and of what it printed, so a failed run is read at its end rather than searched.

    python tools/failures.py report.xml [--lines 30]

pytest writes the report with `--junitxml=report.xml`; with `-o junit_logging=all -o
junit_log_passing_tests=false` it keeps the output of the failed tests only, shown here too.
Exits 0 when the report has no failure, 1 when it lists some, 2 when there is no report.
Stdlib only: it runs in any Python.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_KINDS = ("failure", "error")
_HEADER = re.compile(r"^-+ Captured \w+ -+$")  # pytest's line above each captured stream


@dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    """One failed test as the report has it."""

    nodeid: str  # as pytest names it: tests/x/test_y.py::test_z[param]
    kind: str  # "failure" (an assertion or exception in the test) or "error" (set-up/tear-down)
    message: str  # the report's one-line message
    text: str  # the traceback pytest reported
    stdout: str  # what the test printed, when the report kept it
    stderr: str


def nodeid(classname: str, name: str, root: Path) -> str:
    """pytest's node id from JUnit's dotted classname: the longest prefix that is a file under
    `root` is the module, the rest are classes (tests/x/test_y.py::TestC::test_z)."""
    parts = classname.split(".") if classname else []
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (root / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return "::".join([classname, name]) if classname else name


def read_failures(report: Path, root: Path) -> Iterator[Failure]:
    """Each failed or erroring test case of `report`, in the report's order."""
    for case in ET.parse(report).getroot().iter("testcase"):
        for kind in _KINDS:
            for found in case.findall(kind):
                yield Failure(
                    nodeid=nodeid(case.get("classname", ""), case.get("name", ""), root),
                    kind=kind,
                    message=found.get("message", "").strip(),
                    text=(found.text or "").strip(),
                    stdout=_captured(case.findtext("system-out")),
                    stderr=_captured(case.findtext("system-err")),
                )


def _captured(text: str | None) -> str:
    """A captured stream without pytest's headers."""
    lines = (text or "").splitlines()
    return "\n".join(line for line in lines if not _HEADER.match(line)).strip()


def tail(text: str, lines: int) -> str:
    kept = text.splitlines()[-lines:]
    return "\n".join(f"    {line}" for line in kept)


def describe(failures: list[Failure], lines: int) -> str:
    """The failed tests' names, then each one's last lines."""
    if not failures:
        return "no failed test in the report"
    out = [f"{len(failures)} failed test(s):"]
    out += [f"  {f.kind.upper()} {f.nodeid}" for f in failures]
    for f in failures:
        message = f.message.splitlines()[0] if f.message else ""
        out += ["", f"--- {f.kind.upper()} {f.nodeid}: {message}", tail(f.text, lines)]
        for stream, printed in (("stdout", f.stdout), ("stderr", f.stderr)):
            if printed:
                out += [f"  its {stream}, last lines:", tail(printed, lines)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="pytest's --junitxml file")
    parser.add_argument("--lines", type=int, default=30, help="last lines shown of each")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the tests' checkout")
    args = parser.parse_args(argv)
    if not args.report.is_file():
        print(f"failures: {args.report} does not exist: pytest wrote no report", file=sys.stderr)
        return 2
    failures = list(read_failures(args.report, args.root))
    print(describe(failures, args.lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
