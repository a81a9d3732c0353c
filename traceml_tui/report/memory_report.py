"""The summary's `memory` section and its lines in the text summary (judge/memory.py
reads the series; docs/diagnosis.md, "Memory growth").

Ranks are listed worst first: those whose memory grows (fastest first), then the others
by their host memory's rate; at most MEMORY_LISTED of them, so that 16,384 ranks that
all hold steady do not make 16,384 rows saying so.
"""

from __future__ import annotations

from collections.abc import Sequence

from traceml_agent.vocab import format_ranks
from traceml_tui.judge.memory import MemoryTrend, growth_sentence, imbalance_of, worst_first
from traceml_tui.runfolder.summary_model import Memory, MemoryImbalance, MemoryRank

MEMORY_LISTED = 32
TEXT_GROWING = 4  # growing ranks named in the text summary


def _r(v: float | None, nd: int = 1) -> float | None:
    return None if v is None else round(v, nd)


def memory_json(trends: Sequence[MemoryTrend]) -> Memory:
    """The `memory` section: the growing ranks, the imbalance, the rows worst first."""
    rows = sorted(trends, key=worst_first)[:MEMORY_LISTED]
    over = imbalance_of(tuple(trends))
    return Memory(
        growing=sorted(t.rank for t in trends if t.growing),
        imbalance=None if over is None else MemoryImbalance(
            rank=over[0], rss_mb=round(over[1], 1), others_median_mb=round(over[2], 1),
            ratio=round(over[1] / over[2], 2) if over[2] > 0 else None),
        ranks=[MemoryRank(
            rank=t.rank, rss_mb=_r(t.rss_mb), rss_peak_mb=_r(t.rss_peak_mb),
            rss_rate_mb_min=_r(t.rss_rate_mb_min), gpu_mb=_r(t.gpu_mb),
            gpu_rate_mb_min=_r(t.gpu_rate_mb_min), growing=t.growing,
            rise_mb=_r(t.rise_mb), headroom_mb=_r(t.headroom_mb),
            limit_in_s=_r(t.limit_in_s, 0)) for t in rows])


def memory_lines(doc: Memory | None) -> list[str]:
    """'  Memory growing: rank 1's host memory grew 300 MB (+610 MB/min); about 37 min
    left before its limit', the imbalance, or one line saying every rank held steady."""
    if not doc or not doc.ranks:
        return []
    rows = doc.ranks
    out = []
    for r in [r for r in rows if r.growing][:TEXT_GROWING]:
        t = MemoryTrend(rank=r.rank, rss_mb=r.rss_mb, rss_peak_mb=r.rss_peak_mb,
                        rss_rate_mb_min=r.rss_rate_mb_min, gpu_mb=r.gpu_mb,
                        gpu_rate_mb_min=r.gpu_rate_mb_min, growing=r.growing,
                        rise_mb=r.rise_mb, headroom_mb=r.headroom_mb,
                        limit_in_s=r.limit_in_s)
        whose = f"rank {r.rank}'s"
        out.append(f"  Memory growing: {growth_sentence(t, whose)}")
    growing = doc.growing
    if len(growing) > TEXT_GROWING:
        out.append(f"  ... memory grows on {len(growing)} ranks ({format_ranks(growing)})")
    over = doc.imbalance
    if over:
        ratio = f"{over.ratio:.1f}x" if over.ratio else "more than"
        out.append(f"  Memory imbalance: rank {over.rank} holds {over.rss_mb:.0f} MB, "
                   f"{ratio} the others' median ({over.others_median_mb:.0f} MB)")
    rss = [r.rss_mb for r in rows if r.rss_mb is not None]
    if not out and rss:
        judged = all(r.rss_rate_mb_min is not None for r in rows)
        what = "steady on every rank" if judged else "too few samples for a trend"
        out.append(f"  Memory: {what} (host RSS {min(rss):.0f}-{max(rss):.0f} MB)")
    return out
