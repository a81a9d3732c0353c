"""final_summary.json (docs/spec/SUMMARY.md, docs/spec/summary.schema.json) and its
text twin, built from a Snapshot.

The same function builds the live snapshot file the collector rewrites every few
seconds, so a run that ends badly (collector killed, machine lost) still leaves a
record of the same shape, marked ``"complete": false``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np

from traceml_agent import nccl_log
from traceml_agent.sanitize import clean_line
from traceml_agent.vocab import SYNC, format_ranks
from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge.bandwidth import si_bytes
from traceml_tui.judge.snapshot import Episode, Snapshot, WholeWindow, hours_unit
from traceml_tui.judge.stalls import StallFinding
from traceml_tui.judge.windows import median
from traceml_tui.report.memory_report import memory_json, memory_lines
from traceml_tui.runfolder import summary_model as model
from traceml_tui.runfolder.exit_codes import INTERRUPTED_EXIT
from traceml_tui.runfolder.folders import write_atomic
from traceml_tui.runfolder.layout import RunFolder

from . import attempts as attempt_text

SCHEMA_VERSION = "1"
T = TypeVar("T")


@dataclass(frozen=True)
class RunMeta:
    """What the launcher knows about the run that the agents do not."""

    command: list[str] = field(default_factory=list)
    exit_code: int | None = None
    ended_at: float | None = None
    complete: bool = True
    failed_rank: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, tz=timezone.utc).isoformat(timespec="milliseconds")


def _round(v: float | None, nd: int = 4) -> float | None:
    return None if v is None else round(v, nd)


# Below this, x * 10**nd is exact enough in a double to tell which way x rounds.
_SCALED_EXACT = 2.0 ** 30
_TIE = 1e-6  # ... except within this of a tie, where Python's round decides


def rounded(values: np.ndarray, nd: int = 4) -> list[Any]:
    """round(v, nd) of every value, exactly as Python's round gives it (correctly rounded:
    the file is the same to the last digit whichever way it is built), NaN as None; in
    numpy by column, with Python's round only for values near a tie or too large."""
    scale = 10.0 ** nd
    with np.errstate(invalid="ignore", over="ignore"):  # inf and NaN: Python's round
        y = values * scale
        out = (np.rint(y) / scale).astype(object)
        nan = np.isnan(values)
        doubt = ~nan & ~((np.abs(y - np.floor(y) - 0.5) > _TIE) & (np.abs(y) < _SCALED_EXACT))
    for at in zip(*np.nonzero(doubt), strict=True):
        out[at] = round(float(values[at]), nd)
    out[nan] = None
    result: list[Any] = out.tolist()
    return result


def _who(d: model.Diagnosis) -> str:
    if d.node:
        return f"  node {d.node.index} (ranks {', '.join(map(str, d.node.ranks))})"
    return f"  rank {d.rank}" if d.rank is not None else ""


def _typed(value: Any, kind: type[T]) -> T:
    """A section another layer hands over as plain values (the judge's to_json, the
    agent's to_wire, the launcher's extras), checked into the model's type once."""
    return msgspec.convert(value, kind)


def _episode(e: Episode, duration_s: float, world: int) -> model.Episode:
    lost_s, lost_share, hours = _lost(e.lost_s, duration_s, world)
    return model.Episode(
        label=e.label, rank=e.rank, phase=e.phase, severity=e.severity, start=iso(e.start),
        end=iso(e.end), start_step=e.start_step, end_step=e.end_step,
        named_step=e.named_step, cleared_step=e.cleared_step, summary=e.summary,
        node=e.node, lost_s=lost_s, lost_share=lost_share, gpu_hours_lost=hours,
        attempt=e.attempt)


def _lost(lost_s: float | None, duration_s: float, world: int
          ) -> tuple[float | None, float | None, float | None]:
    """Job seconds lost, as a share of the run and in device-hours (every rank idles for
    them: seconds x world size / 3600)."""
    if lost_s is None:
        return None, None, None
    return (round(lost_s, 3), round(lost_s / duration_s, 4) if duration_s > 0 else None,
            round(lost_s * world / 3600.0, 4))


def _cost(snap: Snapshot, diagnosis: dx.Diagnosis, duration_s: float) -> model.Cost:
    """What the run's problems cost (the episodes' lost time summed) and what the job
    would do without the diagnosed one (cost.py; docs/diagnosis.md)."""
    lost = [e.lost_s for e in snap.timeline if e.lost_s is not None]
    what_if = (snap.final_what_if if diagnosis is snap.final else
               snap.what_if if diagnosis is snap.live else None)
    if what_if is not None and what_if.label != diagnosis.label:
        what_if = None
    lost_s, lost_share, hours = _lost(sum(lost) if lost else None, duration_s,
                                      snap.world_size)
    return model.Cost(lost_s=lost_s, lost_share=lost_share, gpu_hours_lost=hours,
                      hours_unit=hours_unit(snap.ranks),
                      what_if=None if what_if is None else _typed(what_if.to_json(),
                                                                  model.WhatIf))


def build(snap: Snapshot, meta: RunMeta) -> model.Summary:
    """The summary, as its model. `snap` must be a full snapshot (whole-window quantiles)."""
    # A hang at the end is the verdict; otherwise the whole window's diagnosis.
    diagnosis = snap.live if snap.live.label == dx.HANG else (snap.final or snap.live)
    step_medians = [(r.rank, r.step_ms.median) for r in snap.ranks
                    if r.reported and r.step_ms is not None]
    worst_rank, worst = (max(step_medians, key=lambda x: (x[1], -x[0]))
                         if step_medians else (None, None))
    duration_s = (meta.ended_at or snap.now) - snap.started_at
    rank_steps, step_q, phase_q = _rank_quantiles(snap)
    rates = _throughputs(rank_steps, [snap.batch_sizes.get(r.rank) for r in snap.ranks])
    heartbeat_fields = [name for name, _, _ in model.HEARTBEAT_FIELDS]  # the row's last
    ranks = [
        model.Rank(
            rank=r.rank, local_rank=r.local_rank, node=r.node, host=r.host, pid=r.pid,
            device=r.device or None, reported=r.reported, steps=r.steps,
            window_steps=r.window_steps, step_ms=step_q[i], phase_ms=phase_q[i],
            throughput=rates[i], sys=sys, exit_code=r.exit_code, error=r.error,
            dropped_records=r.dropped,
            progress=model.Progress(
                collectives=r.heartbeat.collectives, phase=r.heartbeat.phase,
                in_collective=r.heartbeat.in_collective,
                since_step_s=_round(r.since_step_s, 2)),
            untimed=[model.Untimed(phase=u.phase, why=u.why) for u in r.untimed],
            agent_off=r.heartbeat.agent_off, bad_records=r.bad_records,
            device_rule=r.heartbeat.device_rule, steps_hidden=r.steps_hidden,
            agent_busy=r.heartbeat.agent_busy, **_thread_cpu(r.cpu_over_run),
            **{name: getattr(r.heartbeat, name) for name in heartbeat_fields})
        for i, (r, sys) in enumerate(zip(snap.ranks, _sys_rows(snap), strict=True))]
    attempts, restarts = _attempts(snap)
    return model.Summary(
        schema_version=SCHEMA_VERSION,
        complete=meta.complete,
        failure=rank_failure(ranks, meta),
        run=_typed({
            "name": snap.run_name, "world_size": snap.world_size, "nnodes": snap.nnodes,
            "started_at": iso(snap.started_at), "ended_at": iso(meta.ended_at or snap.now),
            "duration_s": round(duration_s, 3),
            "exit_code": meta.exit_code, "failed_rank": meta.failed_rank,
            "command": list(meta.command), "steps": snap.total_steps,
            "ranks_reporting": snap.reporting, "parallel": snap.parallel, **meta.extra,
            **({} if snap.window_at is None else {"window_stats_at": iso(snap.window_at)}),
        }, model.Run),
        phases=list(snap.phases),
        diagnosis=_typed(diagnosis.to_json(), model.Diagnosis),
        cost=_cost(snap, diagnosis, duration_s),
        checks=_typed([f.to_wire() for f in snap.checks], list[model.Check]),
        live_diagnosis=_typed({**snap.live.to_json(), "since": iso(snap.live_since)},
                              model.LiveDiagnosis),
        step_ms=model.StepMs(median=_round(median([m for _, m in step_medians])),
                             worst=_round(worst), worst_rank=worst_rank,
                             mean=_round(snap.mean_step_ms)),
        ranks=ranks,
        throughput=_job_throughput(ranks),
        timing=_timing(snap),
        timeline=[_episode(e, duration_s, snap.world_size) for e in snap.timeline],
        hang=_hang(snap),
        comm=_comm(snap),
        collectives=_typed([c.to_json() for c in snap.collectives], list[model.Collective]),
        stalls=stalls_json(snap.stalls),
        memory=memory_json(snap.memory),
        preflight=None if snap.preflight is None else _typed(snap.preflight, model.Preflight),
        collector=dict(snap.counters),
        relays=_relays(snap),
        attempts=attempts,
        restarts=restarts,
    )


def _attempts(snap: Snapshot) -> tuple[list[model.Attempt], model.Restarts | None]:
    """`attempts`: each attempt torchrun ran (judge/attempts.py; empty outside torchrun's
    elastic agent), its steps, last verdict and failure; `restarts`: how many and what
    they cost (None: the job ran in one attempt)."""
    rows: list[model.Attempt] = []
    for a in snap.attempts:
        first = a.failures[0].rank if a.failures else None
        rows.append(model.Attempt(
            attempt=a.number, started_at=iso(a.started_at), ended_at=iso(a.ended_at),
            steps=a.steps,
            rank_steps=[model.RankSteps(rank=r, steps=n) for r, n in a.rank_steps],
            verdict=None if a.verdict is None else _typed(a.verdict.to_json(),
                                                          model.Diagnosis),
            failure=failure_of([(f.rank, f.exit_code, f.error, f.step) for f in a.failures],
                               first),
            restart_s=_round(a.restart_s, 3),
            silent=[model.SilentRank(rank=r, step=n) for r, n in a.silent]))
    if len(rows) < 2:
        return rows, None
    costs = [r.restart_s for r in rows if r.restart_s is not None]
    return rows, model.Restarts(
        count=rows[-1].attempt - rows[0].attempt,
        restart_s=round(sum(costs), 3) if costs else None,
        dropped=rows[-1].attempt - rows[0].attempt + 1 - len(rows))


def _rank_quantiles(snap: Snapshot) -> tuple[
        list[float | None], list[model.Quantiles],
        list[dict[str, model.Quantiles | None]]]:
    """Per rank of the snapshot: its step median as measured, then its step quantiles and
    {phase: quantiles} as the file has them, rounded; from the whole-window columns, the
    rounding made by column (issue 33), not per rank and value."""
    whole: WholeWindow | None = snap.whole
    phases = snap.phases
    absent = [whole is None or r.rank not in whole.rows for r in snap.ranks]
    steps: list[float | None] = [None] * len(snap.ranks)
    none = model.Quantiles()  # never changed: one object for every row without figures
    step_q: list[model.Quantiles] = [none] * len(snap.ranks)
    phase_q: list[dict[str, model.Quantiles | None]] = [
        dict.fromkeys(phases) if a else {} for a in absent]
    if whole is None:  # not a full snapshot: no whole-window figures
        return steps, step_q, phase_q
    assert whole.phases == tuple(phases)
    medians, p95s = rounded(whole.median), rounded(whole.p95)
    raw = whole.median[:, 0].tolist()
    quantiles = model.Quantiles
    by_row = [{ph: None if a is None else quantiles(median=a, p95=b)
               for ph, a, b in zip(phases, m[1:], p[1:], strict=True)}
              for m, p in zip(medians, p95s, strict=True)]
    for i, r in enumerate(snap.ranks):
        row = whole.rows.get(r.rank)
        if row is not None:
            step = raw[row]
            steps[i] = None if step != step else step
            # both None where the step is not measured
            step_q[i] = quantiles(median=medians[row][0], p95=p95s[row][0])
            phase_q[i] = by_row[row]
    return steps, step_q, phase_q


# The exception's last line, as much as a summary line holds.
MAX_ERROR_LINE = 300


def rank_failure(ranks: Sequence[model.Rank], meta: RunMeta) -> model.Failure | None:
    """The summary's `failure` section from its rank rows (failure_of); also the
    launcher's fallback summary's."""
    if meta.exit_code == INTERRUPTED_EXIT:
        return None
    return failure_of([(r.rank, r.exit_code, r.error, r.steps) for r in ranks],
                      meta.failed_rank)


def failure_of(ranks: list[tuple[int, int | None, str | None, int]],
               first: int | None = None) -> model.Failure | None:
    """The rank that failed first, what ended it (exit code or signal, its exception's
    last line) and after how many steps: what the summary, its text and the dashboard's
    banner lead with (issue 32, failures first). `ranks`: (rank, exit code, error,
    steps). The rank torchrun or the collector saw fail first (`first`) leads; the
    others are usually its consequences (a peer gone in the middle of a collective)."""
    failed = sorted((r for r in ranks if r[1] not in (None, 0)),
                    key=lambda r: (r[0] != first, r[0]))
    if not failed:
        return None
    rank, code, err, steps = failed[0]
    assert code is not None
    lines = [t.strip() for t in (err or "").strip().splitlines() if t.strip()]
    error = clean_line(lines[-1][:MAX_ERROR_LINE]) if lines else None
    signame = (_signal_name(-code).strip(" ()") or None) if code < 0 else None
    how = (f"was killed by signal {-code}" + (f" ({signame})" if signame else "")
           if code < 0 else f"exited with code {code}")
    others = [r[0] for r in failed[1:]]
    text = (f"FAILED: rank {rank} {how} after {steps} steps"
            + (f": {error}" if error else "")
            + (f" (then rank(s) {format_ranks(others)})" if others else ""))
    return model.Failure(rank=rank, exit_code=code, signal=signame, error=error, step=steps,
                         others=others, summary=text)


def _relays(snap: Snapshot) -> model.Relays | None:
    """The node relays (relay.py), when the run had any: which went silent, what they
    lost. A silent relay's node reads as silent ranks; this says why."""
    if not snap.relays:
        return None
    return model.Relays(nodes=[r.node for r in snap.relays],
                        silent=[r.node for r in snap.relays if r.silent],
                        batches=sum(r.batches for r in snap.relays),
                        lost_batches=sum(r.lost_batches for r in snap.relays),
                        dropped=sum(r.dropped for r in snap.relays))


def _comm(snap: Snapshot) -> model.Comm:
    """The job's collective wait: the median rank's share of its step in sync, and per
    rank the achieved all-reduce bus bandwidth over its exposed sync time (where DDP's
    gradient bytes are known). docs/network.md explains the figures. From the whole
    window's columns: the ranks with a measured step."""
    whole = snap.whole
    listed = [] if whole is None else [
        (r, row) for r in snap.ranks
        if r.reported and (row := whole.rows.get(r.rank)) is not None
        and whole.medians[row][0] == whole.medians[row][0]]  # not NaN
    shares: list[float] = []
    per_rank: list[model.CommRank] = []
    if whole is not None and listed:
        at = np.array([row for _, row in listed], dtype=np.int64)
        step = whole.median[at, 0]
        sync = (whole.median[at, whole.phases.index(SYNC) + 1] if SYNC in whole.phases
                else np.full(len(at), np.nan))
        with np.errstate(divide="ignore", invalid="ignore"):
            shares = (sync / step)[~np.isnan(sync) & (step > 0)].tolist()
        for (r, _), sync_ms, shown in zip(listed, sync.tolist(), rounded(sync), strict=True):
            nbytes = r.heartbeat.grad_bytes
            gbps = (dx.bus_gbps(nbytes, 0.0 if sync_ms != sync_ms else sync_ms,
                                snap.world_size) if nbytes else None)
            per_rank.append(model.CommRank(rank=r.rank, sync_ms=shown,
                                           bytes_per_step=nbytes or None,
                                           busbw_gbps=_round(gbps)))
    rates = [x.busbw_gbps for x in per_rank if x.busbw_gbps is not None]
    return model.Comm(sync_share=_round(median(shares)) if shares else None,
                      busbw_gbps=_round(median(rates)) if rates else None,
                      preflight_busbw_gbps=(None if snap.preflight_busbw is None
                                            else float(snap.preflight_busbw)),
                      ranks=per_rank)


def _sys_rows(snap: Snapshot) -> list[model.RankSys]:
    """Each rank's latest system sample as its summary row has it (Sys.sample: its
    figures by name; floats to 2 places; not the device, the row has it), by column."""
    samples = [r.sys for r in snap.ranks]
    first = next((x for x in samples if x is not None), None)
    names = [] if first is None else [n for n in first.sample() if n != "device"]
    if not names:
        return [model.RankSys() for _ in samples]
    columns = []
    for name in names:
        values = [None if x is None else getattr(x, name) for x in samples]
        kinds = set(map(type, values))
        if float in kinds:
            if kinds <= {float, type(None)}:
                values = rounded(np.array(values, dtype=float), 2)  # None: NaN, then None
            else:
                values = [_round(v, 2) if isinstance(v, float) else v for v in values]
        columns.append(values)
    row = model.RankSys
    return [row() if x is None else row(**dict(zip(names, values, strict=True)))
            for x, values in zip(samples, zip(*columns, strict=True), strict=True)]


# A step shorter than a microsecond is not a measurement: no rate from it (1000 / 5e-324
# is infinite, and infinity is not JSON).
MIN_RATE_STEP_MS = 1e-3


def _throughputs(step_ms: list[float | None], batch: list[int | None]
                 ) -> list[model.Throughput]:
    """Steps per second from each rank's median step; samples per second where the agent
    saw the DataLoader's batch size (one batch per step; gradient accumulation makes it
    larger). The rates rounded by column."""
    ms = np.array([np.nan if v is None else v for v in step_ms], dtype=float)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        steps = np.where(ms >= MIN_RATE_STEP_MS, 1000.0 / ms, np.nan)  # NaN: no rate
        samples = steps * np.array([np.nan if b is None else b for b in batch], dtype=float)
    rate = model.Throughput
    return [rate(steps_per_s=s, samples_per_s=x, batch_size=b) for s, x, b in zip(
        rounded(steps, 3), rounded(samples, 2), batch, strict=True)]


def _job_throughput(ranks: list[model.Rank]) -> model.Throughput:
    """The job's rate: a synchronous job steps at its median rank's rate; samples add up
    over ranks (when every reporting rank's batch size is known)."""
    live = [t for r in ranks if (t := r.throughput) is not None and t.steps_per_s]
    samples = [t.samples_per_s for t in live]
    return model.Throughput(
        steps_per_s=_round(median([t.steps_per_s for t in live if t.steps_per_s]), 3),
        samples_per_s=(_round(sum(v for v in samples if v is not None), 2)
                       if samples and all(v is not None for v in samples) else None),
        ranks=len(live))


def _timing(snap: Snapshot) -> model.Timing:
    """Which phases could not be timed, on which ranks and why (docs/frameworks.md)."""
    where: dict[tuple[str, str], list[int]] = {}
    for r in snap.ranks:
        for u in r.untimed:
            where.setdefault((u.phase, u.why), []).append(r.rank)
    return model.Timing(complete=not where, framework=snap.framework,
                        untimed=[model.UntimedPhase(phase=phase, why=why, ranks=ranks)
                                 for (phase, why), ranks in sorted(where.items())])


def _thread_cpu(over_run: tuple[float, float] | None) -> dict[str, float | None]:
    """A rank's training thread on a CPU and waiting for one, % of its stepping time."""
    if over_run is None:
        return {"thread_cpu_pct": None, "cpu_wait_pct": None}
    return {"thread_cpu_pct": round(100.0 * over_run[0], 1),
            "cpu_wait_pct": round(100.0 * over_run[1], 1)}


def _hang(snap: Snapshot) -> model.Hang | None:
    """The evidence of a hang that was going on when the snapshot was taken."""
    report = snap.hang
    if report is None:
        return None
    return model.Hang(
        kind=report.kind, ranks=list(report.culprits), since=iso(snap.hang_since),
        stalled_s=round(report.stalled_s, 1), threshold_s=round(report.threshold_s, 1),
        progress=[model.HangProgress(
            rank=r.rank, host=r.host, steps=r.steps, phase=r.heartbeat.phase,
            collectives=r.heartbeat.collectives, in_collective=r.heartbeat.in_collective,
            groups=dict(sorted(r.heartbeat.groups.items())), in_group=r.heartbeat.in_group,
            nccl=None if r.nccl is None else _typed(msgspec.to_builtins(r.nccl), model.Nccl))
            for r in snap.ranks if r.reported],
        # As taken during the hang: a rank woken by the stop (its step closed, its stack
        # cleared) keeps the stacks it had while stuck (state.hang_stacks).
        stacks={str(rank): [model.ThreadStack(thread=name, stack=text)
                            for name, text in stacks]
                for rank, stacks in sorted(
                    {**{r.rank: r.stacks for r in snap.ranks if r.stacks},
                     **snap.hang_stacks}.items())},
    )


# --- text ------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render_text(doc: dict[str, Any] | model.Summary) -> str:
    """A short, human summary of a summary (printed at the end of headless runs): read
    through the typed model, a document converted once at the edge."""
    s = doc if isinstance(doc, model.Summary) else model.from_doc(doc)
    run, d = s.run, s.diagnosis
    failed = s.failure
    lines = [
        *attempt_text.lead(s),  # a restart's failure first: the record holds both
        *([failed.summary] if failed else []),  # failures first (issue 32)
        f"traceml run {run.name}: {run.world_size} rank(s), {run.steps} steps in "
        f"{run.duration_s or 0:.1f} s, exit code {run.exit_code}"
        + ("" if s.complete else "  [INCOMPLETE: built from the last snapshot]"),
        "",
        ("Diagnosis of the steps before it: " if failed else "Diagnosis: ") + d.label
        + _who(d)
        + (f"  phase {d.phase}" if d.phase else "") + f"  [{d.severity}]",
        f"  {d.summary}",
        *cost_lines(s.cost),
        "",
    ]
    pre = s.preflight
    if pre:
        slow = pre.slow or []
        verdict = ("healthy" if pre.healthy else "UNHEALTHY: " + "; ".join(
            [f"node {x['node']} ({x['host']}) slow, {x['ratio']:.0%} of the median"
             for x in slow] + [pre.mtu_mismatch or ""]).strip("; "))
        busbw = pre.all_reduce_busbw_gbps or None
        lines.insert(-1, f"  Preflight (traceml netcheck): {verdict}"
                         + (f"; all_reduce busbw {busbw:.3g} GB/s" if busbw else "")
                         + f" ({pre.path})")
    for u in s.timing.untimed if s.timing else []:
        lines.insert(-1, f"  Not timed: {u.phase} on rank(s) {format_ranks(u.ranks)}: "
                         f"{u.why}.")
    off: dict[str, list[int]] = {}
    for r in s.ranks:
        if r.agent_off:
            off.setdefault(r.agent_off, []).append(r.rank)
    for why, ranks in off.items():
        lines.insert(-1, f"  Agent off on rank(s) {format_ranks(ranks)} (its steps after "
                         f"that are not counted): {why}")
    for line in _agent_lines(s.ranks):
        lines.insert(-1, line)
    silent = s.relays.silent if s.relays else None
    if silent:
        lines.insert(-1, f"  The relay of node(s) {format_ranks(silent)} stopped sending: "
                         f"their ranks' figures end there, not their training (see "
                         f"relay-node<N>.log in that node's run folder).")
    lines[-1:-1] = collective_lines(s.collectives)
    lines[-1:-1] = stall_lines(s.stalls)
    lines[-1:-1] = memory_lines(s.memory)
    phases = s.phases
    blamed = set(d.node.ranks) if d.node else {d.rank}
    head = f"{'rank':>5} {'host':<14} {'steps':>6} {'step':>8} " + " ".join(
        f"{p[:9]:>9}" for p in phases)
    lines += ["Median ms per step over the last window (rank: median of its steps):", head]
    for r in s.ranks:
        cells = " ".join(f"{_ms(q.median if (q := r.phase_ms.get(p)) else None):>9}"
                         for p in phases)
        mark = " <" if r.rank in blamed else ""
        lines.append(f"{r.rank:>5} {r.host[:14]:<14} {r.steps:>6} "
                     f"{_ms(r.step_ms.median):>8} {cells}{mark}")
    hang = s.hang
    if hang and hang.stacks:
        for rank in hang.ranks[:2]:
            threads = hang.stacks.get(str(rank)) or []
            if threads:
                lines += [""] + _stack_lines(rank, threads[0])
    if hang:
        logged = [p for p in hang.progress if p.nccl]
        if logged:  # --nccl-debug: the seed's opCount comparison, done for the user
            lines += ["", "NCCL logs, each rank's last collectives:"]
            for p in logged:
                assert p.nccl is not None
                lines.append(f"  rank {p.rank}: {nccl_log.describe(model.plain(p.nccl))}")
                if p.nccl.unused:
                    lines.append(f"    DDP: {p.nccl.unused[:300]}")
    for r in s.ranks:
        if r.exit_code is not None and r.exit_code < 0 and not r.error:
            lines += ["", f"Rank {r.rank} died: killed by signal {-r.exit_code}"
                          f"{_signal_name(-r.exit_code)} (no exception, no goodbye)."]
    # The rank that failed first leads: the others' errors are usually its consequences
    # (a peer closing the connection in the middle of a collective).
    first = run.failed_rank
    errors = sorted((r for r in s.ranks if r.error), key=lambda r: (r.rank != first, r.rank))
    for r in errors[:2]:
        assert r.error is not None
        tail = r.error.strip().splitlines()[-3:]
        lines += ["", f"Rank {r.rank} failed (exit {r.exit_code}):"] + [
            f"  {t}" for t in tail]
    if s.checks:
        lines += ["", f"Setup checks: {len(s.checks)} finding(s)"]
        for c in s.checks:
            named = ",".join(map(str, c.ranks[:8])) + ("..." if len(c.ranks) > 8 else "")
            lines += [f"  [{c.severity}] {c.id} (rank {named}): {c.evidence}",
                      f"      fix: {c.fix}"]
    episodes = [e for e in s.timeline if e.label not in (dx.WARMUP,)]
    several = bool(s.restarts)
    if len(episodes) > 1:
        lines += ["", "Timeline:"]
        for e in episodes[-10:]:
            who = f" rank {e.rank}" if e.rank is not None else ""
            if e.node is not None:
                who = f" node {e.node}"
            lost = (f"  (cost the job {e.lost_s:.1f} s)" if e.lost_s else "")
            lines.append(f"  {attempt_text.step_range(e, several)}  {e.label}{who}{lost}")
    return "\n".join(lines) + "\n"


# Stalling ranks the summary lists, most time lost first: at 16,384 ranks every rank
# evaluating would be 16,384 rows saying the same thing.
STALLS_LISTED = 32
TEXT_STALLS = 4  # of them, in the text summary


def stalls_json(found: Sequence[StallFinding]) -> list[model.StallRecord]:
    """The `stalls` section: each stalling rank's stall log over the run (judge/stalls.py),
    most time lost first."""
    rows = sorted(found, key=lambda f: (-f.lost_ms, f.rank))[:STALLS_LISTED]
    return [model.StallRecord(
        rank=f.rank, period=f.period, count=f.count,
        periodic_count=f.periodic_count if f.period else 0,
        mean_excess_ms=round(f.periodic_ms, 3), phase=f.phase,
        lost_s=round(f.lost_ms / 1000.0, 3), last_step=f.last_step, recurring=f.recent)
        for f in rows]


def stall_lines(rows: Sequence[model.StallRecord]) -> list[str]:
    """'  Stalls: rank 0 every 20 steps, 14 times, about 241 ms each in wait: 3.4 s lost'."""
    out = []
    for s in rows[:TEXT_STALLS]:
        rhythm = f"every {s.period} steps" if s.period else "irregularly"
        times = s.periodic_count if s.period else s.count
        out.append(f"  Stalls: rank {s.rank} {rhythm}, {times} times, about "
                   f"{s.mean_excess_ms:.0f} ms each in {s.phase}: "
                   f"{s.lost_s:.1f} s lost")
    if len(rows) > TEXT_STALLS:
        out.append(f"  ... {len(rows) - TEXT_STALLS} more stalling ranks in final_summary.json")
    return out

# Collectives listed in the text summary, most exposed first (the JSON has them all).
TEXT_COLLECTIVES = 6


def collective_lines(rows: Sequence[model.Collective]) -> list[str]:
    """Which collective on which group took the sync time, per step of the ranks that
    issued it: '  all_gather on r0,1 (in none): 1.0/step, 64 B, 2.31 ms exposed (40 %)'."""
    if not rows:
        return []
    out = ["  Collectives (per step; exposed wait, share of all sync):"]
    for c in rows[:TEXT_COLLECTIVES]:
        nbytes = c.bytes_per_step
        size = "" if nbytes is None else f", {si_bytes(nbytes)}"
        share = c.share_of_sync
        where = "outside phases" if c.phase == "none" else f"in {c.phase}"
        out.append(f"    {c.op} on group {c.group} ({where}): "
                   f"{c.count_per_step:.3g} call(s){size}, "
                   f"{c.exposed_ms_per_step:.2f} ms exposed"
                   + ("" if share is None else f" ({share:.0%} of sync)"))
    if len(rows) > TEXT_COLLECTIVES:
        out.append(f"    ... {len(rows) - TEXT_COLLECTIVES} more in final_summary.json")
    return out


def _agent_lines(ranks: Sequence[model.Rank]) -> list[str]:
    """What the agents could not show as steps or time, and what the collector refused,
    each said once with its ranks."""
    said: dict[str, list[int]] = {}
    for r in ranks:
        if r.steps_hidden:
            said.setdefault(f"{r.steps_hidden} (hang detection suspended)",
                            []).append(r.rank)
        if r.device_rule:
            said.setdefault(f"timed on the device chosen by: {r.device_rule}",
                            []).append(r.rank)
    out = [f"  Rank(s) {format_ranks(rs)}: {what}." for what, rs in list(said.items())[:6]]
    bad = [(r.rank, r.bad_records) for r in ranks if r.bad_records]
    if bad:
        out.append(f"  The collector refused {sum(n for _, n in bad)} malformed step "
                   f"record(s) of rank(s) {format_ranks([rank for rank, _ in bad])} (the "
                   f"agents counted them as sent; their batches' other steps were kept).")
    return out


def cost_lines(c: model.Cost | None) -> list[str]:
    """The cost section in words: what the problem takes from every step, what the run
    lost to it, and the step the job would have without it."""
    if not c:
        return []
    out = []
    w = c.what_if
    if w:
        out.append(f"  Cost: {w.saving_ms:.1f} ms of every {w.now_step_ms:.1f} ms step "
                   f"({w.share:.0%}). Without it: {w.step_ms:.1f} ms per step, "
                   f"{w.speedup:.2f}x faster ({w.reasoning.rstrip('.')}).")
        if w.weak:
            out.append(f"  The estimate is weak: {w.weak}.")
    if c.lost_s:
        share = f", {c.lost_share:.0%} of the run" if c.lost_share is not None else ""
        out.append(f"  The run lost {c.lost_s:.1f} s to it{share}: "
                   f"{c.gpu_hours_lost:.3g} {c.hours_unit}-hours.")
    return out


def _stack_lines(rank: int, thread: model.ThreadStack) -> list[str]:
    """A rank's stack in a few lines: the innermost calls of its own (Python, innermost
    last), or of a stack taken from outside (py-spy: the main thread, innermost first)."""
    text = thread.stack.rstrip().splitlines()
    if thread.thread.startswith("native"):
        start = next((i + 1 for i, t in enumerate(text) if "MainThread" in t), 0)
        calls = [t.strip() for t in text[start:start + 8] if t.startswith("    ")]
        return [f"Rank {rank}, taken from outside (py-spy --native), innermost call "
                f"first:"] + [f"  {t}" for t in calls]
    return [f"Rank {rank}, {thread.thread}, innermost call last:"] + [
        f"  {t}" for t in text[-6:]]


def _signal_name(signum: int) -> str:
    import signal

    try:
        return f" ({signal.Signals(signum).name})"
    except ValueError:
        return ""


# --- files -----------------------------------------------------------------------------


def to_json(doc: dict[str, Any] | model.Summary, indent: int = 0) -> str:
    """A summary document as JSON text, written through the model (summary_model.py: a field of
    the wrong type fails here, not in a reader), by msgspec (C: ~10x faster than the json
    module on 16,384 ranks' rows). A NaN that slipped through becomes null."""
    return model.encode(doc, indent).decode() + "\n"


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cycle collector paused while a summary is built and encoded: the document
    is tens of thousands of fresh containers, none in a cycle, and the collections their
    allocations trigger traverse all of them again and again (at 4,096 ranks over a third
    of the live file's CPU). Reference counting frees them all."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def write_summary(run_dir: Path, doc: dict[str, Any] | model.Summary) -> Path:
    """final_summary.json and its text, both from the model (a document converted once)."""
    s = doc if isinstance(doc, model.Summary) else model.from_doc(doc)
    folder = RunFolder(Path(run_dir))
    write_atomic(folder.summary_json, to_json(s, indent=2))
    write_atomic(folder.summary_txt, render_text(s))
    return folder.summary_json
