"""Every ```python block in docs/ and README.md runs, and every relative link resolves.

The blocks of one file run in one subprocess (so torch is imported once per file), each in a
fresh namespace and in a temporary working directory; a failure names the file and line.
A python block followed by a ```` ```text output ```` block must print exactly that text: a
documented output is what the code prints today. Other shown outputs are marked illustrative.
"""

from __future__ import annotations

import doctest
import inspect
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.S | re.M)

# Runs each block, records what it printed (also passed through), writes them to argv[3].
RUNNER = """
import contextlib, io, json, sys, traceback
blocks, printed = json.load(open(sys.argv[1])), []
for line, code in blocks:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{sys.argv[2]}:{line}", "exec"), {"__name__": "__docs__"})
    except BaseException:
        print(f"block at {sys.argv[2]}:{line} failed:\\n{traceback.format_exc()}", file=sys.stderr)
        sys.exit(1)
    printed.append(out.getvalue())
    sys.stdout.write(out.getvalue())
json.dump(printed, open(sys.argv[3], "w"))
"""


# The same, each block inside accel.testing.device_canary(): a block that trains a model on
# ctx.device must not mix in a tensor made on the host (issue 34).
CANARY_RUNNER = """
import json, sys, traceback
from accel.testing import device_canary
for line, code in json.load(open(sys.argv[1])):
    try:
        with device_canary():
            exec(compile(code, f"{sys.argv[2]}:{line}", "exec"), {"__name__": "__docs__"})
    except BaseException:
        print(f"block at {sys.argv[2]}:{line} failed under the device canary:\\n"
              f"{traceback.format_exc()}", file=sys.stderr)
        sys.exit(1)
"""
TRAINS = re.compile(r"backward\(|optimizer_step\(|\.step\(\)")


def training_blocks(page: Path) -> list[tuple[int, str]]:
    return [(line, code) for line, code in python_blocks(page) if TRAINS.search(code)]


def python_blocks(page: Path) -> list[tuple[int, str]]:
    return [(line, code) for line, code, _ in _blocks_and_outputs(page)]


def _blocks_and_outputs(page: Path) -> list[tuple[int, str, str | None]]:
    """Each python block (first line, code) and the ```text output block right after it."""
    text = page.read_text()
    fences = list(FENCE.finditer(text))
    found = []
    for m, after in zip(fences, [*fences[1:], None][: len(fences)], strict=True):  # none: []
        if m.group(1) != "python":
            continue
        follows = after is not None and not text[m.end() : after.start()].strip()
        output = after is not None and follows and after.group(1, 2) == ("text", " output")
        found.append(
            (text.count("\n", 0, m.start()) + 2, m.group(3), after.group(3) if output else None)
        )
    return found


def test_the_docs_have_code_to_run() -> None:
    assert sum(len(python_blocks(p)) for p in PAGES) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if training_blocks(p)], ids=lambda p: p.name)
def test_training_blocks_run_under_the_device_canary(page: Path, tmp_path: Path) -> None:
    blocks = tmp_path / "blocks.json"
    blocks.write_text(json.dumps(training_blocks(page)))
    run = subprocess.run(
        [sys.executable, "-c", CANARY_RUNNER, str(blocks), str(page.relative_to(ROOT))],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]


MAIN_GUARD = 'if __name__ == "__main__":'
SCRIPTS = [(page, line, code) for page in PAGES for line, code in python_blocks(page)
           if MAIN_GUARD in code]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("page", "line", "code"), SCRIPTS, ids=[f"{page.name}:{line}" for page, line, _ in SCRIPTS]
)
def test_blocks_with_a_main_guard_run_as_scripts(
    page: Path, line: int, code: str, tmp_path: Path
) -> None:
    # The block runner above executes blocks with another __name__, so what such a block keeps
    # under its guard (run_world's spawned ranks need one) runs here, as `python block.py`.
    script = tmp_path / "block.py"
    script.write_text(code)
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert run.returncode == 0, f"{page.name}:{line}\n{run.stderr[-4000:]}"


def test_the_docs_have_a_script_block() -> None:
    assert SCRIPTS, "no docs block has a main guard; docs/testing.md's NCCL-rule example had"


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    blocks, printed = tmp_path / "blocks.json", tmp_path / "printed.json"
    blocks.write_text(json.dumps(python_blocks(page)))
    run = subprocess.run(
        [sys.executable, "-c", RUNNER, str(blocks), str(page.relative_to(ROOT)), str(printed)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    outputs = json.loads(printed.read_text())
    for (line, _, expected), output in zip(_blocks_and_outputs(page), outputs, strict=True):
        if expected is not None:
            assert output == expected, (
                f"{page.name}:{line} prints\n{output}\nnot the documented\n{expected}"
            )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    text = FENCE.sub("", page.read_text())
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


@pytest.mark.parametrize("page", [*PAGES, ROOT / "CHANGELOG.md"], ids=lambda p: p.name)
def test_every_page_a_page_names_is_in_the_repository(page: Path) -> None:
    """The docs stand on their own: a page named in the text (not only in a link) is one a
    reader of the repository can open (issue 44: docs/benchmarks.md cited a DESIGN.md the
    repository does not have)."""
    for name in re.findall(r"\b[A-Za-z][\w./-]*\.md\b", page.read_text()):
        found = [p for p in (ROOT / name, ROOT / "docs" / name, page.parent / name) if p.exists()]
        assert found, f"{page.name} names {name}, which is not in the repository"


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "docs" / "testing.md"], ids=str)
def test_the_fast_suites_count_says_when_and_how_it_was_counted(page: Path) -> None:
    """Issue 44 item 10: both pages said `make test-fast` runs 757 tests when it ran 1,320, a
    count that every new test makes wrong; a count is given with its date and its command."""
    text = " ".join(page.read_text().split())
    counts = re.findall(r"([\d,]+) tests on (\d{4}-\d\d-\d\d) \(`([^`]+)` counts them\)", text)
    assert counts, f"{page.name}: no count of the fast suite with its date and command"
    assert all(command == 'python -m pytest -m "not slow" --collect-only -q'
               for _, _, command in counts)  # fmt: skip


def _gen_api() -> Any:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gen_api
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return gen_api


def test_api_reference_is_up_to_date() -> None:
    assert (ROOT / "docs" / "api.md").read_text() == _gen_api().render(), (
        "docs/api.md is out of date: run `.venv/bin/python tools/gen_api.py`"
    )


def _api_examples() -> list[tuple[str, str]]:
    return [
        (name, inspect.getdoc(obj) or "")
        for entries in _gen_api()._entries().values()
        for name, obj in entries
        if ">>>" in (inspect.getdoc(obj) or "")
    ]


@pytest.mark.parametrize(("name", "doc"), _api_examples(), ids=lambda v: v if "\n" not in v else "")
def test_api_example_runs_as_pasted(name: str, doc: str) -> None:
    # A fresh namespace, as a new interpreter has: the example brings every import it needs
    # (--doctest-modules runs the same examples with their module's names already in scope).
    test = doctest.DocTestParser().get_doctest(doc, {}, name, None, 0)
    out = io.StringIO()
    result = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS).run(test, out=out.write)
    assert result.failed == 0, out.getvalue()


# Accelerate 1.x: the public methods and properties of `Accelerator`, and its big-model utilities.
ACCELERATOR_NAMES = """
prepare prepare_model prepare_optimizer prepare_scheduler prepare_data_loader backward accumulate
no_sync trigger_sync_in_backward autocast clip_grad_norm_ clip_grad_value_ gather
gather_for_metrics reduce pad_across_processes unwrap_model wait_for_everyone main_process_first
local_main_process_first on_main_process on_local_main_process on_process on_local_process
on_last_process split_between_processes save save_model save_state load_state
register_for_checkpointing register_save_state_pre_hook register_load_state_pre_hook
init_trackers log get_tracker end_training set_trigger check_trigger skip_first_batches
free_memory clear print profile join_uneven_inputs get_state_dict verify_device_map
lomo_backward maybe_context_parallel device process_index local_process_index num_processes
is_main_process is_local_main_process is_last_process distributed_type mixed_precision
gradient_accumulation_steps sync_gradients use_distributed optimizer_step_was_skipped state
project_dir logging_dir save_iteration project_configuration split_batches even_batches
dispatch_batches use_seedable_sampler non_blocking use_stateful_dataloader trackers step use_fp16
is_fsdp2 torch_device_mesh multi_device should_save_model native_amp scaler fp8_backend
init_empty_weights init_on_device infer_auto_device_map get_balanced_memory get_max_memory
compute_module_sizes find_tied_parameters load_checkpoint_and_dispatch load_checkpoint_in_model
dispatch_model cpu_offload cpu_offload_with_hook disk_offload remove_hook_from_module
remove_hook_from_submodules set_module_tensor_to_device
pipeline_parallel_rank tensor_parallel_rank data_parallel_rank data_parallel_shard_rank
context_parallel_rank is_composable_parallelism_enabled
""".split()  # noqa: SIM905  (a word list reads better than 100 quoted strings)


def test_migration_table_covers_every_accelerator_name() -> None:
    text = (ROOT / "docs" / "migration.md").read_text()
    first_column = set(re.findall(r"^\| `([\w.]+)`", text, re.M))
    missing = [name for name in ACCELERATOR_NAMES if name not in first_column]
    assert not missing, f"docs/migration.md has no row for {missing}"


def test_every_accel_name_the_docs_mention_exists() -> None:
    import accel
    import accel.testing

    for page in PAGES:
        for name in set(re.findall(r"\baccel\.(\w+)", page.read_text())):
            if name in {"testing", "cli"}:
                continue
            assert hasattr(accel, name), f"{page.name} mentions accel.{name}, which does not exist"


def test_every_benchmark_chart_is_drawn_from_a_table_and_linked() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import charts
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for chart in charts.CHARTS:
        labels, values = charts.table(text, chart)
        assert len(labels) > 1 and all(len(v) == len(labels) for v in values.values()), chart.name
        assert f"](charts/{chart.name}.png)" in text, f"benchmarks.md does not show {chart.name}"
        assert (ROOT / "docs" / "charts" / f"{chart.name}.png").is_file(), chart.name
