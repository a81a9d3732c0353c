"""A bounded on-disk log of every rank's step records, so a timeline can be exported
after the run (traceml_tui/report/perfetto.py) even though the collector keeps only windows.

The collector appends records as batches arrive. They go to an append-only msgpack
stream, buffered in memory and written at most once a second (FLUSH_INTERVAL_S),
when the buffer reaches its cap, or on close. Disk and memory stay bounded however
long the run: the log is two files, ``steps.0.msgpack`` and ``steps.1.msgpack``;
when the current one would pass half the byte budget, the other is truncated and
becomes current. The newest records are always kept; the oldest half is given up.

A disk error never reaches the collector: the writer counts it, stops writing and
carries on as a no-op. The reader tolerates a truncated last record (a collector
killed mid-write) and skips what it cannot parse.

Stream format (each item one msgpack array):
  [0, FORMAT_VERSION, generation]       file header; generations order the two files
  [1, table_id, [phase names]]          a phase-name table, declared before first use
  [2, rank, step, t_end, step_ms, table_id, [phase_ms or nil, ...]]
  [3, table_id, ranks, steps, t_end, step_ms, phase_ms]   records as columns: packed
                                        little-endian arrays (int64, int64, float64 x 3,
                                        phase_ms len(table) per record, NaN for nil)
Every file re-declares all tables after its header, so each file reads on its own.
Columns are what the collector writes for a relay's columns (judge/ingest_columns.py):
one item for hundreds of records, where packing each record cost ~1 us of node 0's time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from traceml_agent.protocol import StepRecord
from traceml_tui.runfolder import folders

FORMAT_VERSION = 1
FILE_NAMES = ("steps.0.msgpack", "steps.1.msgpack")
# ~85 bytes a record with 7 phases: 256 MiB keeps the last 1.5-3 million records, hours of a
# 1,000-rank job at 1 step/s, days of a small one.
DEFAULT_BUDGET_BYTES = 256 << 20
FLUSH_INTERVAL_S = 1.0  # one write a second is invisible next to ingest
# Between flushes the buffer never holds more than this (memory bound at any ingest rate);
# a budget/8 cap also keeps a small budget's files to several writes each.
MAX_BUFFER_BYTES = 4 << 20
# Distinct phase-name tuples a log holds; agents send one tuple each, so this is plenty.
MAX_PHASE_TABLES = 4096

_HEADER, _TABLE, _STEP, _COLUMNS = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class LoggedStep:
    rank: int
    step: int
    t_end: float  # epoch seconds at the end of the step
    step_ms: float
    phases: tuple[str, ...]
    phase_ms: tuple[float | None, ...]  # None: not measured on this step


# --- writing ---------------------------------------------------------------------------


class StepLogWriter:
    """Append-only, bounded, never raising on disk errors. Not thread-safe: one owner."""

    def __init__(self, directory: str | Path, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 flush_interval_s: float = FLUSH_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = Path(directory)
        self.half_budget = max(budget_bytes // 2, 1)
        self.max_buffer = min(MAX_BUFFER_BYTES, max(budget_bytes // 8, 1))
        self.flush_interval_s = flush_interval_s
        self.clock = clock
        self.errors = 0  # disk errors (the first one disables the writer)
        self.dropped = 0  # records not logged: writer disabled, unpackable, or table cap
        self.records = 0  # records written to disk
        self.rotations = 0
        self.disabled = False
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._tables: dict[tuple[str, ...], int] = {}
        self._buf = bytearray()
        self._buffered = 0  # records in _buf
        self._file: Any = None
        self._dir: int | None = None  # the folder's descriptor: rotation reopens through it
        self._size = 0
        self._last_flush = clock()
        try:
            # Reached through the run folder's pinned descriptor (folders.open_dir) and
            # kept: after a swap of a shared --out, a rotation by path would write into
            # another user's folder.
            self._dir = folders.open_dir(self.directory, create=True)
            gens = [_generation(name, self._dir) for name in FILE_NAMES]
            # Continue an existing log: keep its newest file, start the next generation
            # in the other one.
            newest = max(range(2), key=lambda i: g if (g := gens[i]) is not None else -1)
            generation = gens[newest]
            if generation is None:
                self._open(0, 0)
            else:
                self._open(1 - newest, generation + 1)
        except OSError:
            self._fail()

    def __enter__(self) -> StepLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- appending (the hot path) -------------------------------------------------------

    def append_records(self, rank: int, phases: tuple[str, ...],
                       records: Iterable[StepRecord]) -> None:
        """Log one validated batch of a rank (a protocol "steps" message's records)."""
        if self.disabled:
            self.dropped += sum(1 for _ in records)
            return
        table = self._tables.get(phases)
        if table is None and (table := self._declare(phases)) is None:
            self.dropped += sum(1 for _ in records)
            return
        buf, pack = self._buf, self._pack
        n = 0
        try:
            for rec in records:
                buf += pack((_STEP, rank, rec.step, rec.t_end, rec.step_ms, table,
                             rec.phase_ms))
                n += 1
        except (TypeError, ValueError, OverflowError):
            self.dropped += 1  # a value msgpack cannot encode; the rest of the batch is lost
        self._buffered += n
        self.flush_if_due()

    def append_columns(self, phases: tuple[str, ...], rank: np.ndarray, step: np.ndarray,
                       t_end: np.ndarray, step_ms: np.ndarray, values: np.ndarray) -> None:
        """Log validated records of one phase list as columns (values: records x phases,
        NaN where a phase was not measured), in the order they came."""
        n = len(rank)
        if self.disabled:
            self.dropped += n
            return
        table = self._tables.get(phases)
        if table is None and (table := self._declare(phases)) is None:
            self.dropped += n
            return
        self._buf += self._pack((_COLUMNS, table, rank.astype("<i8").tobytes(),
                                 step.astype("<i8").tobytes(), t_end.astype("<f8").tobytes(),
                                 step_ms.astype("<f8").tobytes(),
                                 values.astype("<f8").tobytes()))
        self._buffered += n
        self.flush_if_due()

    def append(self, rank: int, step: int, t_end: float, step_ms: float,
               phases: Sequence[str], phase_ms: Sequence[float | None]) -> None:
        """Log one record (convenience; the collector uses `append_records`)."""
        self.append_records(rank, tuple(phases),
                            (StepRecord(step, t_end, step_ms, tuple(phase_ms)),))

    def flush_if_due(self) -> None:
        """Write the buffer if a flush interval has passed or it reached its cap. The
        collector calls this from its tick too, so records do not wait for the next batch."""
        if self._buf and (len(self._buf) >= self.max_buffer
                          or self.clock() - self._last_flush >= self.flush_interval_s):
            self.flush()

    def flush(self) -> None:
        self._last_flush = self.clock()
        if not self._buf or self.disabled:
            return
        data = self._buf
        try:
            if self._size + len(data) > self.half_budget and self._size > self._preamble_size:
                self._rotate()
            self._file.write(data)
            self._file.flush()  # to the OS now: a killed collector loses at most the buffer
        except OSError:
            self._fail()
            return
        self._size += len(data)
        self.records += self._buffered
        self._buf, self._buffered = bytearray(), 0

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                self.errors += 1
            self._file = None
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None
        self.disabled = True

    # --- files --------------------------------------------------------------------------

    def _declare(self, phases: tuple[str, ...]) -> int | None:
        if len(self._tables) >= MAX_PHASE_TABLES:
            return None
        table = self._tables[phases] = len(self._tables)
        self._buf += self._pack((_TABLE, table, list(phases)))
        return table

    def _open(self, index: int, generation: int) -> None:
        # Buffered records may use any table declared so far: re-declare them all.
        preamble = self._pack((_HEADER, FORMAT_VERSION, generation)) + b"".join(
            self._pack((_TABLE, t, list(p))) for p, t in self._tables.items())
        # 0600, never through a link planted where the file goes (docs/security.md).
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        self._file = os.fdopen(os.open(FILE_NAMES[index], flags, 0o600, dir_fd=self._dir), "wb")
        self._file.write(preamble)
        self._file.flush()
        self._index, self._generation = index, generation
        self._size = self._preamble_size = len(preamble)

    def _rotate(self) -> None:
        self._file.close()
        self._file = None
        self._open(1 - self._index, self._generation + 1)
        self.rotations += 1

    def _fail(self) -> None:
        self.errors += 1
        self.disabled = True
        self.dropped += self._buffered
        self._buf, self._buffered = bytearray(), 0
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


# --- reading ---------------------------------------------------------------------------


def _header(item: Any) -> int | None:
    if (isinstance(item, list) and len(item) == 3 and item[0] == _HEADER
            and item[1] == FORMAT_VERSION and type(item[2]) is int):
        return item[2]
    return None


def _generation(name: str, dir_fd: int | None) -> int | None:
    """The generation in a log file's header; None if it is missing or not a step log."""
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            return _header(next(msgpack.Unpacker(f, raw=False), None))
    except (OSError, ValueError, msgpack.UnpackException):
        return None


def _log_files(directory: str | Path) -> list[Path]:
    """The step log's files, oldest generation first."""
    directory = Path(directory)
    files = [(g, directory / name) for name in FILE_NAMES
             if (g := _generation(str(directory / name), None)) is not None]
    return [path for _, path in sorted(files)]


def read_steps(directory: str | Path) -> Iterator[LoggedStep]:
    """Every logged record, oldest file first, in the order they were appended."""
    for path in _log_files(directory):
        yield from _read_file(path)


def _read_file(path: Path) -> Iterator[LoggedStep]:
    tables: dict[int, tuple[str, ...]] = {}
    try:
        with open(path, "rb") as f:
            # Iteration simply stops at a truncated last record.
            for item in msgpack.Unpacker(f, raw=False, strict_map_key=True):
                if not isinstance(item, list) or not item:
                    continue
                if item[0] == _STEP and len(item) == 7:
                    step = _step(item, tables)
                    if step is not None:
                        yield step
                elif item[0] == _COLUMNS and len(item) == 7:
                    yield from _columns(item, tables)
                elif (item[0] == _TABLE and len(item) == 3 and isinstance(item[2], list)
                      and all(isinstance(n, str) for n in item[2])):
                    tables[item[1]] = tuple(item[2])
    except (OSError, ValueError, msgpack.UnpackException):
        return  # unreadable or corrupt from here on: what was read stands


def _step(item: list, tables: dict[int, tuple[str, ...]]) -> LoggedStep | None:
    _, rank, step, t_end, step_ms, table, phase_ms = item
    phases = tables.get(table) if type(table) is int else None
    if (phases is None or type(rank) is not int or type(step) is not int
            or not isinstance(t_end, (int, float)) or not isinstance(step_ms, (int, float))
            or not isinstance(phase_ms, list) or len(phase_ms) != len(phases)
            or not all(v is None or isinstance(v, (int, float)) for v in phase_ms)):
        return None
    return LoggedStep(rank, step, float(t_end), float(step_ms), phases, tuple(phase_ms))


def _columns(item: list, tables: dict[int, tuple[str, ...]]) -> Iterator[LoggedStep]:
    _, table, *arrays = item
    phases = tables.get(table) if type(table) is int else None
    if phases is None or not all(isinstance(a, bytes) for a in arrays):
        return
    n = len(arrays[0]) // 8
    if any(len(a) != 8 * n for a in arrays[:4]) or len(arrays[4]) != 8 * n * len(phases):
        return
    rank, step = (np.frombuffer(a, "<i8").tolist() for a in arrays[:2])
    t_end, step_ms = (np.frombuffer(a, "<f8").tolist() for a in arrays[2:4])
    values = np.frombuffer(arrays[4], "<f8").reshape(n, len(phases)).tolist()
    for i in range(n):
        yield LoggedStep(rank[i], step[i], t_end[i], step_ms[i], phases,
                         tuple(None if v != v else v for v in values[i]))


# --- reading as columns (a big log, read without an object per record) ------------------


@dataclass(frozen=True, slots=True)
class StepColumns:
    """Logged records of one phase list, in the order they were appended, as arrays."""

    phases: tuple[str, ...]
    rank: np.ndarray  # int64
    step: np.ndarray  # int64
    t_end: np.ndarray  # float64
    step_ms: np.ndarray  # float64
    values: np.ndarray  # float64, records x phases; NaN: not measured

    def __len__(self) -> int:
        return len(self.rank)


# Single records (the collector's per-rank batches) gathered into one StepColumns at most.
COLUMN_RECORDS = 4096


def read_columns(directory: str | Path) -> Iterator[StepColumns]:
    """Every logged record, as `read_steps` gives them, in columns: a columns item as it
    is, runs of single records of one phase list gathered (COLUMN_RECORDS at most)."""
    for path in _log_files(directory):
        yield from _read_file_columns(path)


def _read_file_columns(path: Path) -> Iterator[StepColumns]:
    tables: dict[int, tuple[str, ...]] = {}
    run: list[LoggedStep] = []
    try:
        with open(path, "rb") as f:
            for item in msgpack.Unpacker(f, raw=False, strict_map_key=True):
                if not isinstance(item, list) or not item:
                    continue
                if item[0] == _STEP and len(item) == 7:
                    step = _step(item, tables)
                    if step is None:
                        continue
                    if run and (step.phases != run[0].phases or len(run) >= COLUMN_RECORDS):
                        yield _gathered(run)
                        run = []
                    run.append(step)
                    continue
                if run:
                    yield _gathered(run)
                    run = []
                if item[0] == _COLUMNS and len(item) == 7:
                    cols = _column_arrays(item, tables)
                    if cols is not None:
                        yield cols
                elif (item[0] == _TABLE and len(item) == 3 and isinstance(item[2], list)
                      and all(isinstance(n, str) for n in item[2])):
                    tables[item[1]] = tuple(item[2])
    except (OSError, ValueError, msgpack.UnpackException):
        pass  # unreadable or corrupt from here on: what was read stands
    if run:
        yield _gathered(run)


def _gathered(run: list[LoggedStep]) -> StepColumns:
    nan = float("nan")
    return StepColumns(
        run[0].phases, np.array([s.rank for s in run], np.int64),
        np.array([s.step for s in run], np.int64), np.array([s.t_end for s in run], np.float64),
        np.array([s.step_ms for s in run], np.float64),
        np.array([[nan if v is None else v for v in s.phase_ms] for s in run],
                 np.float64).reshape(len(run), len(run[0].phases)))


def _column_arrays(item: list, tables: dict[int, tuple[str, ...]]) -> StepColumns | None:
    _, table, *arrays = item
    phases = tables.get(table) if type(table) is int else None
    if phases is None or not all(isinstance(a, bytes) for a in arrays):
        return None
    n = len(arrays[0]) // 8
    if any(len(a) != 8 * n for a in arrays[:4]) or len(arrays[4]) != 8 * n * len(phases):
        return None
    rank, step = (np.frombuffer(a, "<i8") for a in arrays[:2])
    t_end, step_ms = (np.frombuffer(a, "<f8") for a in arrays[2:4])
    return StepColumns(phases, rank, step, t_end, step_ms,
                       np.frombuffer(arrays[4], "<f8").reshape(n, len(phases)))
