"""One rank's frozen row of a snapshot (snapshot.RankSnapshot), from the intake's
per-rank state and the columns the state computed for every rank at once (its live
timings, its CPU shares, in a full snapshot its whole window)."""

from __future__ import annotations

from collections.abc import Mapping

from .ingest import RankState
from .snapshot import PhaseRow, RankSnapshot, WholeWindow
from .timings import Untimed
from .windows import Quantiles


def rank_snapshot(rank: int, rs: RankState | None, nproc_per_node: int,
                  hidden: Mapping[int, str], mono_now: float, whole: WholeWindow | None,
                  untimed: tuple[Untimed, ...] | None,
                  none: Mapping[str, Quantiles | None], cols: dict[str, int],
                  lives: tuple[list[float], list[list[float]], list[str],
                               Mapping[int, tuple[Untimed, ...]]],
                  cpu: tuple[list[float], tuple[list[float], list[float]] | None]
                  ) -> RankSnapshot:
    """One rank's frozen row (`rs` None: a rank not heard from). `hidden`: rank -> why
    its steps are not visible (hang.hidden); `whole`, `untimed`: the whole-window
    statistics, in a full snapshot; `none`: every phase unmeasured; `cols`: phase -> its
    column in `whole`; `lives`: the live columns (timings.Columns: step medians, phase
    medians, their phases, untimed); `cpu`: every rank's training-thread CPU shares
    (timings.ThreadCpu: recent wait, then run and wait over the run, in a full snapshot;
    NaN: not read)."""
    if rs is None:
        return RankSnapshot(
            rank=rank, local_rank=rank % nproc_per_node,
            node=rank // nproc_per_node, host="", pid=0, reported=False, steps=0,
            window_steps=0, step_ms=None, phase_ms=none,
            live_step_ms=None, live_phase_ms={}, recent_step_ms=(), sys=None, idle_s=None,
            since_step_s=None, exit_code=None, error=None, finished=False, dropped=0,
            device="")
    live_step = lives[0][rank]
    # Over the whole window for the summary's verdict, as its medians are.
    row = None if whole is None else whole.rows.get(rank)
    step, phase_ms = ((None, none) if whole is None or row is None
                      else (whole.step(row), PhaseRow(whole, row, cols)))
    return RankSnapshot(
        rank=rank, local_rank=rs.ident.local_rank, node=rs.ident.node, host=rs.ident.host,
        pid=rs.ident.pid, reported=True, steps=rs.steps, window_steps=rs.window.count,
        step_ms=step, phase_ms=phase_ms,
        live_step_ms=None if live_step != live_step else live_step,
        live_phase_ms={p: None if v != v else v
                       for p, v in zip(lives[2], lives[1][rank], strict=True)},
        recent_step_ms=(),
        sys=rs.sys, idle_s=max(0.0, mono_now - rs.last_seen),
        since_step_s=max(0.0, mono_now - rs.last_step_at) if rs.steps else None,
        exit_code=rs.exit_code,
        error=rs.error, finished=rs.finished, dropped=rs.dropped, device=rs.device,
        heartbeat=rs.heartbeat, stacks=rs.stacks,
        untimed=lives[3].get(rank, ()) if whole is None else untimed or (), nccl=rs.nccl,
        bad_records=rs.bad_records, steps_hidden=hidden.get(rs.ident.rank),
        cpu_wait=None if (wait := cpu[0][rank]) != wait else wait,  # NaN: not read
        cpu_over_run=None if (over := cpu[1]) is None or (ran := over[0][rank]) != ran
        else (ran, over[1][rank]))
