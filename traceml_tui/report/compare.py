"""`traceml compare OLD NEW`: what changed between two runs' final_summary.json.

The verdict follows the median step time, the number that decides how long a job
takes: a change within NOISE_SHARE of the old value is "unchanged within noise".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from traceml_agent.sanitize import clean_line
from traceml_agent.vocab import (
    COMPUTE_PHASES,
    INPUT_PHASES,
    LOCAL_PHASES,
    OTHER_WORK,
    PHASE_TABLE,
    PHASES,
    SYNC,
    WAIT,
    WAITING_PHASES,
)
from traceml_tui.judge.windows import median
from traceml_tui.runfolder.summary_model import NotASummary, Rank, Summary, from_doc
from traceml_tui.runfolder.summary_model import load as load_summary

# Step-time medians of repeated identical runs on a shared machine differ by a few
# percent; below 5% a change cannot be told from that noise.
NOISE_SHARE = 0.05

# Realistic DDP scaling efficiency by GPU count, from the DDP guide this project grew
# from ("Scaling Efficiency Analysis"): communication, synchronization and
# bandwidth keep it below 100%, more so as the job grows. Counts in between take the
# row below them; beyond 16, the 16 row.
EXPECTED_EFFICIENCY = {2: (0.90, 0.95), 4: (0.85, 0.95), 8: (0.80, 0.90), 16: (0.75, 0.90)}

INPUT = INPUT_PHASES
COMPUTE = COMPUTE_PHASES


class CompareError(Exception):
    """A summary that cannot be read: printed as one line."""


# --- what a comparison says (`traceml compare --json` prints it in this order) -----------


class MetricRow(msgspec.Struct, kw_only=True):
    """One group's median ms a step in each run, its difference and relative change."""

    old: float | None
    new: float | None
    delta: float | None
    change: float | None


class Verdicts(msgspec.Struct, kw_only=True):
    """Each run's diagnosis: its label and whom it named."""

    label: str
    rank: int | None
    phase: str | None


class BothDiagnoses(msgspec.Struct, kw_only=True):
    old: Verdicts
    new: Verdicts


class Prediction(msgspec.Struct, kw_only=True):
    """OLD's what-if (the step without its culprit) against the step NEW measured."""

    label: str
    culprit: str | None
    rank: int | None
    node: int | None
    phase: str | None
    predicted_step_ms: float
    measured_step_ms: float | None
    error: float
    weak: str | None
    same_world: bool


class Scaling(msgspec.Struct, kw_only=True):
    """NEW on more ranks than OLD: its speedup and efficiency beside the guide's range."""

    old_ranks: int
    new_ranks: int
    basis: str
    old_rate: float | None
    new_rate: float | None
    speedup: float
    ideal: float
    efficiency: float
    expected: list[float] | None
    assessment: str


class Comparison(msgspec.Struct, kw_only=True):
    old: str
    new: str
    metrics: dict[str, MetricRow]
    diagnosis: BothDiagnoses
    verdict: str
    noise_share: float
    scaling: Scaling | None
    prediction: Prediction | None

    def to_json(self) -> dict[str, Any]:
        """As plain JSON values, in the field order above (`--json`)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


def load(path: Path) -> Summary:
    """A summary file through the model (runfolder/summary_model.py): one CompareError
    line if it is not."""
    try:
        return load_summary(path)
    except NotASummary as exc:
        raise CompareError(str(exc)) from None


def _typed(doc: Summary | dict[str, Any]) -> Summary:
    return doc if isinstance(doc, Summary) else from_doc(doc)


def _group_ms(rank: Rank, phases: tuple[str, ...]) -> float | None:
    vals = [q.median for p in phases
            if (q := rank.phase_ms.get(p)) is not None and q.median is not None]
    return sum(vals) if vals else None


def _other_work(ranks: list[Rank]) -> tuple[str, ...]:
    """The own work that is neither input nor compute: the table's OTHER_WORK rows and
    the phases a job timed itself (traceml_agent.phase(): a checkpoint, an eval pass),
    which no group of the table names."""
    table = tuple(p.name for p in PHASE_TABLE if p.group == OTHER_WORK)
    custom = sorted({p for r in ranks for p in r.phase_ms if p not in PHASES})
    return (*table, *custom)


def metrics(doc: Summary | dict[str, Any]) -> dict[str, float | None]:
    """The median rank's ms a step in each group of phases (the phase table's groups:
    every phase counts in one), and the worst rank's own work beyond the median's."""
    doc = _typed(doc)
    ranks = [r for r in doc.ranks if r.steps > 0]
    other = _other_work(ranks)
    local = [v for r in ranks if (v := _group_ms(r, (*LOCAL_PHASES, *other))) is not None]
    def across(phases: tuple[str, ...]) -> float | None:
        return median([v for r in ranks if (v := _group_ms(r, phases)) is not None])
    out = {
        "step_ms": doc.step_ms.median,
        "skew_ms": (max(local) - mid) if (mid := median(local)) is not None else None,
        "input_ms": across(INPUT),
        "compute_ms": across(COMPUTE),
        "other_ms": across(other),
        "sync_ms": across((SYNC,)),
        "wait_ms": across((WAIT,)),
    }
    waits = tuple(p for p in WAITING_PHASES if p not in (SYNC, WAIT))
    out.update({f"{p}_ms": across((p,)) for p in waits})  # a waiting phase of its own
    return out


def verdict(old: float | None, new: float | None) -> str:
    if old is None or new is None or old <= 0:
        return "unknown"
    change = (new - old) / old
    if change <= -NOISE_SHARE:
        return "improved"
    if change >= NOISE_SHARE:
        return "regressed"
    return "unchanged"


def compare(old: Summary | dict[str, Any], new: Summary | dict[str, Any]) -> Comparison:
    old, new = _typed(old), _typed(new)
    mo, mn = metrics(old), metrics(new)
    rows = {}
    for key in mo:
        a, b = mo[key], mn.get(key)
        if key == "other_ms" and a is None and b is None:
            continue  # neither run timed work outside input and compute
        delta = None if a is None or b is None else b - a
        pct = None if delta is None or not a else delta / a
        rows[key] = MetricRow(old=_r(a), new=_r(b), delta=_r(delta),
                              change=None if pct is None else round(pct, 4))
    return Comparison(
        old=old.run.name, new=new.run.name, metrics=rows,
        diagnosis=BothDiagnoses(old=_diag(old), new=_diag(new)),
        verdict=verdict(mo["step_ms"], mn["step_ms"]), noise_share=NOISE_SHARE,
        scaling=scaling(old, new), prediction=prediction(old, new))


def prediction(old: Summary, new: Summary) -> Prediction | None:
    """How close OLD's what-if (the step it predicted without its culprit: cost.py) came
    to the step NEW measured: for a run before a fix and the run after it."""
    w = old.cost.what_if if old.cost is not None else None
    # The what-if predicts the mean step (a stall every tenth step counts for a tenth);
    # summaries before it had only the median.
    measured = new.step_ms.mean or new.step_ms.median
    if not w or not measured:
        return None
    same = _world(old) == _world(new)
    error = (w.step_ms - measured) / measured
    return Prediction(label=w.label, culprit=w.culprit, rank=w.rank, node=w.node,
                      phase=w.phase, predicted_step_ms=w.step_ms,
                      measured_step_ms=_r(measured), error=round(error, 4), weak=w.weak,
                      same_world=same)


def _world(doc: Summary) -> int:
    return doc.run.world_size or len(doc.ranks)


def _rate(doc: Summary) -> tuple[float | None, float | None]:
    """(samples/s, steps/s) of a run; older summaries have no throughput: steps from the
    median step time."""
    t = doc.throughput
    steps = None if t is None else t.steps_per_s
    if steps is None and doc.step_ms.median:
        steps = 1000.0 / doc.step_ms.median
    return (None if t is None else t.samples_per_s), steps


def expected_efficiency(ranks: int) -> tuple[float, float] | None:
    rows = [n for n in EXPECTED_EFFICIENCY if n <= ranks]
    return EXPECTED_EFFICIENCY[max(rows)] if rows else None


def scaling(old: Summary, new: Summary) -> Scaling | None:
    """When NEW runs on more ranks than OLD (e.g. a 1-rank baseline): its speedup and
    scaling efficiency, beside the range the DDP guide calls realistic."""
    wo, wn = _world(old), _world(new)
    if wn <= wo:
        return None
    (so, to), (sn, tn) = _rate(old), _rate(new)
    if so and sn:
        basis, a, b = "samples/s", so, sn
    elif to and tn:  # weak scaling: the same batch per rank, so samples/s ~ steps/s x ranks
        basis, a, b = "steps/s x ranks (assumes the same batch per rank)", to * wo, tn * wn
    else:
        return None
    speedup, ideal = b / a, wn / wo
    efficiency = speedup / ideal
    expected = expected_efficiency(round(ideal)) if wo == 1 else None
    if expected is None:
        assessment = "no reference range (the guide's table starts from one rank)"
    elif efficiency < expected[0]:
        assessment = "below the realistic range: look at sync (collective wait) and input"
    elif efficiency > expected[1]:
        assessment = "above the realistic range"
    else:
        assessment = "within the realistic range"
    return Scaling(old_ranks=wo, new_ranks=wn, basis=basis, old_rate=_r(a), new_rate=_r(b),
                   speedup=round(speedup, 3), ideal=round(ideal, 3),
                   efficiency=round(efficiency, 4),
                   expected=None if expected is None else list(expected),
                   assessment=assessment)


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _diag(doc: Summary) -> Verdicts:
    d = doc.diagnosis
    return Verdicts(label=d.label, rank=d.rank, phase=d.phase)


LABELS = {"step_ms": "step time", "skew_ms": "worst-rank skew", "input_ms": "input",
          "compute_ms": "compute", "other_ms": "other work", "sync_ms": "sync (collective wait)",
          "wait_ms": "wait"}


def render(result: Comparison) -> str:
    lines = [f"traceml compare: {result.old} -> {result.new}", "",
             f"{'median ms per step':<24} {'old':>9} {'new':>9} {'change':>9}"]
    for key, row in result.metrics.items():
        def cell(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"
        change = "-" if row.change is None else f"{row.change:+.1%}"
        name = LABELS.get(key, key.removesuffix("_ms"))
        lines.append(f"{name:<24} {cell(row.old):>9} {cell(row.new):>9} {change:>9}")
    d = result.diagnosis

    def label(x: Verdicts) -> str:
        return x.label + (f" (rank {x.rank})" if x.rank is not None else "")
    lines += ["", f"diagnosis: {label(d.old)} -> {label(d.new)}"]
    v = result.verdict
    explain = {"improved": "faster", "regressed": "slower",
               "unchanged": f"within noise (±{NOISE_SHARE:.0%})",
               "unknown": "step time missing in one summary"}[v]
    lines.append(f"verdict: {v.upper()}: step time {explain}")
    p = result.prediction
    if p:
        who = (f"node {p.node}" if p.culprit == "node" else
               f"rank {p.rank}" if p.culprit in ("rank", "stalls") else
               f"{p.phase} on every rank")
        measured = "-" if p.measured_step_ms is None else f"{p.measured_step_ms:.2f}"
        lines += ["", f"prediction: without {p.label} ({who}) the old run predicted "
                      f"{p.predicted_step_ms:.2f} ms per step; the new run measured "
                      f"{measured} ms ({p.error:+.0%} off)"
                  + ("" if p.same_world else "; the runs' world sizes differ")
                  + (" [weak estimate]" if p.weak else "")]
    sc = result.scaling
    if sc:
        expected = ("" if sc.expected is None else
                    f" (realistic for {sc.new_ranks}: {sc.expected[0]:.0%}-"
                    f"{sc.expected[1]:.0%})")
        lines += ["", f"scaling {sc.old_ranks} -> {sc.new_ranks} ranks, by {sc.basis}: "
                      f"{sc.old_rate or 0.0:.1f} -> {sc.new_rate or 0.0:.1f}",
                  f"  speedup {sc.speedup:.2f}x of an ideal {sc.ideal:.0f}x: efficiency "
                  f"{sc.efficiency:.0%}{expected}",
                  f"  {sc.assessment}"]
    # Every field came from the files given (anyone's): no escape sequence, no line break.
    return "\n".join(map(clean_line, lines)) + "\n"
