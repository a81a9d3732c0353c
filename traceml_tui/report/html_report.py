"""`traceml report RUN_DIR`: one self-contained HTML file of a run, to hand on.

No server, no network, no script: inline CSS and inline SVG (svg_charts.py says why), so
it opens from a mail attachment or a ticket and prints. It reads the run's record through
the typed summary (model.load: final_summary.json, else the live snapshot of a run whose
collector died) and the bounded step log (step_series.py); a part that is missing is
named in the report, never a failure. Everything from the record is untrusted text and
is escaped (svg_charts.esc) wherever it lands. Size is bounded whatever the run: series
are downsampled to step_series.MAX_POINTS buckets, per-rank tables keep the
`MAX_RANK_ROWS` slowest ranks, episodes are the summary's (already bounded) list, exact.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from traceml_agent.vocab import STEP_LOG_DIR, WARMUP
from traceml_tui.runfolder import summary_model as model
from traceml_tui.runfolder.layout import RunFolder

from . import step_series
from .summary import render_text
from .svg_charts import Series, Span, esc, fmt, legend, line_chart, stacked_bars, timeline

MAX_RANK_ROWS = 32  # per-rank tables and bars: the slowest ranks (and the verdict's)
MAX_HANG_STACK_CHARS = 20_000  # one thread's stack as the summary kept it, cut beyond
MAX_HANG_RANKS = 8  # ranks whose hang stacks are shown (the culprits first)
# Section ids, in page order: tests and readers find each one by its id.
SECTIONS = ("verdict", "cost", "episodes", "steps", "phases", "memory", "collectives",
            "setup", "hang", "config", "text")


class ReportError(Exception):
    """A folder that cannot be reported: one line for the user."""


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;
max-width:980px;padding:12px;color:#1b1b1b}
h1{font-size:1.4em;margin:.2em 0}h2{font-size:1.15em;border-bottom:1px solid #ccc;
margin-top:1.6em}
.verdict{border-left:6px solid #999;padding:.4em .8em;background:#f6f6f6}
.critical{border-color:#d55e00}.warning{border-color:#e69f00}.info{border-color:#56b4e9}
.missing{background:#fff4e5;border:1px solid #e69f00;padding:.4em .8em}
table{border-collapse:collapse;font-size:12px;margin:.4em 0;display:block;overflow-x:auto}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:right;white-space:nowrap}
th{background:#f0f0f0}td.l,th.l{text-align:left}td.w{white-space:normal;text-align:left;
min-width:16em}
svg.chart{width:100%;height:auto;display:block;font-family:sans-serif}
.legend .key{margin-right:1em;white-space:nowrap}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px}
pre{white-space:pre-wrap;word-break:break-word;font-size:12px;background:#f7f7f7;
padding:.5em}
.muted{color:#666}
@media print{body{max-width:none}h2{break-after:avoid}svg.chart,table{break-inside:avoid}
details{display:block}details>summary{display:none}}
"""


def write_report(run_dir: Path, out: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Write the report (default RUN_DIR/report.html); returns its path and what it read."""
    page, facts = build(run_dir)
    out = out if out is not None else RunFolder(run_dir).report_html
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"cannot write {out}: {exc.strerror or exc}") from None
    return out, facts


def build(run_dir: Path) -> tuple[str, dict[str, Any]]:
    if not run_dir.is_dir():
        raise ReportError(f"no such run folder: {run_dir}")
    folder = RunFolder(run_dir)
    summary, source, missing = _load_summary(folder)
    log_dir = folder.step_log
    if summary is None and not log_dir.is_dir():
        raise ReportError(f"{run_dir} is not a traceml run folder: no final_summary.json, "
                          f"live snapshot or step log ({STEP_LOG_DIR}/)")
    dx = summary.diagnosis if summary is not None else None
    series = step_series.read(log_dir, dx.phase if dx else None,
                              [dx.rank] if dx and dx.rank is not None else [])
    if not log_dir.is_dir() or not series.records:
        missing.append(f"no step log ({STEP_LOG_DIR}/) or it is empty: no step-time "
                       "charts")
    text = _text_summary(folder, summary)
    body = [_head(summary, source, missing, run_dir)]
    body += [_verdict(summary), _cost(summary), _episodes(summary, series),
             _steps(series, summary), _phases(summary), _memory(summary),
             _collectives(summary), _setup(summary), _hang(summary), _config(summary),
             _section("text", "The text summary", f"<pre>{esc(text)}</pre>" if text
                      else _none("no text summary"))]
    title = f"traceml report: {summary.run.name if summary else run_dir.name}"
    page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f'<title>{esc(title)}</title><style>{CSS}</style></head><body>'
            + "\n".join(body) + "</body></html>\n")
    return page, {"source": source, "missing": missing, "records": series.records,
                  "ranks": series.ranks}


def _load_summary(folder: RunFolder) -> tuple[model.Summary | None, str, list[str]]:
    missing: list[str] = []
    if folder.summary_json.is_file():
        try:
            return model.load(folder.summary_json), "final_summary.json", missing
        except model.NotASummary as exc:
            raise ReportError(str(exc)) from None
    missing.append("no final_summary.json: the collector did not finish the run (killed or "
                   "still running)")
    if folder.live.is_file():
        try:
            s = model.load(folder.live)
        except model.NotASummary as exc:
            missing.append(f"the live snapshot is unreadable: {exc}")
            return None, "none", missing
        missing.append("shown from the last live snapshot: figures as of its time")
        return s, folder.live.name, missing
    missing.append("no live snapshot either: no verdict, cost or per-rank figures")
    return None, "none", missing


def _text_summary(folder: RunFolder, s: model.Summary | None) -> str:
    if folder.summary_txt.is_file():
        try:
            return folder.summary_txt.read_text(encoding="utf-8", errors="replace")[:200_000]
        except OSError:
            pass
    if s is None:
        return ""
    try:
        return render_text(s)
    except (KeyError, TypeError, ValueError, IndexError):
        return ""


def _section(sid: str, title: str, inner: str) -> str:
    return f'<section id="{sid}"><h2>{esc(title)}</h2>{inner}</section>'


def _none(why: str) -> str:
    return f'<p class="muted">{esc(why)}.</p>'


def _table(headers: list[str], rows: list[list[Any]], left: int = 0,
           wrap: int | None = None) -> str:
    """Cells escaped; the first `left` columns aligned left, column `wrap` (free text)
    wrapped instead of widening the table."""
    def cls(i: int) -> str:
        return " class=w" if i == wrap else " class=l" if i < left else ""

    head = "".join(f"<th{cls(i)}>{esc(h)}</th>" for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f"<td{cls(i)}>{esc(v)}</td>" for i, v in enumerate(r))
                   + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _head(s: model.Summary | None, source: str, missing: list[str], run_dir: Path) -> str:
    name = s.run.name if s else run_dir.name
    facts = ""
    if s is not None:
        r = s.run
        facts = (f"<p>{esc(r.world_size)} rank(s) on {esc(r.nnodes)} node(s), {esc(r.steps)} "
                 f"steps, {esc(fmt(r.duration_s, ' s'))}, exit code {esc(r.exit_code)}; "
                 f"started {esc(r.started_at)}, ended {esc(r.ended_at)}. "
                 f'<span class="muted">From {esc(source)}.</span></p>')
    miss = ("" if not missing else '<div class="missing" id="missing"><b>Missing from this '
            "record:</b><ul>" + "".join(f"<li>{esc(m)}</li>" for m in missing) + "</ul></div>")
    return f"<header><h1>traceml report: {esc(name)}</h1>{facts}{miss}</header>"


def _verdict(s: model.Summary | None) -> str:
    if s is None:
        return _section("verdict", "Verdict", _none("no summary: no verdict"))
    d = s.diagnosis
    who = "".join(f" {k} {esc(v)}" for k, v in (("rank", d.rank), ("phase", d.phase))
                  if v is not None)
    sev = d.severity if d.severity in ("critical", "warning", "info") else ""
    parts = [f'<div class="verdict {sev}"><p><b class="label">{esc(d.label)}</b>{who} '
             f'[{esc(d.severity)}]</p><p class="summary">{esc(d.summary)}</p>']
    ev = [(k, v) for k, v in (("gap", fmt(d.gap_ms, " ms") if d.gap_ms is not None else None),
                              ("share of step", _pct(d.gap_share)),
                              ("node", d.node.index if d.node else None)) if v is not None]
    if ev:
        parts.append("<p>Evidence: " + "; ".join(f"{esc(k)} {esc(v)}" for k, v in ev) + "</p>")
    parts.append("</div>")
    if s.failure is not None:
        f = s.failure
        parts.append(f'<div class="verdict critical"><p><b>Failure</b>: {esc(f.summary)}</p>'
                     + (f"<pre>{esc(f.error)}</pre>" if f.error else "") + "</div>")
    live = s.live_diagnosis
    if live is not None and (live.label, live.rank) != (d.label, d.rank):
        parts.append(f"<p>At the end, live: <b>{esc(live.label)}</b> {esc(live.summary)}</p>")
    return _section("verdict", "Verdict", "".join(parts))


def _pct(v: float | None) -> str | None:
    return None if v is None or not math.isfinite(v) else f"{100 * v:.0f}%"


def _cost(s: model.Summary | None) -> str:
    if s is None or s.cost is None or s.cost.lost_s is None:
        return _section("cost", "Cost", _none("no cost was priced for this verdict"))
    c = s.cost
    rows = [["time lost", fmt(c.lost_s, " s")], ["share of the run", _pct(c.lost_share) or "-"],
            [f"{c.hours_unit}-hours lost", fmt(c.gpu_hours_lost)]]
    w = c.what_if
    for key, name in (("now_step_ms", "step now (ms)"), ("step_ms", "step without it (ms)"),
                      ("speedup", "speed-up"), ("reasoning", "how")):
        v = None if w is None else getattr(w, key)
        if v is not None:
            rows.append([name, fmt(v) if isinstance(v, float) else v])
    return _section("cost", "Cost", _table(["", "figure"], rows, left=1, wrap=1))


def _spans(s: model.Summary | None, last_step: int) -> list[Span]:
    spans = []
    for e in s.timeline if s else []:
        a = e.start_step if e.start_step is not None else e.named_step
        b = e.end_step if e.end_step is not None else e.cleared_step
        if a is None:
            continue
        a = max(a, 0)
        b = last_step if b is None or b < a else b
        who = f" rank {e.rank}" if e.rank is not None else ""
        spans.append(Span(a, b, f"{e.label}{who} steps {a}-{b}", e.severity))
    return spans


def _episodes(s: model.Summary | None, series: step_series.StepSeries) -> str:
    if s is None or not s.timeline:
        return _section("episodes", "Episodes", _none("no episode recorded"))
    last = max([series.last_step] + [e.end_step or 0 for e in s.timeline])
    chart = timeline("Episodes over the run", _spans(s, last), 0, last)
    rows = [[e.label, "" if e.rank is None else e.rank, e.phase or "", e.severity,
             _range(e.start_step, e.end_step), _clock(e.start), _clock(e.end),
             fmt(e.lost_s, " s"), e.summary] for e in s.timeline]
    return _section("episodes", "Episodes", chart + _table(
        ["label", "rank", "phase", "severity", "steps", "from", "to", "lost", "what"], rows,
        left=1, wrap=8))


def _clock(iso: str | None) -> str:
    """The time of day of an ISO time (the date is the run's, in its header)."""
    return "" if not iso else iso[11:19] if len(iso) >= 19 else iso


def _range(a: int | None, b: int | None) -> str:
    return "-" if a is None else f"{a}-{'' if b is None else b}"


def _reduced_chart(title: str, red: step_series.Reduced, spans: list[Span]) -> str:
    lines = [Series(f"rank {c.rank}", c.xs, c.ys) for c in red.worst]
    chart = line_chart(title, lines, (red.xs, red.low, red.high), spans)
    return chart + legend([f"rank {c.rank} (worst step of each bucket)" for c in red.worst],
                          "p10-p90 of all ranks")


def _steps(series: step_series.StepSeries, s: model.Summary | None) -> str:
    if not series.records:
        return _section("steps", "Step time per rank", _none("no step log"))
    spans = [sp for sp in _spans(s, series.last_step) if not sp.label.startswith(WARMUP)]
    note = (f'<p class="muted">{series.records} step records of {series.ranks} rank(s), steps '
            f"{series.first_step}-{series.last_step} in buckets of {series.bucket_steps}; "
            f"shaded: episodes.</p>")
    inner = note + _reduced_chart("Step time per rank (ms)", series.step, spans)
    if series.phase_series is not None and series.phase:
        inner += (f"<h3>{esc(series.phase)} per rank (the verdict's phase, ms)</h3>"
                  + _reduced_chart(f"{series.phase} per rank (ms)", series.phase_series,
                                   spans))
    return _section("steps", "Step time per rank", inner)


def _slowest(s: model.Summary) -> list[Any]:
    ranks = sorted(s.ranks, key=lambda r: -(r.step_ms.median or 0.0))
    keep = ranks[:MAX_RANK_ROWS]
    d = s.diagnosis.rank
    if d is not None and all(r.rank != d for r in keep):
        keep += [r for r in s.ranks if r.rank == d][:1]
    return sorted(keep, key=lambda r: r.rank)


def _phases(s: model.Summary | None) -> str:
    if s is None or not s.ranks:
        return _section("phases", "Phases per rank", _none("no per-rank figures"))
    shown = _slowest(s)
    rows = [(f"rank {r.rank}", [(r.phase_ms.get(p) or model.Quantiles()).median or 0.0
                                for p in s.phases]) for r in shown]
    chart = stacked_bars("Median ms per phase, per rank", rows, s.phases)
    table = _table(["rank", "host", "steps", "step"] + list(s.phases),
                   [[r.rank, r.host, r.steps, fmt(r.step_ms.median)]
                    + [fmt(q.median if (q := r.phase_ms.get(p)) else None) for p in s.phases]
                    for r in shown], left=2)
    more = (f'<p class="muted">{len(s.ranks) - len(shown)} more rank(s) not shown (the '
            f"{MAX_RANK_ROWS} slowest and the verdict's are).</p>"
            if len(s.ranks) > len(shown) else "")
    return _section("phases", "Phases per rank", legend(s.phases) + chart + table + more)


def _memory(s: model.Summary | None) -> str:
    if s is None or s.memory is None or not s.memory.ranks:
        return _section("memory", "Memory", _none("no memory figures"))
    m = s.memory
    ranks = sorted(m.ranks, key=lambda r: -(r.rss_peak_mb or 0.0))[:MAX_RANK_ROWS]
    bars = stacked_bars("Host memory per rank (MB): now, and the rise to the peak",
                        [(f"rank {r.rank}", [r.rss_mb or 0.0,
                                             max((r.rss_peak_mb or 0.0) - (r.rss_mb or 0.0),
                                                 0.0)])
                         for r in sorted(ranks, key=lambda r: r.rank)],
                        ["RSS now", "peak above it"], unit="MB")
    head = ""
    if m.growing:
        head += f"<p><b>Growing</b> on rank(s) {esc(', '.join(map(str, m.growing[:32])))}.</p>"
    if m.imbalance is not None:
        head += (f"<p><b>Imbalance</b>: rank {esc(m.imbalance.rank)} holds "
                 f"{esc(fmt(m.imbalance.rss_mb, ' MB'))}, others' median "
                 f"{esc(fmt(m.imbalance.others_median_mb, ' MB'))}.</p>")
    table = _table(["rank", "RSS MB", "peak MB", "MB/min", "GPU MB", "GPU MB/min", "growing",
                    "headroom MB", "limit in s"],
                   [[r.rank, fmt(r.rss_mb), fmt(r.rss_peak_mb), fmt(r.rss_rate_mb_min),
                     fmt(r.gpu_mb), fmt(r.gpu_rate_mb_min), r.growing or "",
                     fmt(r.headroom_mb), fmt(r.limit_in_s)] for r in ranks])
    note = ('<p class="muted">The record keeps each rank\'s memory now, its peak and its '
            "trend (rate), not a series: the trend is the rate column.</p>")
    return _section("memory", "Memory", head + legend(["RSS now", "peak above it"]) + bars
                    + table + note)


def _collectives(s: model.Summary | None) -> str:
    if s is None or not s.collectives:
        return _section("collectives", "Collectives", _none("no collective recorded"))
    rows = [[c.op, c.group, c.phase, c.ranks, fmt(c.count_per_step),
             fmt(c.bytes_per_step / 1e6 if c.bytes_per_step is not None else None),
             fmt(c.exposed_ms_per_step), _pct(c.share_of_sync) or "-"]
            for c in s.collectives[:64]]
    return _section("collectives", "Collectives", _table(
        ["op", "group", "issued in", "ranks", "calls/step", "MB/step", "exposed ms/step",
         "share of sync"], rows, left=3))


def _setup(s: model.Summary | None) -> str:
    if s is None or not s.checks:
        inner = _none("no setup finding")
    else:
        inner = "<ul>" + "".join(
            f"<li><b>[{esc(c.severity)}] {esc(c.id)}</b> (rank "
            f"{esc(','.join(map(str, c.ranks[:8])))}): "
            f"{esc(c.evidence)}<br>fix: {esc(c.fix)}</li>"
            for c in s.checks[:64]) + "</ul>"
    if s is not None and s.preflight:
        pre = json.dumps(model.plain(s.preflight), indent=1, default=str)
        inner += f"<h3>Preflight</h3><pre>{esc(pre[:20_000])}</pre>"
    return _section("setup", "Setup findings", inner)


def _hang(s: model.Summary | None) -> str:
    if s is None or not s.hang:
        return _section("hang", "Hang", _none("no hang"))
    h = s.hang
    head = (f"<p>{esc(h.kind)} on rank(s) {esc(h.ranks)} since "
            f"{esc(h.since)}, stalled {esc(h.stalled_s)} s.</p>")
    stacks = h.stacks
    culprits = [str(r) for r in h.ranks]
    order = [r for r in culprits if r in stacks] + [r for r in stacks if r not in culprits]
    parts = []
    for rank in order[:MAX_HANG_RANKS]:
        for t in stacks[rank] or []:
            parts.append(f"<details open><summary>rank {esc(rank)}, thread "
                         f"{esc(t.thread)}</summary><pre>"
                         f"{esc(t.stack[:MAX_HANG_STACK_CHARS])}</pre></details>")
    return _section("hang", "Hang", head + ("".join(parts) or _none("no stacks were taken")))


def _config(s: model.Summary | None) -> str:
    if s is None:
        return _section("config", "Configuration", _none("no summary"))
    r = s.run
    rows: list[list[Any]] = [
            ["name", r.name], ["command", " ".join(r.command)], ["ranks", r.world_size],
            ["nodes", r.nnodes], ["started", r.started_at or "-"], ["ended", r.ended_at or "-"],
            ["exit code", r.exit_code], ["parallelism", json.dumps(r.parallel, default=str)],
            ["phases", ", ".join(s.phases)]]
    hosts = sorted({x.host for x in s.ranks})
    rows.append(["hosts", ", ".join(hosts[:16]) + (f" (+{len(hosts) - 16})"
                                                   if len(hosts) > 16 else "")])
    devices = sorted({str(x.device) for x in s.ranks})
    rows.append(["devices", ", ".join(devices[:8])])
    if s.restarts is not None:
        rows.append(["restarts", s.restarts.count])
    return _section("config", "Configuration", _table(["", ""], rows, left=1, wrap=1))
