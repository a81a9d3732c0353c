"""step_log: round trip, rotation within the byte budget, flush cadence, truncated and corrupt
files, disk errors that disable the writer instead of raising."""

from __future__ import annotations

import os

import pytest

from traceml_agent.protocol import PHASES, StepRecord
from traceml_tui.runfolder.step_log import FILE_NAMES, LoggedStep, StepLogWriter, read_steps

SEVEN = (1.0, None, 3.0, 4.0, 0.5, 2.0, 0.25)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def records(n: int, start: int = 0) -> list[StepRecord]:
    return [StepRecord(i, 1.79e9 + i, 10.0 + i, SEVEN) for i in range(start, start + n)]


def test_round_trip_keeps_order_phases_and_nones(tmp_path):
    with StepLogWriter(tmp_path) as log:
        log.append_records(0, PHASES, records(3))
        log.append_records(5, ("dataloader", "compute"), [StepRecord(7, 1.8e9, 4.5, (None, 4.5))])
        log.append(1, 9, 1.81e9, 2.0, ("dataloader", "compute"), [1.0, 1.0])
    assert (log.records, log.dropped, log.errors) == (5, 0, 0)
    got = list(read_steps(tmp_path))
    assert got[:3] == [LoggedStep(0, i, 1.79e9 + i, 10.0 + i, PHASES, SEVEN) for i in range(3)]
    assert got[3:] == [LoggedStep(5, 7, 1.8e9, 4.5, ("dataloader", "compute"), (None, 4.5)),
                       LoggedStep(1, 9, 1.81e9, 2.0, ("dataloader", "compute"), (1.0, 1.0))]


def test_flushes_at_most_once_per_interval_and_on_close(tmp_path):
    clock = FakeClock()
    log = StepLogWriter(tmp_path, clock=clock)
    current = tmp_path / FILE_NAMES[0]
    preamble = current.stat().st_size
    log.append_records(0, PHASES, records(10))
    assert current.stat().st_size == preamble and list(read_steps(tmp_path)) == []
    clock.t += 0.5
    log.append_records(0, PHASES, records(10, 10))
    assert current.stat().st_size == preamble  # half a second: still buffered
    clock.t += 0.6
    log.flush_if_due()  # the collector's tick, with no new batch
    assert len(list(read_steps(tmp_path))) == 20
    log.append_records(0, PHASES, records(1, 20))
    log.close()
    assert len(list(read_steps(tmp_path))) == 21 and log.records == 21


def test_rotation_keeps_disk_within_budget_and_the_newest_records(tmp_path):
    budget = 64 * 1024
    clock = FakeClock()
    log = StepLogWriter(tmp_path, budget_bytes=budget, clock=clock)
    total = 0
    for _ in range(300):  # ~85 bytes a record: ~2.5 MB in all, ~40 budgets
        log.append_records(total % 4, PHASES, records(100, total))
        total += 100
        clock.t += 1.0
        sizes = [(tmp_path / n).stat().st_size for n in FILE_NAMES if (tmp_path / n).exists()]
        assert sum(sizes) <= budget
        assert all(s <= budget // 2 for s in sizes)
    log.close()
    assert log.rotations >= 30 and log.errors == 0
    kept = [r.step for r in read_steps(tmp_path)]
    # In order, ending with the last record, and at least half a budget's worth of them.
    assert kept == list(range(kept[0], total))
    assert len(kept) * 85 >= budget // 2 - 1024


def test_a_new_writer_continues_an_existing_log(tmp_path):
    with StepLogWriter(tmp_path) as log:
        log.append_records(0, PHASES, records(3))
    with StepLogWriter(tmp_path) as log:
        log.append_records(0, PHASES, records(2, 3))
    assert [r.step for r in read_steps(tmp_path)] == [0, 1, 2, 3, 4]


def test_truncated_last_record_is_skipped(tmp_path):
    with StepLogWriter(tmp_path) as log:
        log.append_records(2, PHASES, records(5))
    path = tmp_path / FILE_NAMES[0]
    data = path.read_bytes()
    for cut in range(1, 40):  # a collector killed anywhere inside the last record
        path.write_bytes(data[:-cut])
        got = list(read_steps(tmp_path))
        assert [r.step for r in got] == [0, 1, 2, 3]


def test_garbage_is_skipped_not_raised(tmp_path):
    with StepLogWriter(tmp_path) as log:
        log.append_records(0, PHASES, records(2))
    path = tmp_path / FILE_NAMES[0]
    with open(path, "ab") as f:
        f.write(b"\x93\x02\x01\x02")  # a well-formed item of the wrong shape
        f.write(b"\xc1garbage")  # 0xc1 is never valid msgpack
    (tmp_path / FILE_NAMES[1]).write_bytes(b"not a step log")
    assert [r.step for r in read_steps(tmp_path)] == [0, 1]
    assert list(read_steps(tmp_path / "missing")) == []


def test_disk_errors_disable_the_writer_and_never_raise(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    log = StepLogWriter(blocker / "log")  # a directory under a file: cannot be made
    log.append_records(0, PHASES, records(4))
    log.close()
    assert (log.disabled, log.errors, log.dropped, log.records) == (True, 1, 4, 0)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_mid_run_disables_the_writer(tmp_path):
    log = StepLogWriter(tmp_path)
    log.append_records(0, PHASES, records(3))
    log.flush()
    log._file.close()
    log._file = open("/dev/full", "wb")  # every write now fails with ENOSPC
    log.append_records(0, PHASES, records(5, 3))
    log.flush()
    log.append_records(0, PHASES, records(2, 8))
    log.close()
    assert (log.disabled, log.errors, log.records, log.dropped) == (True, 1, 3, 7)
    assert [r.step for r in read_steps(tmp_path)] == [0, 1, 2]


def test_unencodable_values_are_dropped_and_counted(tmp_path):
    with StepLogWriter(tmp_path) as log:
        log.append_records(0, ("a",), [StepRecord(0, 1.0, 1.0, (object(),))])
        log.append_records(0, ("a",), [StepRecord(1, 2.0, 1.0, (1.0,))])
    assert log.dropped == 1
    assert [r.step for r in read_steps(tmp_path)] == [1]
