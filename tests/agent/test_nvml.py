"""NVML opened by the UUID torch reports for the rank's device, retried when it fails,
explained when figures are missing, and GPU health (power, SM clock, temperature,
clock-throttle reasons) sampled beside the other figures and named in a COMPUTE
STRAGGLER's evidence. pynvml is the NVML double (nvml_double.py) in sys.modules."""

from __future__ import annotations

import sys
import time
import types
import typing
from collections import deque

import msgspec
import pytest
from torch import nn

from cuda_double import CudaDouble, on_device
from nvml_double import Board, NvmlDouble, bare, uuid
from traceml_agent import hooks, protocol, sysmetrics
from traceml_agent.protocol import Identity, decode, encode
from traceml_agent.recorder import LazyCudaRecorder
from traceml_tui.collect import view_build
from traceml_tui.collect.canned import T0, make_state
from traceml_tui.judge import diagnosis as dx
from traceml_tui.report import summary
from traceml_tui.runfolder import summary_model as model

A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"
MIG = uuid(0xd1, "MIG")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def use(monkeypatch, double: NvmlDouble, visible: str | None = None,
        order: str | None = None) -> NvmlDouble:
    monkeypatch.setitem(sys.modules, "pynvml", double.module())
    for name, value in (("CUDA_VISIBLE_DEVICES", visible), ("CUDA_DEVICE_ORDER", order)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return double


def mixed() -> list[Board]:
    """A node with an A100 at PCI 0 and an H100 at PCI 1: CUDA's default fastest-first
    order calls the H100 cuda:0, NVML calls it device 1."""
    return [Board(uuid(0xa0), A100, util=11.0), Board(uuid(0xb1), H100, util=22.0)]


# --- which device: (name, boards, CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, torch index,
# torch's UUID, the NVML device sampled or None, what the note must say) ---------------------
MAPPING = [
    ("fastest-first: torch's UUID finds the H100", mixed(), None, None, 0, bare(uuid(0xb1)),
     uuid(0xb1), None),
    ("fastest-first, mixed models, no UUID: refused, not guessed", mixed(), None, None, 0,
     None, None, "CUDA_DEVICE_ORDER=PCI_BUS_ID"),
    ("PCI order, no UUID: the index is NVML's", mixed(), None, "PCI_BUS_ID", 1, None,
     uuid(0xb1), None),
    ("fastest-first, one model: the index is NVML's", [Board(uuid(1)), Board(uuid(2))], None,
     None, 1, None, uuid(2), None),
    ("CUDA_VISIBLE_DEVICES index, read in CUDA's order", mixed(), "1", None, 0, None, None,
     "CUDA_DEVICE_ORDER=PCI_BUS_ID"),
    ("torch's UUID beats an index in CUDA_VISIBLE_DEVICES", mixed(), "0", None, 0,
     bare(uuid(0xb1)), uuid(0xb1), None),
    ("MIG UUID from torch, variable unset", [Board(uuid(0xc1), migs=(MIG,))], None, None, 0,
     bare(MIG), MIG, None),
    ("GPU UUID of a MIG-enabled GPU: torch names the instance",
     [Board(uuid(0xc1), migs=(MIG,))], uuid(0xc1), None, 0, bare(MIG), MIG, None),
    ("index of a MIG-enabled GPU, no UUID: not the GPU's memory",
     [Board(uuid(0xc1), migs=(MIG,))], "0", "PCI_BUS_ID", 0, None, uuid(0xc1),
     "MIG instance not identified"),
    ("MIG UUID in CUDA_VISIBLE_DEVICES", [Board(uuid(0xc1), migs=(uuid(0xd0, "MIG"), MIG))],
     MIG, None, 0, None, MIG, None),
]


@pytest.mark.parametrize("name, boards, visible, order, index, torch_uuid, sampled, note",
                         MAPPING, ids=[m[0] for m in MAPPING])
def test_the_ranks_own_device_is_sampled(name, boards, visible, order, index, torch_uuid,
                                         sampled, note, monkeypatch):
    use(monkeypatch, NvmlDouble(boards), visible, order)
    sampler = sysmetrics.SystemSampler()
    if torch_uuid is None:
        sampler.open_gpu(index)
    else:
        sampler.open_gpu(index, torch_uuid)
    for _ in range(sysmetrics.METRIC_FAILURES):  # a note for a metric comes once it rests
        got = sampler.sample()
    if sampled is None:  # no sure answer: nothing sampled rather than another GPU
        assert got["gpu_util"] is None and got["gpu_mem_mb"] is None
    elif sampled.startswith("MIG-"):  # the instance's memory, the GPU's clocks
        assert got["gpu_mem_mb"] == 3 * 1024 and got["gpu_util"] is None
        assert got["sm_clock_mhz"] == 1980.0
    elif note is None:
        board = next(b for b in boards if b.uuid == sampled)
        assert got["gpu_util"] == board.util
    else:  # a MIG-enabled GPU whose instance is unknown: not every instance's memory
        assert got["gpu_mem_mb"] is None
    assert got["gpu_uuid"] == sampled
    if note is None:
        assert got["gpu_note"] is None or "util" in got["gpu_note"]  # MIG: no utilisation
    else:
        assert note in got["gpu_note"]


def test_a_driver_older_than_mig_lookup_by_uuid_is_walked(monkeypatch):
    use(monkeypatch, NvmlDouble([Board(uuid(1)), Board(uuid(2), migs=(uuid(3, "MIG"), MIG))],
                                mig_lookup=False))
    got = sysmetrics.SystemSampler(0, bare(MIG)).sample()
    assert got["gpu_uuid"] == MIG and got["gpu_mem_mb"] == 3 * 1024


def fake_time(monkeypatch) -> Clock:
    """The sampler's clock (the module's `time.monotonic`), advanced by the test."""
    clock = Clock()
    fake = types.SimpleNamespace(monotonic=clock, process_time=time.process_time)
    monkeypatch.setattr(sysmetrics, "time", fake, raising=False)
    return clock


def test_a_failed_open_is_retried_with_backoff_and_explained(monkeypatch):
    nvml = use(monkeypatch, NvmlDouble([Board(uuid(1))], init_failures=3))
    clock = fake_time(monkeypatch)
    sampler = sysmetrics.SystemSampler(0)
    tries, notes = [], []
    for dt in (0.0, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 4.0):  # sampled at 0, .5, 1, 2, 3, 4, 5, 9
        clock.t += dt
        got = sampler.sample()
        tries.append(nvml.count("nvmlInit"))
        notes.append(got.get("gpu_note"))
    # Tried at 0, then 1 s later, then 2 s later, then 4 s later (the 4th try succeeds).
    assert tries == [1, 1, 2, 2, 3, 3, 3, 4]
    assert got["gpu_util"] == 50.0 and got["gpu_note"] is None
    assert got["sm_clock_mhz"] == 1980.0
    assert notes[1] == "NVML not open: NVMLError_DriverNotLoaded: Driver Not Loaded (retry in 1 s)"


def test_backoff_stops_doubling_at_a_minute():
    backoff = sysmetrics._Backoff()
    delays = []
    for _ in range(9):
        backoff.failed(0.0)
        delays.append(backoff.delay)
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]


def test_a_dead_metric_is_explained_rested_and_tried_again(monkeypatch):
    nvml = use(monkeypatch, NvmlDouble([Board(uuid(1))], failing={"util"}))
    clock = fake_time(monkeypatch)
    sampler = sysmetrics.SystemSampler(0)
    for _ in range(3):  # sysmetrics.METRIC_FAILURES
        got = sampler.sample()
    assert got["gpu_util"] is None and got["gpu_mem_mb"] == 10 * 1024  # the others go on
    asked = nvml.count("nvmlDeviceGetUtilizationRates")
    sampler.sample()
    assert nvml.count("nvmlDeviceGetUtilizationRates") == asked  # resting
    nvml.failing.clear()  # the board answers again (a driver reload, a transient error)
    clock.t += 1.0  # sysmetrics.RETRY_FIRST_S
    assert sampler.sample()["gpu_util"] == 50.0
    nvml.failing.add("power")
    for _ in range(3):
        got = sampler.sample()
    assert got["power_w"] is None and got["sm_clock_mhz"] == 1980.0
    assert got["gpu_note"] == "power: NVMLError_NotSupported: Not Supported"


THROTTLE = [
    ("none", 0, ()),
    ("idle only", 0x1, ("idle",)),
    ("thermal and power cap", 0x4 | 0x40, ("power cap", "hw thermal")),
    ("hw slowdown and sw thermal", 0x8 | 0x20, ("hw slowdown", "sw thermal")),
    ("power brake", 0x80, ("power brake",)),
]


@pytest.mark.parametrize("event_api", [True, False], ids=["events (535+)", "throttle (older)"])
@pytest.mark.parametrize("name, mask, names", THROTTLE, ids=[t[0] for t in THROTTLE])
def test_gpu_health_is_sampled_and_crosses_the_wire(name, mask, names, event_api, monkeypatch):
    board = Board(uuid(1), sm_clock=1410, power_mw=412_500, temp_c=87, reasons=mask)
    use(monkeypatch, NvmlDouble([board], event_api=event_api))
    got = sysmetrics.SystemSampler(0, bare(uuid(1))).sample()
    assert (got["power_w"], got["sm_clock_mhz"], got["sm_clock_max_mhz"], got["temp_c"],
            got["throttle"]) == (412.5, 1410.0, 1980.0, 87.0, names)
    ident = Identity(3, 3, 0, "h", 1, 4)
    body = decode(encode("sys", ident, 0, T0, **got)).body
    assert body.throttle == names and body.power_w == 412.5


def test_the_wire_knows_every_reason_the_sampler_names():
    wire = set(typing.get_args(protocol.ThrottleReason))
    assert {n for _, n in sysmetrics.THROTTLE_BITS} == wire


@pytest.mark.parametrize("field, value", [("throttle", ["on fire"]), ("throttle", ["idle"] * 17),
                                          ("sm_clock_mhz", -1.0), ("gpu_note", "x" * 300)])
def test_a_sys_message_out_of_bounds_is_refused(field, value):
    ident = Identity(0, 0, 0, "h", 1, 1)
    with pytest.raises((msgspec.ValidationError, ValueError)):
        decode(encode("sys", ident, 0, T0, **{field: value}))


# --- the training thread reads torch's UUID where it learns the device ---------------------


def test_the_recorder_reads_torchs_uuid_on_the_training_thread(monkeypatch):
    import threading

    import torch._dynamo  # noqa: F401 - as test_cuda_path's fixture

    cuda = CudaDouble(devices=2)
    monkeypatch.setattr(torch, "cuda", cuda)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    rec = LazyCudaRecorder(deque(maxlen=1000), torch)
    hooks.install(rec, torch, lambda exc: None, None)
    try:
        cuda.script_uses(1)
        model = on_device(nn.Linear(4, 4), 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    finally:
        hooks.uninstall()
    assert rec.device == 1 and rec.device_uuid == "00000001-0000-0000-0000-000000000000"
    reads = [c for c in cuda.agent_calls() if c.api == "get_device_properties"]
    assert reads and {c.thread for c in reads} == {threading.main_thread().name}
    # The sender opens NVML by it: cuda:1 of torch is the board at PCI 0 here.
    use(monkeypatch, NvmlDouble([Board("GPU-" + rec.device_uuid), Board(uuid(9))]))
    got = sysmetrics.SystemSampler(rec.device, rec.device_uuid).sample()
    assert got["gpu_uuid"] == "GPU-" + rec.device_uuid


# --- the collector: evidence beside a COMPUTE STRAGGLER -------------------------------------


def health(clock: float | None = 1980.0, *reasons: str) -> dx.GpuHealth:
    return dx.GpuHealth(clock, tuple(reasons), 300.0, 60.0)


def timings(gpus: dict[int, dx.GpuHealth | None], slow: int = 3) -> list[dx.RankTiming]:
    out = []
    for r in range(4):
        backward = 60.0 if r == slow else 40.0
        out.append(dx.RankTiming(r, 20, 100.0, {"dataloader": 1.0, "h2d": 1.0,
                                                "forward": 20.0, "backward": backward,
                                                "optimizer": 5.0, "sync": 10.0},
                                 gpu=gpus.get(r, health())))
    return out


# (name, each rank's GPU where not the default healthy one, words the evidence holds,
# whether the GPU advice replaces the model-side one)
EVIDENCE = [
    ("thermal throttle, clock low", {3: health(1410.0, "hw thermal")},
     "rank 3's GPU is throttled (hw thermal), SM clock 1410 MHz vs median 1980", True),
    ("power cap at full clock", {3: health(1980.0, "power cap")},
     "rank 3's GPU is throttled (power cap), SM clock 1980 MHz vs median 1980", True),
    ("clock low, no reason given", {3: health(1500.0)},
     "rank 3's GPU clocks low, SM clock 1500 MHz vs median 1980", True),
    ("clock 5% low: within GPU Boost's wander", {3: health(1880.0)}, None, False),
    ("idle and sync boost are not faults", {3: health(1980.0, "idle", "sync boost")}, None,
     False),
    ("every GPU power capped: said, not blamed", {r: health(1980.0, "power cap")
                                                   for r in range(4)},
     "throttled (power cap) (as are 3 of 3 other ranks')", False),
    ("no NVML on the culprit", {3: None}, None, False),
    ("sampled while idle: its clock is no load clock", {3: dx.GpuHealth.of(
        {"sm_clock_mhz": 345.0, "throttle": ("idle",)})}, None, False),
    ("a healthy culprit, a throttled bystander", {1: health(1410.0, "hw thermal")}, None,
     False),
]


@pytest.mark.parametrize("name, gpus, words, gpu_first", EVIDENCE, ids=[e[0] for e in EVIDENCE])
def test_compute_straggler_evidence_names_its_gpu(name, gpus, words, gpu_first):
    d = dx.diagnose(timings(gpus))
    assert d.label == dx.COMPUTE_STRAGGLER and d.rank == 3
    if words is None:
        assert "GPU" not in d.summary
    else:
        assert words in d.summary
        assert ("cooling, power limit" in d.summary) == gpu_first
        assert ("model-side work" in d.summary) == (not gpu_first)


def test_other_labels_do_not_borrow_gpu_evidence():
    ranks = [dx.RankTiming(r, 20, 100.0, {"dataloader": 40.0 if r == 3 else 1.0, "h2d": 1.0,
                                          "forward": 20.0, "backward": 40.0, "optimizer": 5.0},
                           gpu=health(1410.0, "hw thermal") if r == 3 else health())
             for r in range(4)]
    d = dx.diagnose(ranks)
    assert d.label == dx.INPUT_STRAGGLER and "GPU" not in d.summary


def sys_msg(rank: int, world: int, **fields) -> protocol.Message:
    ident = Identity(rank, rank % 4, rank // 4, f"node{rank // 4:03d}", 1000 + rank, world)
    return decode(encode("sys", ident, 5, T0, **fields))


def test_the_live_label_summary_and_panel_show_the_throttled_gpu():
    """Through the collector's state as a live job feeds it: the sys samples arrive after
    the steps, and the live evaluation, the final summary and the rank panel say so."""
    state = make_state(world_size=8, straggler=2, phase="backward")
    for rank in range(8):
        slow = rank == 2
        state.ingest(sys_msg(rank, 8, sm_clock_mhz=1410.0 if slow else 1980.0,
                             sm_clock_max_mhz=1980.0, power_w=250.0, temp_c=91.0 if slow
                             else 60.0, throttle=("hw thermal",) if slow else ()), 0.0)
    live = state.evaluate(T0 + 10)
    assert live.label == dx.COMPUTE_STRAGGLER and live.rank == 2
    assert "rank 2's GPU is throttled (hw thermal), SM clock 1410 MHz vs median 1980" \
        in live.summary
    snap = state.snapshot(T0 + 11, 12.0, full=True)
    final = model.to_doc(summary.build(snap, summary.RunMeta()))
    assert "throttled (hw thermal)" in final["diagnosis"]["summary"]
    assert list(final["ranks"][2]["sys"]["throttle"]) == ["hw thermal"]
    view = view_build.build(snap)
    panel = view_build.detail(snap, 2, view, ())
    assert panel is not None
    assert panel.gpu == "GPU SM 1410/1980 MHz  250 W  91 C  clocks held by hw thermal"


def test_the_panel_says_why_gpu_figures_are_missing():
    state = make_state(world_size=4, straggler=None)
    state.ingest(sys_msg(1, 4, device="cuda:0",
                         gpu_note="NVML not open: NVMLError_DriverNotLoaded (retry in 8 s)"),
                 0.0)
    snap = state.snapshot(T0 + 11, 12.0, full=True)
    panel = view_build.detail(snap, 1, view_build.build(snap), ())
    assert panel is not None and panel.gpu == ("GPU NVML not open: NVMLError_DriverNotLoaded "
                                               "(retry in 8 s)")
    final = model.to_doc(summary.build(snap, summary.RunMeta()))
    assert final["ranks"][1]["sys"]["gpu_note"].startswith("NVML not open")


def throttled_state():
    state = make_state(world_size=8, straggler=2, phase="backward")
    for rank in range(8):
        slow = rank == 2
        state.ingest(sys_msg(rank, 8, sm_clock_mhz=1410.0 if slow else 1980.0,
                             sm_clock_max_mhz=1980.0, power_w=250.0, temp_c=91.0 if slow
                             else 60.0, throttle=("hw thermal",) if slow else ()), 0.0)
    for tick in range(3):
        state.evaluate(T0 + 10 + tick)
    return state


async def test_the_dashboard_shows_the_culprits_gpu_where_the_user_looks():
    """In the terminal: the worst-rank panel carries the GPU line, the banner the evidence."""
    from rich.console import Console

    from traceml_tui.collect.canned import StaticSource
    from traceml_tui.view.dashboard import DashboardApp
    from traceml_tui.view.dashboard.banner import Banner
    from traceml_tui.view.dashboard.rank_panel import RankPanel

    def text_of(widget) -> str:
        console = Console(width=300, record=True, file=open("/dev/null", "w"))
        console.print(widget.content)
        return " ".join(console.export_text().split())

    app = DashboardApp(StaticSource(throttled_state()), refresh_s=0.05)
    async with app.run_test(size=(160, 50)) as pilot:
        for _ in range(200):
            if app.state is not None:
                break
            await pilot.pause(0.05)
        worst = text_of(app.query_one("#worst", RankPanel))
        assert "rank 2" in worst
        assert "GPU SM 1410/1980 MHz 250 W 91 C clocks held by hw thermal" in worst, worst
        banner = text_of(app.query_one(Banner))
        assert "COMPUTE STRAGGLER" in banner and "throttled (hw thermal)" in banner, banner


def test_the_full_agent_sends_its_own_gpus_health(monkeypatch):
    """The agent in-process on the CUDA double (the model on cuda:1, no set_device) with
    the NVML double listing that GPU second in PCI order, against a real ZeroMQ socket:
    the sys samples name the GPU by torch's UUID, with its health, and no CUDA call was
    made off the training thread."""
    import threading

    import torch._dynamo  # noqa: F401 - as test_cuda_path's fixture
    import zmq

    import traceml_agent

    cuda = CudaDouble(devices=2)
    monkeypatch.setattr(torch, "cuda", cuda)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    mine = "GPU-00000001-0000-0000-0000-000000000000"  # what the double reports for cuda:1
    use(monkeypatch, NvmlDouble([Board(uuid(7), A100), Board(mine, reasons=0x40,
                                                             sm_clock=1410)]))
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    monkeypatch.delenv("TRACEML_SECRET", raising=False)
    got = None
    assert traceml_agent.init(endpoint=f"tcp://127.0.0.1:{port}", run_name="nvml")
    try:
        model = on_device(nn.Linear(8, 1), 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cuda.script_uses(1)
        deadline = time.monotonic() + 15.0
        while got is None and time.monotonic() < deadline:
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            while sock.poll(0):
                msg = decode(sock.recv_multipart()[1])
                if msg.kind == "sys" and msg.body.gpu_uuid:
                    got = msg.body
    finally:
        traceml_agent.shutdown(0)
        sock.close(0)
    assert got is not None, "no sys sample with a GPU came"
    assert (got.gpu_uuid, got.device, got.sm_clock_mhz, got.throttle) == (
        mine, "cuda:1", 1410.0, ("hw thermal",))
    assert got.gpu_note is None
    assert {c.thread for c in cuda.agent_calls()} == {threading.main_thread().name}


def node_timings(gpu_of_slow: dx.GpuHealth | None) -> list[dx.RankTiming]:
    """Two nodes of four ranks; every rank of node 1 is slow in backward."""
    return [dx.RankTiming(r, 20, 100.0, {"dataloader": 1.0, "h2d": 1.0, "forward": 20.0,
                                         "backward": 60.0 if r >= 4 else 40.0,
                                         "optimizer": 5.0}, host=f"h{r // 4}", node=r // 4,
                          gpu=gpu_of_slow if r >= 4 else health())
            for r in range(8)]


NODE_EVIDENCE = [
    ("a hot node", health(1410.0, "hw thermal"),
     "4 of its 4 GPUs are throttled (hw thermal), SM clock median 1410 MHz vs 1980 on the "
     "other nodes"),
    ("a node clocked low", health(1500.0), "its GPUs clock low, SM clock median 1500 MHz vs "
     "1980 on the other nodes"),
    ("a healthy slow node", health(), None),
    ("no NVML on the node", None, None),
]


@pytest.mark.parametrize("name, gpu, words", NODE_EVIDENCE, ids=[e[0] for e in NODE_EVIDENCE])
def test_a_slow_nodes_gpus_are_named(name, gpu, words):
    d = dx.diagnose(node_timings(gpu))
    assert d.label == dx.COMPUTE_STRAGGLER and d.node == 1
    if words is None:
        assert "its GPUs" not in d.summary and "throttled (" not in d.summary
    else:
        assert words in d.summary, d.summary


def test_without_pynvml_the_note_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    got = sysmetrics.SystemSampler(0, bare(uuid(1))).sample()
    assert got["gpu_util"] is None
    assert got["gpu_note"].startswith("NVML not open: pynvml is not installed (pip install "
                                      "nvidia-ml-py)")


# --- issue 40: a node where other GPUs are off-limits; a driver older than its binding ---


@pytest.mark.parametrize("visible", [None, "2"], ids=["unset", "index"])
def test_nvml_opens_by_uuid_where_other_gpus_are_denied(visible, monkeypatch):
    """Slurm's ConstrainDevices: NVML counts all 4 GPUs, opening 0, 1 or 3 by index raises
    NO_PERMISSION. The rank's own GPU (found by torch's UUID, one call) is sampled."""
    boards = [Board(uuid(0xa0 + i), util=10.0 + i) for i in range(4)]
    double = use(monkeypatch, NvmlDouble(boards, denied={0, 1, 3}), visible=visible)
    got = sysmetrics.SystemSampler(0, bare(uuid(0xa2))).sample()
    assert got["gpu_uuid"] == uuid(0xa2) and got["gpu_util"] == 12.0, got["gpu_note"]
    assert double.count("nvmlDeviceGetHandleByIndex") == 0  # no walk


def test_a_mig_walk_skips_the_gpus_it_may_not_open(monkeypatch):
    boards = [Board(uuid(1)), Board(uuid(2), migs=(uuid(3, "MIG"), MIG))]
    use(monkeypatch, NvmlDouble([Board(uuid(9)), *boards], mig_lookup=False, denied={0}))
    got = sysmetrics.SystemSampler(0, bare(MIG)).sample()
    assert got["gpu_uuid"] == MIG and got["gpu_mem_mb"] == 3 * 1024


def test_by_index_where_gpus_are_denied_is_refused_with_the_reason(monkeypatch):
    """Without a UUID the index is all there is, and CUDA (which does not see a denied GPU)
    numbers differently from NVML: no figure is better than another GPU's."""
    boards = [Board(uuid(0xa0 + i)) for i in range(3)]
    use(monkeypatch, NvmlDouble(boards, denied={0}), visible=None)
    got = sysmetrics.SystemSampler(0, None).sample()
    assert got["gpu_util"] is None and "off-limits" in got["gpu_note"]


def test_throttle_reasons_on_a_driver_older_than_the_binding(monkeypatch):
    """pynvml 12 names nvmlDeviceGetCurrentClocksEventReasons; a driver before 535 lacks
    it (FUNCTION_NOT_FOUND) but has nvmlDeviceGetCurrentClocksThrottleReasons."""
    board = Board(uuid(1), reasons=0x4 | 0x40)
    double = use(monkeypatch, NvmlDouble([board], driver_events=False))
    sampler = sysmetrics.SystemSampler(0, bare(uuid(1)))
    for _ in range(3):
        got = sampler.sample()
        assert got["throttle"] == ("power cap", "hw thermal"), got["gpu_note"]
    assert double.count("nvmlDeviceGetCurrentClocksEventReasons") == 1  # learned once
