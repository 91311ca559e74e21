"""How benchmark results leave the process: a text table, a JSON file and a bar chart."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def format_value(value: float | None, spec: str) -> str:
    """A table cell: '-' stands for a value a failed or unavailable row does not have."""
    return "-" if value is None else format(value, spec)


def row_label(row: dict, key: str) -> str:
    """A row's name cell (row[key]), with its status in parentheses unless it is "ok"."""
    return row[key] if row["status"] == "ok" else f"{row[key]} ({row['status']})"


def format_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(columns, *rows, strict=True)]
    lines = [columns, ["-" * width for width in widths], *rows]
    return "\n".join(
        "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def format_markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The same table in GitHub Markdown, for results pasted into the docs."""
    lines = [columns, ["---"] * len(columns), *rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


def problem_notes(rows: Sequence[dict[str, Any]], label_keys: Sequence[str]) -> str:
    """One line per row that did not run: its label, its status and why ('reason' or 'error')."""
    return "\n".join(
        f"  {' / '.join(str(row[key]) for key in label_keys)}: {row['status']}: {row.get('error') or row.get('reason')}"
        for row in rows
        if row["status"] != "ok"
    )


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


@dataclass
class BarPanel:
    """One subplot of grouped bars: for each group, one bar per series."""

    title: str
    value_label: str  # the axis the bars grow along
    groups: list[str]
    series: dict[str, list[float | None]]  # None: no bar (the row failed or was unavailable)
    reference_lines: tuple[tuple[str, float], ...] = ()  # e.g. (("copy ceiling", 2.99),)
    value_format: str = ".3g"
    horizontal: bool = False  # groups down the side: for many groups or long group names


def grouped_values(
    rows: Sequence[dict[str, Any]], group_key: str, series_key: str, value_key: str
) -> tuple[list[str], dict[str, list[float | None]]]:
    """Result rows as chart groups and series, in first-seen order; missing values become None."""
    groups = list(dict.fromkeys(row[group_key] for row in rows))
    series: dict[str, list[float | None]] = {}
    for row in rows:
        values = series.setdefault(row[series_key], [None] * len(groups))
        values[groups.index(row[group_key])] = row.get(value_key)
    return groups, series


def _pyplot() -> Any | None:
    """matplotlib.pyplot drawing off-screen; None (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on GPU machines and CI
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no chart was drawn (pip install 'barqtrain[bench]').")
        return None
    return plt


def save_bar_chart(path: Path, title: str, panels: Sequence[BarPanel]) -> Path | None:
    """Write the panels side by side as a PNG; None (with a note) when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None

    horizontal = all(panel.horizontal for panel in panels)
    # Horizontal panels share their groups down the left edge: the names are written once.
    share_groups = horizontal and all(panel.groups == panels[0].groups for panel in panels)
    figure, axes = plt.subplots(
        1, len(panels), figsize=_figure_size(panels, horizontal), squeeze=False, sharey=share_groups
    )
    for axis, panel in zip(axes[0], panels, strict=True):
        _draw_panel(axis, panel)
    if horizontal:  # one legend below all the panels: tall panels have no free corner
        legend = {}
        for axis in axes[0]:
            handles, labels = axis.get_legend_handles_labels()
            legend.update(zip(labels, handles, strict=True))
        if legend:
            figure.legend(
                legend.values(), legend.keys(), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncols=4, fontsize=8
            )
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")  # "tight": a legend below the axes stays in
    plt.close(figure)
    return path


def _figure_size(panels: Sequence[BarPanel], horizontal: bool) -> tuple[float, float]:
    if not horizontal:
        return 6.5 * len(panels), 4.8
    bars = max(len(panel.groups) * max(1, len(panel.series)) for panel in panels)
    return 5.5 * len(panels) + 2.5, 1.6 + 0.17 * bars  # 2.5 in for the group names


def _draw_panel(axis: Any, panel: BarPanel) -> None:
    draw_bars = axis.barh if panel.horizontal else axis.bar
    bar_width = 0.8 / max(1, len(panel.series))
    for index, (name, values) in enumerate(panel.series.items()):
        offset = (index - (len(panel.series) - 1) / 2) * bar_width
        drawn = [(group + offset, value) for group, value in enumerate(values) if value is not None]
        if drawn:
            positions, lengths = zip(*drawn, strict=True)
            bars = draw_bars(positions, lengths, bar_width, label=name)
            axis.bar_label(bars, fmt=f"{{:{panel.value_format}}}", fontsize=7, padding=1)
    draw_line = axis.axvline if panel.horizontal else axis.axhline
    for (label, value), style in zip(panel.reference_lines, ("--", ":", "-."), strict=False):
        draw_line(value, color="black", linestyle=style, linewidth=1, label=label)
    axis.set_title(panel.title)
    if panel.horizontal:
        axis.set_yticks(range(len(panel.groups)), panel.groups, fontsize=8)
        axis.set_ylim(len(panel.groups) - 0.5, -0.5)  # the first group on top
        axis.set_xlabel(panel.value_label)
    else:
        axis.set_xticks(range(len(panel.groups)), panel.groups, fontsize=8)
        axis.set_xlim(-0.5, len(panel.groups) - 0.5)
        axis.set_ylabel(panel.value_label)
    handles, _ = axis.get_legend_handles_labels()
    if not handles:  # e.g. GPU memory on a CPU run, or every row failed
        axis.text(0.5, 0.5, "nothing measured", transform=axis.transAxes, ha="center", va="center")
    elif panel.horizontal:
        axis.set_xlim(right=axis.get_xlim()[1] * 1.12)  # room for the value labels
    else:
        axis.set_ylim(top=axis.get_ylim()[1] * 1.2)  # headroom for the legend above the bars
        axis.legend(fontsize=8, loc="upper center", ncols=len(handles))


def save_stacked_bar_chart(
    path: Path,
    title: str,
    value_label: str,
    bars: Sequence[str],
    segments: dict[str, Sequence[float]],
    colors: dict[str, str] | None = None,
) -> Path | None:
    """One horizontal bar per entry of `bars`, made of one segment per entry of `segments` (its
    values in the order of `bars`), each segment one colour across all bars, the first bar on top.
    Write it as a PNG; None (with a note) when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    figure, axis = plt.subplots(figsize=(10.0, 1.6 + 0.4 * len(bars)))
    positions = range(len(bars))
    left = [0.0] * len(bars)
    for name, values in segments.items():
        axis.barh(positions, values, 0.7, left=left, label=name, color=(colors or {}).get(name))
        left = [start + value for start, value in zip(left, values, strict=True)]
    for position, total in zip(positions, left, strict=True):
        axis.text(total, position, f" {total:.3g}", va="center", fontsize=8)
    axis.set_xlim(0.0, (max(left, default=0.0) or 1.0) * 1.12)  # room for the totals
    axis.set_xlabel(value_label)
    axis.set_title(title)
    if bars:
        axis.set_yticks(list(positions), bars, fontsize=8)
        axis.set_ylim(len(bars) - 0.5, -0.5)
        handles, labels = axis.get_legend_handles_labels()
        figure.tight_layout()
        figure.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncols=5, fontsize=8)
    else:
        axis.set_yticks([])
        axis.text(0.5, 0.5, "nothing measured", transform=axis.transAxes, ha="center", va="center")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")  # "tight": the legend below the axes stays in
    plt.close(figure)
    return path
