"""`traceml compare OLD NEW`: what changed between two runs' final_summary.json.

The verdict follows the median step time, the number that decides how long a job
takes: a change within NOISE_SHARE of the old value is "unchanged within noise".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .windows import median

# Step-time medians of repeated identical runs on a shared machine differ by a few
# percent; below 5% a change cannot be told from that noise.
NOISE_SHARE = 0.05

INPUT = ("dataloader", "h2d")
COMPUTE = ("forward", "backward", "optimizer")


class CompareError(Exception):
    """A summary that cannot be read: printed as one line."""


def load(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CompareError(f"no such file: {path}") from None
    except (OSError, ValueError) as exc:
        raise CompareError(f"{path} is not a readable JSON summary: {exc}") from None
    if not isinstance(doc, dict) or not {"step_ms", "ranks", "diagnosis"} <= doc.keys():
        raise CompareError(f"{path} is not a traceml final_summary.json")
    return doc


def _group_ms(rank: dict[str, Any], phases: tuple[str, ...]) -> float | None:
    vals = [(rank["phase_ms"].get(p) or {}).get("median") for p in phases]
    vals = [v for v in vals if v is not None]
    return sum(vals) if vals else None


def metrics(doc: dict[str, Any]) -> dict[str, float | None]:
    ranks = [r for r in doc["ranks"] if r.get("steps", 0) > 0]
    local = [v for r in ranks if (v := _group_ms(r, INPUT + COMPUTE)) is not None]
    def across(phases: tuple[str, ...]) -> float | None:
        return median([v for r in ranks if (v := _group_ms(r, phases)) is not None])
    return {
        "step_ms": doc["step_ms"].get("median"),
        "skew_ms": (max(local) - median(local)) if local else None,
        "input_ms": across(INPUT),
        "compute_ms": across(COMPUTE),
        "sync_ms": across(("sync",)),
        "wait_ms": across(("wait",)),
    }


def verdict(old: float | None, new: float | None) -> str:
    if old is None or new is None or old <= 0:
        return "unknown"
    change = (new - old) / old
    if change <= -NOISE_SHARE:
        return "improved"
    if change >= NOISE_SHARE:
        return "regressed"
    return "unchanged"


def compare(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    mo, mn = metrics(old), metrics(new)
    rows = {}
    for key in mo:
        a, b = mo[key], mn[key]
        delta = None if a is None or b is None else b - a
        pct = None if delta is None or not a else delta / a
        rows[key] = {"old": _r(a), "new": _r(b), "delta": _r(delta),
                     "change": None if pct is None else round(pct, 4)}
    return {
        "old": old["run"]["name"], "new": new["run"]["name"],
        "metrics": rows,
        "diagnosis": {"old": _diag(old), "new": _diag(new)},
        "verdict": verdict(mo["step_ms"], mn["step_ms"]),
        "noise_share": NOISE_SHARE,
    }


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _diag(doc: dict[str, Any]) -> dict[str, Any]:
    d = doc["diagnosis"]
    return {"label": d["label"], "rank": d.get("rank"), "phase": d.get("phase")}


LABELS = {"step_ms": "step time", "skew_ms": "worst-rank skew", "input_ms": "input",
          "compute_ms": "compute", "sync_ms": "sync (collective wait)", "wait_ms": "wait"}


def render(result: dict[str, Any]) -> str:
    lines = [f"traceml compare: {result['old']} -> {result['new']}", "",
             f"{'median ms per step':<24} {'old':>9} {'new':>9} {'change':>9}"]
    for key, row in result["metrics"].items():
        def cell(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"
        change = "-" if row["change"] is None else f"{row['change']:+.1%}"
        lines.append(f"{LABELS[key]:<24} {cell(row['old']):>9} {cell(row['new']):>9} "
                     f"{change:>9}")
    d = result["diagnosis"]
    def label(x: dict[str, Any]) -> str:
        return x["label"] + (f" (rank {x['rank']})" if x["rank"] is not None else "")
    lines += ["", f"diagnosis: {label(d['old'])} -> {label(d['new'])}"]
    v = result["verdict"]
    explain = {"improved": "faster", "regressed": "slower",
               "unchanged": f"within noise (±{NOISE_SHARE:.0%})",
               "unknown": "step time missing in one summary"}[v]
    lines.append(f"verdict: {v.upper()}: step time {explain}")
    return "\n".join(lines) + "\n"
