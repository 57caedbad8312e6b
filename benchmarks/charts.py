"""Draw the benchmark tables of docs/benchmarks.md as charts (PNGs in docs/charts/).

    .venv/bin/python benchmarks/charts.py           # rewrite every chart from the tables
    .venv/bin/python benchmarks/charts.py --check   # only check that every table is found

The figures are the recorded ones: each chart reads its table from docs/benchmarks.md, so a
new measurement written there is one command away from its picture. Needs matplotlib (the
`dev` extra); nothing here runs a benchmark.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
OUT = ROOT / "docs" / "charts"


@dataclass(frozen=True, slots=True, kw_only=True)
class Chart:
    name: str  # the PNG's file name, without .png
    section: str  # the heading the table follows (the first table after it, or `index`)
    columns: tuple[str, ...]  # the numeric columns drawn, one bar per row and column
    title: str
    unit: str
    index: int = 0  # which table after the heading
    target: float | None = None  # a vertical line: the target, or 1.0 for a ratio


CHARTS = (
    Chart(name="step", section="## Training step", columns=("median us/step",),
          title="Training step, 1 process: accel against the loop by hand", unit="us per step"),
    Chart(name="parallel", section="## N-D parallel training step",
          columns=("best accel / best hand", "median of round ratios"),
          title="N-D step, 4 ranks: accel / hand-wired (dashed: the 1.02x target)",
          unit="ratio (lower is faster)", target=1.02),
    Chart(name="launch", section="## Launch", columns=("wall (s)", "CPU (s)"),
          title="Launching 2 processes: accel launch against torchrun", unit="seconds"),
    Chart(name="loader", section="## Data loading",
          columns=("DataLoader (ms/epoch)", "shard_loader (ms/epoch)"),
          title="One epoch: shard_loader against a plain DataLoader, by workers", unit="ms"),
    Chart(name="big_model", section="## Big models", columns=("median ms",),
          title="Load + first forward of 269 MB: accel against by hand", unit="ms"),
    Chart(name="sharded_load_time", section="## Sharded I/O", index=1,
          columns=("best s", "median s"),
          title="Sharded load and save, 4 ranks, tmpfs: accel, torch DCP, Accelerate",
          unit="seconds"),
    Chart(name="sharded_load_memory", section="## Sharded I/O", index=1,
          columns=("median peak MiB/rank",),
          title="Peak memory growth per rank, 4 ranks (each rank's 1/N: 128 MiB)",
          unit="MiB per rank"),
)  # fmt: skip


def table(text: str, chart: Chart) -> tuple[list[str], dict[str, list[float]]]:
    """The row labels and the chart's numeric columns of its table in `text`."""
    start = text.index(f"\n{chart.section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end > 0 else len(text)]
    tables = re.findall(r"((?:^\|.*\|\n)+)", body, re.M)
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in
            tables[chart.index].splitlines() if not set(line) <= set("|-: ")]  # fmt: skip
    header, rows = rows[0], rows[1:]
    labels = [row[0].strip("`") for row in rows]
    values = {c: [float(re.sub(r"[^\d.]", "", row[header.index(c)])) for row in rows]
              for c in chart.columns}  # fmt: skip
    return labels, values


def draw(chart: Chart, labels: list[str], values: dict[str, list[float]], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no window, no global figure state

    fig = Figure(figsize=(7, 0.45 * len(labels) * len(values) + 1.4), layout="constrained")
    ax = fig.add_subplot()
    height = 0.8 / len(values)
    for i, (column, numbers) in enumerate(values.items()):
        ys = [y + (i - (len(values) - 1) / 2) * height for y in range(len(labels))]
        bars = ax.barh(ys, numbers, height=height, label=column)
        ax.bar_label(bars, fmt="%g", padding=2, fontsize=8)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    if chart.target is not None:
        ax.axvline(chart.target, color="grey", linestyle="--", linewidth=1)
        low = min(min(v) for v in values.values())
        ax.set_xlim(min(low, 1.0) - 0.02, max(chart.target, *map(max, values.values())) + 0.02)
    ax.set(title=chart.title, xlabel=chart.unit)
    ax.title.set_fontsize(10)
    if len(values) > 1:
        ax.legend(fontsize=8, loc="lower right")
    ax.margins(x=0.12)
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="parse the tables, draw nothing")
    args = parser.parse_args()
    text = DOC.read_text()
    OUT.mkdir(exist_ok=True)
    for chart in CHARTS:
        labels, values = table(text, chart)
        if not args.check:
            draw(chart, labels, values, OUT / f"{chart.name}.png")
        print(f"{chart.name}: {len(labels)} rows, {', '.join(values)}")


if __name__ == "__main__":
    main()
