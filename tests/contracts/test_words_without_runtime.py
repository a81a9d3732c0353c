"""The words without the runtime: a viewer, the collector or a report that imports the
vocabulary (traceml_agent.vocab, which runs the agent package's __init__ first) loads no
module of the agent's runtime, and the agent's constants the package keeps for itself
are the runtime's (issue 43, item 3)."""

from __future__ import annotations

import json
import subprocess
import sys

RUNTIME = ("recorder", "hooks", "transport", "bootstrap", "device", "keys", "gcwatch",
           "capture", "checks", "sysmetrics", "handover")


def _loaded(module: str) -> list[str]:
    code = (f"import sys, json, {module}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('traceml_agent'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)
    return json.loads(done.stdout)


def test_a_viewer_loads_no_agent_runtime():
    for module in ("traceml_tui.viewmodel", "traceml_tui.view.dashboard.app"):
        loaded = _loaded(module)
        runtime = [m for m in loaded if m.rsplit(".", 1)[-1] in RUNTIME]
        assert not runtime, (module, runtime)


def test_the_package_keeps_the_recorders_no_phase():
    import traceml_agent
    from traceml_agent import recorder

    assert traceml_agent._NO_PHASE == recorder.NO_PHASE


def test_the_wire_and_the_judge_load_no_detector():
    """Decoding a checks message and judging the findings need the checks' words
    (findings.py), not the 700 lines of detectors that run inside a rank (checks.py)."""
    for module in ("traceml_agent.protocol", "traceml_tui.judge.state"):
        loaded = _loaded(module)
        assert "traceml_agent.findings" in loaded
        runtime = [m for m in loaded if m.rsplit(".", 1)[-1] in RUNTIME]
        assert not runtime, (module, runtime)
