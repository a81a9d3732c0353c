"""Plain inline SVG charts for the HTML report (html_report.py).

Why hand-written SVG and not a charting library: the report must open from a mail
attachment or a ticket with no server and no network, print on paper, and stay a few MB
for a 16,384-rank run. A JS library (Plotly ~3.5 MB, Vega ~1 MB minified) would have to
be inlined whole into every file, draws nothing when scripts are blocked (mail clients,
many ticket systems) and prints poorly; SVG is text the browser draws itself, scales to
any width (viewBox) and prints as vectors. The charts here are few and simple (lines, a
band, stacked bars, spans on an axis), so a few hundred lines cover them.

Every text that reaches the SVG passes through `esc` (html.escape): labels, rank names
and hosts come from the run's record, which is untrusted. Inputs are already bounded by
the caller (downsampled series, capped rank lists): nothing here grows with the run.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

W, H = 720, 260  # the viewBox; the SVG scales to the page's width
PAD_L, PAD_R, PAD_T, PAD_B = 56, 12, 14, 30
# Colour-blind-safe (Okabe-Ito) for series; the band is a light grey.
PALETTE = ("#d55e00", "#0072b2", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#f0e442",
           "#000000")
BAND = "#cfd8e3"
SEVERITY_COLOUR = {"critical": "#d55e00", "warning": "#e69f00", "info": "#56b4e9"}


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _num(v: float) -> str:
    return f"{v:.1f}"


def fmt(v: float | None, unit: str = "") -> str:
    """A figure for people: 3 significant digits, '-' for none."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    a = abs(v)
    text = f"{v:.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}"
    return f"{text}{unit}"


def _nice_max(v: float) -> float:
    if v <= 0 or not math.isfinite(v):
        return 1.0
    mag = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * mag:
            return m * mag
    return 10 * mag


@dataclass(frozen=True)
class Series:
    name: str
    xs: Sequence[float]
    ys: Sequence[float]


@dataclass(frozen=True)
class Span:
    """An episode on the x axis (steps), coloured by severity."""

    x0: float
    x1: float
    label: str
    severity: str


def _open(title: str, height: int = H) -> list[str]:
    return [f'<svg viewBox="0 0 {W} {height}" role="img" preserveAspectRatio="xMidYMid meet" '
            f'xmlns="http://www.w3.org/2000/svg" class="chart"><title>{esc(title)}</title>']


def _axes(out: list[str], x0: float, x1: float, ymax: float, xlabel: str, ylabel: str,
          height: int = H) -> None:
    bottom = height - PAD_B
    out.append(f'<line x1="{PAD_L}" y1="{bottom}" x2="{W - PAD_R}" y2="{bottom}" '
               'stroke="#555"/>')
    out.append(f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{bottom}" stroke="#555"/>')
    for i in range(5):
        v = ymax * i / 4
        y = bottom - (bottom - PAD_T) * i / 4
        out.append(f'<line x1="{PAD_L}" y1="{_num(y)}" x2="{W - PAD_R}" y2="{_num(y)}" '
                   'stroke="#eee"/>')
        out.append(f'<text x="{PAD_L - 4}" y="{_num(y + 4)}" text-anchor="end" '
                   f'font-size="11">{esc(fmt(v))}</text>')
    for i in range(5):
        v = x0 + (x1 - x0) * i / 4
        x = PAD_L + (W - PAD_L - PAD_R) * i / 4
        out.append(f'<text x="{_num(x)}" y="{bottom + 14}" text-anchor="middle" '
                   f'font-size="11">{esc(f"{v:.0f}")}</text>')
    out.append(f'<text x="{W - PAD_R}" y="{height - 2}" text-anchor="end" font-size="11">'
               f'{esc(xlabel)}</text>')
    out.append(f'<text x="4" y="{PAD_T - 2}" font-size="11">{esc(ylabel)}</text>')


def line_chart(title: str, series: Sequence[Series], band: tuple[Sequence[float],
               Sequence[float], Sequence[float]] | None = None, spans: Sequence[Span] = (),
               xlabel: str = "step", ylabel: str = "ms") -> str:
    """Lines over x, an optional (xs, low, high) band under them, episode spans behind."""
    xs_all = [x for s in series for x in s.xs] + (list(band[0]) if band else [])
    if not xs_all:
        return ""
    x0, x1 = min(xs_all), max(xs_all)
    x1 = x1 if x1 > x0 else x0 + 1
    ys_all = [y for s in series for y in s.ys if math.isfinite(y)]
    if band:
        ys_all += [y for y in band[2] if math.isfinite(y)]
    ymax = _nice_max(max(ys_all, default=1.0))
    bottom = H - PAD_B

    def px(x: float) -> float:
        return PAD_L + (W - PAD_L - PAD_R) * (x - x0) / (x1 - x0)

    def py(y: float) -> float:
        return bottom - (bottom - PAD_T) * min(max(y, 0.0), ymax) / ymax

    out = _open(title)
    for sp in spans:
        a, b = px(max(sp.x0, x0)), px(min(max(sp.x1, sp.x0), x1))
        colour = SEVERITY_COLOUR.get(sp.severity, "#999")
        out.append(f'<rect x="{_num(a)}" y="{PAD_T}" width="{_num(max(b - a, 1.5))}" '
                   f'height="{bottom - PAD_T}" fill="{colour}" fill-opacity="0.12">'
                   f'<title>{esc(sp.label)}</title></rect>')
    _axes(out, x0, x1, ymax, xlabel, ylabel)
    if band and band[0]:
        bx, lo, hi = band
        top = " ".join(f"{_num(px(x))},{_num(py(y))}" for x, y in zip(bx, hi, strict=True))
        low = " ".join(f"{_num(px(x))},{_num(py(y))}"
                       for x, y in zip(reversed(bx), reversed(lo), strict=True))
        out.append(f'<polygon points="{top} {low}" fill="{BAND}" stroke="none"/>')
    for i, s in enumerate(series):
        pts = " ".join(f"{_num(px(x))},{_num(py(y))}" for x, y in zip(s.xs, s.ys, strict=True)
                       if math.isfinite(y))
        colour = PALETTE[i % len(PALETTE)]
        out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" '
                   f'stroke-width="1.5"><title>{esc(s.name)}</title></polyline>')
    out.append("</svg>")
    return "".join(out)


def legend(names: Sequence[str], band_name: str | None = None) -> str:
    items = [f'<span class="key"><i style="background:{PALETTE[i % len(PALETTE)]}"></i>'
             f'{esc(n)}</span>' for i, n in enumerate(names)]
    if band_name:
        items.append(f'<span class="key"><i style="background:{BAND}"></i>{esc(band_name)}'
                     '</span>')
    return f'<p class="legend">{" ".join(items)}</p>'


def stacked_bars(title: str, rows: Sequence[tuple[str, Sequence[float]]],
                 parts: Sequence[str], unit: str = "ms") -> str:
    """One horizontal bar per row, split into `parts` (a rank's phases)."""
    if not rows:
        return ""
    bar, gap, left = 16, 6, 90
    height = PAD_T + len(rows) * (bar + gap) + 24
    vmax = _nice_max(max((sum(v for v in vals if v > 0) for _, vals in rows), default=1.0))
    out = _open(title, height)
    span = W - left - PAD_R
    for r, (name, vals) in enumerate(rows):
        y = PAD_T + r * (bar + gap)
        out.append(f'<text x="{left - 6}" y="{y + bar - 4}" text-anchor="end" '
                   f'font-size="11">{esc(name)}</text>')
        x = float(left)
        for i, v in enumerate(vals):
            if v <= 0 or not math.isfinite(v):
                continue
            w = span * v / vmax
            out.append(f'<rect x="{_num(x)}" y="{y}" width="{_num(w)}" height="{bar}" '
                       f'fill="{PALETTE[i % len(PALETTE)]}"><title>{esc(name)} '
                       f'{esc(parts[i])}: {esc(fmt(v, " " + unit))}</title></rect>')
            x += w
    y = PAD_T + len(rows) * (bar + gap) + 12
    out.append(f'<text x="{left}" y="{y}" font-size="11">0</text>'
               f'<text x="{W - PAD_R}" y="{y}" text-anchor="end" font-size="11">'
               f'{esc(fmt(vmax, " " + unit))}</text></svg>')
    return "".join(out)


def timeline(title: str, spans: Sequence[Span], x0: float, x1: float,
             xlabel: str = "step") -> str:
    """Episodes as bars on one step axis, one lane each (the timeline is short: the
    summary keeps a bounded list), labelled with their words."""
    if not spans:
        return ""
    lane, left = 20, 170  # labels in the left margin, bars right of it
    height = PAD_T + len(spans) * lane + 28
    x1 = x1 if x1 > x0 else x0 + 1
    out = _open(title, height)

    def px(x: float) -> float:
        return left + (W - left - PAD_R) * (min(max(x, x0), x1) - x0) / (x1 - x0)

    for i, sp in enumerate(spans):
        y = PAD_T + i * lane
        a, b = px(sp.x0), px(max(sp.x1, sp.x0))
        colour = SEVERITY_COLOUR.get(sp.severity, "#999")
        out.append(f'<rect x="{_num(a)}" y="{y}" width="{_num(max(b - a, 2))}" '
                   f'height="{lane - 6}" fill="{colour}"><title>{esc(sp.label)}</title></rect>')
        out.append(f'<text x="{left - 4}" y="{y + lane - 9}" font-size="10" '
                   f'text-anchor="end">{esc(sp.label.split(" steps ")[0][:28])}</text>')
    bottom = PAD_T + len(spans) * lane + 4
    out.append(f'<line x1="{left}" y1="{bottom}" x2="{W - PAD_R}" y2="{bottom}" '
               'stroke="#555"/>')
    for i in range(5):
        v = x0 + (x1 - x0) * i / 4
        out.append(f'<text x="{_num(px(v))}" y="{bottom + 14}" text-anchor="middle" '
                   f'font-size="11">{esc(f"{v:.0f}")}</text>')
    out.append(f'<text x="{W - PAD_R}" y="{height - 2}" text-anchor="end" font-size="11">'
               f'{esc(xlabel)}</text></svg>')
    return "".join(out)
