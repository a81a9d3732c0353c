"""A rank beside the median rank, phase by phase, with a sparkline of its recent steps.

Used twice: for the worst rank (the seed guide's "worst vs median timing") and for
the pinned rank.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from traceml_tui.viewmodel import VIEW_PHASES, CostView, RankDetail

from .cells import ms, sparkline

SPARK_WIDTH = 40
STACK_LINES = 8  # the innermost frames of a stuck rank's stack


class RankPanel(Static):
    def __init__(self, title: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.title = title

    def show(self, detail: RankDetail | None, title: str | None = None,
             cost: CostView | None = None) -> None:
        """`cost`: the what-if of the problem this rank is the culprit of (worst panel)."""
        self.border_title = title or self.title
        if detail is None:
            self.update(Text("no rank to show yet", style="dim"))
            return
        table = Table(box=None, padding=(0, 1), expand=False, show_edge=False)
        table.add_column("", style="bold")
        table.add_column(f"rank {detail.rank}", justify="right")
        table.add_column("median", justify="right")
        table.add_column("gap ms", justify="right")
        table.add_column("% of step", justify="right")
        rows = [("step", detail.step_ms, detail.median_step_ms)]
        rows += list(zip(VIEW_PHASES, detail.phase_ms, detail.median_phase_ms, strict=True))
        for name, mine, med in rows:
            gap = None if mine is None or med is None else mine - med
            step = detail.median_step_ms
            pct = "" if gap is None or not step else f"{100 * gap / step:+.0f}%"
            style = "bold" if gap is not None and detail.median_step_ms and (
                gap / detail.median_step_ms >= 0.1) else ""
            table.add_row(name, ms(mine), ms(med), Text(ms(gap), style=style), pct)
        spark = sparkline(detail.recent_step_ms, SPARK_WIDTH)
        caption = Text(f"{detail.host}  {detail.status}\n", style="dim")
        if spark:
            caption.append(f"recent steps {spark}")
        if cost is not None:
            caption.append(f"\nwithout it: {cost.step_ms:.1f} ms/step, {cost.speedup:.2f}x "
                           f"faster. {cost.reasoning}", style="bold")
            if cost.weak:
                caption.append(f"\nweak estimate: {cost.weak}.", style="italic")
        if detail.cpu:
            caption.append("\n" + detail.cpu, style="dim")
        if detail.gpu:
            caption.append("\n" + detail.gpu, style="dim")
        for line in detail.memory:
            grows = "memory grows" in line
            caption.append("\n" + line, style="bold" if grows else "dim")
        for note in detail.notes:
            caption.append("\n" + note, style="italic")
        if detail.error:
            caption.append("\n" + detail.error.strip().splitlines()[-1], style="bold red")
        if detail.stack:
            lines = detail.stack.rstrip().splitlines()[-STACK_LINES:]
            caption.append("\nstack (innermost last):\n", style="bold")
            caption.append("\n".join(line.rstrip() for line in lines), style="yellow")
        from rich.console import Group

        self.update(Group(table, caption))
