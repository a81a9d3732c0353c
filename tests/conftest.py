"""The suite leaks nothing: a process a test started that is still alive when the session
ends fails the run, named with the test that started it, and is killed.

Orphans are reparented to init and are no longer anyone's children, so every process a
test starts is marked instead: the session's id and the running test's id are put in
our environment, which every child inherits (through torchrun, tmux, `script`, a
collector in a session of its own). At the end /proc is read for the session's mark.
Children forked without exec keep their parent's original environment, so our own
descendants are also noted after each test. A process meant to outlive the session (a
system daemon a test starts, e.g. munged) is started without the mark (`unmarked_env`).

End-to-end tests (real jobs) carry the `e2e` marker, so `-m "not e2e"` is the quick loop;
under pytest-xdist a test marked `alone` (it compares timings) runs with no other test
beside it, or, asked for (TRACEML_TEST_CGROUP=1, as root), in a CPU cgroup of its own that
outweighs the others beside it, which run only on the CPU it leaves idle (see `_turn`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import psutil
import pytest

SESSION_VAR = "TRACEML_TEST_SESSION"
TEST_VAR = "TRACEML_TEST_ID"
# Processes still winding down when the last test returns (a job's collector writing its
# record, a SIGTERMed daemon) get this long to go; a leak is one still there after it.
GRACE_VAR = "TRACEML_TEST_LEAK_GRACE_S"  # seconds, to change it (the leak check's own test)
LEAK_GRACE_S = float(os.environ.get(GRACE_VAR, "10"))
SESSION = uuid.uuid4().hex
_descendants: dict[tuple[int, float], str] = {}  # (pid, start time) -> the test it ran in
_current = ""


def unmarked_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment without the leak mark, for a process meant to outlive the suite."""
    return {k: v for k, v in (os.environ if env is None else env).items()
            if k not in (SESSION_VAR, TEST_VAR)}


def pytest_addoption(parser: pytest.Parser) -> None:
    """The GPU suite's time budget (tests/gpu/conftest.py reads it; declared here, where
    pytest reads options, whichever folder it is given)."""
    parser.addoption("--gpu-budget-s", type=float, default=None, metavar="S",
                     help="GPU suite: run the most telling GPU tests first and only as "
                          "many as fit S seconds by their estimates (docs/gpu-validation.md)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under `-m gpu`, only tests/gpu is collected: every GPU test lives there
    (test_gpu_suite.py checks it), and a GPU box holding only the product's runtime wheels
    and pytest lacks the test extra (hypothesis, prometheus_client) that 8 other modules
    import at module level, which stopped the collection before any GPU test ran."""
    if config.option.markexpr.strip() != "gpu" or collection_path.is_dir():
        return None
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return GPU_DIR not in collection_path.parents
    return None


GPU_DIR = Path(__file__).resolve().parent / "gpu"


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SESSION_VAR] = SESSION
    # pytest-xdist's loadfile hands out files in the order of the collection (see
    # pytest_collection_modifyitems), not its default of the most tests first: that put
    # the end-to-end files, a few long tests each, last, and the run ended on one of them
    # while the other workers idled.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# Every test in tests/e2e/ starts a real job (`traceml run`, torchrun): marked e2e here
# whatever its module says, so `-m "not e2e"` and `--ignore=tests/e2e` leave the same tests.
E2E_DIR = Path(__file__).parent / "e2e"


# What a file costs, to hand out the costliest first: its wall time in the whole suite (3
# workers on 2 cores, 2026-11-26; files over 10 s), else (and for a file of jobs under -m
# or -k, which may leave part of it) an estimate: a test that starts a real job about
# E2E_S seconds (mostly its processes' start-up), one that starts none UNIT_S. By count
# alone, files of a few slow tests that start no job went last and ended the run alone
# while the other workers idled (test_phase_table.py, 2 tests, 22 s, was the last file
# of the suite), and files of many short jobs (test_faults.py) went first.
E2E_S = 15.0
UNIT_S = 0.07
FILE_S = {
    "test_e2e_multinode.py": 190, "test_e2e_frameworks.py": 150,
    "test_checks_examples.py": 155, "test_e2e_diagnosis.py": 153, "test_faults.py": 145,
    "test_e2e_hang.py": 116, "test_e2e_hang_record.py": 102, "test_netcheck.py": 100,
    "test_e2e_cost.py": 93, "test_terminal.py": 76, "test_e2e_run.py": 73,
    "test_slurm_real.py": 72, "test_e2e_watch.py": 65, "test_fuzz_collector.py": 45,
    "test_snapshots.py": 36, "test_e2e_episodes.py": 32, "test_security_collector.py": 32,
    "test_e2e_capture.py": 31, "test_web_view.py": 28, "test_slurm.py": 27,
    "test_dashboard.py": 25, "test_native_stacks.py": 24, "test_e2e_stalls.py": 24,
    "test_phase_table.py": 22, "test_e2e_explicit_api.py": 20, "test_metrics.py": 18,
    "test_layers.py": 18, "test_web_lock.py": 14, "test_e2e_fsdp.py": 25,
    "test_run_folders.py": 13, "test_relay.py": 12, "test_handover_exit.py": 12,
    # Files of 2026-11-27/28 (fresh-clone run 3, a loaded machine: scaled by ~0.75).
    "test_e2e_memory.py": 92, "test_e2e_replay.py": 80, "test_e2e_imbalance.py": 60,
    "test_e2e_restarts.py": 70, "test_security_drain_job.py": 40, "test_e2e_advice.py": 60,
    "test_e2e_two_models.py": 25, "test_compiled_step.py": 15,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)
    # The costliest files first, each file's tests in their order (module fixtures share
    # jobs): under xdist the long end-to-end files start early and the short files fill
    # in at the end (longest first), instead of one long file ending the run alone. In
    # a file its `alone` tests go last, in one run: the other workers drain once for them
    # (see _turn below), not once for each.
    cost: dict[Path, float] = {}
    first: dict[Path, int] = {}
    jobs: set[Path] = set()
    for index, item in enumerate(items):
        first.setdefault(item.path, index)
        e2e = item.get_closest_marker("e2e") is not None
        cost[item.path] = cost.get(item.path, 0.0) + (E2E_S if e2e else UNIT_S)
        if e2e:
            jobs.add(item.path)
    whole = not config.option.markexpr and not config.option.keyword
    for path in cost:
        if whole or path not in jobs:  # `-m "not e2e"` runs the whole of a file of no jobs
            cost[path] = FILE_S.get(path.name, cost[path])
    items.sort(key=lambda item: (-cost[item.path], first[item.path], _alone(item)))


# --- `alone` under xdist ----------------------------------------------------------------
# Asked for (TRACEML_TEST_CGROUP=1; _alone_cgroup says why it is not the default), and
# where this process may create a CPU cgroup (root, cgroup v1's cpu controller: CI, this
# project's machines), an `alone` test runs in a cgroup of ALONE_SHARES (its job's
# processes inherit it, whatever session they start), one `alone` test at a time (an
# exclusive lock among them), and the other workers' tests go on beside it: the kernel
# gives them only the CPU time the `alone` test leaves idle (262144 shares against their
# 1024 each: under 1 % of a core they contend for), so no other test's load competes with
# its timings, and the ~0.6 core its jobs leave idle on average is not lost (holding the
# other workers idle instead, `alone` tests took 589 s of the suite's 1,170, at 1.43
# cores busy). A nice value would not do: each session (every job's launcher and
# collector) is an autogroup of its own, and nice only orders processes inside one.
# Elsewhere, a readers-writer lock over the workers: every test holds the run's lock
# shared, an `alone` test holds it exclusively. A turnstile taken first keeps a waiting
# `alone` test from being starved by the other workers' tests. A worker whose next test is
# `alone` too keeps the lock exclusive between the two: taking it again drains the other
# workers' tests first (they slip in between), so a module of `alone` tests drains them
# once, not once per test.

CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
ALONE_SHARES = 262144  # cgroup v1's most
_exclusive: IO[str] | None = None  # the machine lock this worker holds between `alone` tests


def _lock_dir(config: pytest.Config) -> Path | None:
    """Only an xdist worker locks (not a pytest that a test runs inside its worker)."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return None
    return Path(tempfile.gettempdir()) / f"traceml-tests-{worker['testrunuid']}"


def _take(folder: Path, alone: bool) -> IO[str]:
    folder.mkdir(exist_ok=True)
    machine = open(folder / "machine", "a")  # noqa: SIM115 - held past this function
    with open(folder / "turnstile", "a") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        except BaseException:
            machine.close()
            raise
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
    return machine


def _alone_cgroup(folder: Path) -> Path | None:
    """The run's cgroup for `alone` tests (made by the first worker to ask), or None where
    this process may not make one, or unless asked (TRACEML_TEST_CGROUP=1): in a
    fresh-clone run of the whole suite on 2 cores the other workers' jobs, starved beside
    an `alone` test, failed three ways (a killed rank's run called a COMPUTE STRAGGLER, a
    stuck rank's native stack not taken in 150 s, a rank's record short of its steps):
    12:26 but red. The readers-writer lock is the default."""
    if os.environ.get("TRACEML_TEST_CGROUP") != "1":
        return None
    group = CPU_CGROUPS / folder.name
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.shares").write_text(f"{ALONE_SHARES}\n")
    except OSError:
        return None
    return group


def _join(group: Path) -> None:
    """This worker (every thread) and what it starts from now on into `group`."""
    (group / "cgroup.procs").write_text(f"{os.getpid()}\n")


@contextlib.contextmanager
def _turn(folder: Path | None, alone: bool, next_alone: bool) -> Iterator[None]:
    global _exclusive
    if folder is None:
        yield
        return
    held, _exclusive = _exclusive, None
    if held is not None and not alone:  # the next test was not the one announced
        _release(held)
        held = None
    group = _alone_cgroup(folder)
    if group is not None and not alone:  # beside anything, below an `alone` test
        yield
        return
    machine = held or _take(folder, alone)
    if group is not None:
        _join(group)
    try:
        yield
    finally:
        if group is not None:
            _join(CPU_CGROUPS)
        if alone and next_alone:
            _exclusive = machine
        else:
            _release(machine)


def _release(machine: IO[str]) -> None:
    fcntl.flock(machine, fcntl.LOCK_UN)
    machine.close()


def _alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown (module fixtures' jobs included) inside the lock."""
    with _turn(_lock_dir(item.config), _alone(item), _alone(nextitem)):
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _current
    _current = item.nodeid
    os.environ[TEST_VAR] = item.nodeid  # before fixtures: what they start is the test's


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Our own descendants alive after this test (forked ones carry no mark)."""
    for proc in _children():
        key = (proc.pid, _started(proc))
        _descendants.setdefault(key, item.nodeid)


def _children() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _started(proc: psutil.Process) -> float:
    try:
        return proc.create_time()
    except psutil.Error:
        return 0.0


def _drop_cgroup(config: pytest.Config) -> None:
    """The `alone` cgroup, once empty (the last worker's rmdir removes it)."""
    folder = _lock_dir(config)
    if folder is not None:
        with contextlib.suppress(OSError):
            (CPU_CGROUPS / folder.name).rmdir()


def survivors() -> list[tuple[psutil.Process, str]]:
    """Live processes of this session other than pytest itself, with the test that
    started each ("?" if none is known)."""
    me = os.getpid()
    found: dict[int, tuple[psutil.Process, str]] = {}
    mark = f"{SESSION_VAR}={SESSION}".encode()
    proc_dir = Path("/proc")
    for entry in proc_dir.iterdir() if proc_dir.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read (then not ours at all)
            continue
        if mark not in environ:
            continue
        test = next((v.split(b"=", 1)[1].decode(errors="replace") for v in environ
                     if v.startswith(f"{TEST_VAR}=".encode())), "?")
        try:
            found[int(entry.name)] = (psutil.Process(int(entry.name)), test)
        except psutil.Error:
            continue
    for proc in _children():
        if proc.pid not in found:
            found[proc.pid] = (proc, _descendants.get((proc.pid, _started(proc)), _current))
    live = []
    for proc, test in found.values():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                live.append((proc, test))
        except psutil.Error:
            pass
    return live


def _describe(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:300] or proc.name()
    except psutil.Error:
        return "(gone)"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    deadline = time.monotonic() + LEAK_GRACE_S
    left = survivors()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = survivors()
    if not left:
        _drop_cgroup(session.config)
        return
    lines = [f"{test}: pid {proc.pid}: {_describe(proc)}" for proc, test in
             sorted(left, key=lambda pt: (pt[1], pt[0].pid))]
    for proc, _ in left:  # nothing of ours may go on loading the machine
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs([proc for proc, _ in left], timeout=5)
    _drop_cgroup(session.config)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_sep("=", f"{len(lines)} process(es) left running by tests "
                                f"(killed)", red=True)
        for line in lines:
            reporter.write_line(line)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
