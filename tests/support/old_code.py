"""An earlier commit's collector and agent, to compare the code before a rewrite with the
code after it on the same inputs: extracted with `git archive` and run in a process of its
own (a test skips, saying why, in a clone without that commit: a shallow one)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


# Sentences a verdict has gained since the old code these tests compare with, removed
# before comparing (the rest must match byte for byte): a straggler's age and its share of
# steps behind (judge/imbalance.py, issue 39). Spaces match a wrapped line's break too.
_SEEN = re.compile(r"\s(?:Seen\s+for\s+its\s+last\s+\d+\s+steps\s+\([\d.]+\s+s\);\s+b|B)"
                   r"ehind\s+the\s+other\s+ranks\s+on\s+\d+%\s+of\s+the\s+last\s+\d+\.")


# A periodic stall's advice is chosen from its evidence since (judge/advice.py): the text
# after its loss is cut on both sides before comparing.
_STALL_ADVICE = re.compile(r"(stalls\s+every\s+\d+\s+steps\s.*?of\s+its\s+time\s+since\s+step"
                           r"\s+\d+\.)(?:[^\"\\\n]|\\.|\n(?=   ))*", re.S)


# A straggler whose CPU wait could not be compared says so after its advice (diagnosis.
# evidence.CPU_UNREAD, fresh-clone run 25's session).
_CPU_UNREAD = re.compile(r";\s+how\s+long\s+its\s+training\s+thread\s+waited\s+for\s+a\s+core"
                         r"\s+was\s+not\s+read:\s+other\s+work\s+sharing\s+its\s+cores\s+is\s+not"
                         r"\s+ruled\s+out")


# COMM-BOUND's gradient bytes are said in the unit that fits since (bandwidth.si_bytes:
# "38.4 kB", not "0.0 MB"): the amount is cut on both sides.
_GRAD_BYTES = re.compile(r"(DDP\s+all-reduces\s+)[\d.]+\s+[kMG]?B(\s+of\s+gradients)")


# A STRAGGLER behind in both on one rank says where its gap is ("in input and compute
# (20.0 and 20.0 ms)", not all "in forward"), and one over two ranks, or a single
# straggler beside a smaller gap of the other kind, names the other gap after its advice
# (diagnosis._also): the place is cut on both sides, the added sentence removed.
_BOTH_WHERE = re.compile(r"(spends\s+(?:about\s+)?[\d.]+\s+ms\s+more\s+in\s+)(?:input\s+and\s+"
                         r"compute\s+\([\d.]+\s+and\s+[\d.]+\s+ms\)|[\w-]+)(\s+than\s+the\s+median"
                         r"\s+rank,\s+[^:]*:\s+input\s+and\s+compute\s+are\s+both)")
_ALSO = re.compile(r"\s+Rank\s+\d+\s+is\s+also\s+[\d.]+\s+ms\s+behind\s+the\s+median\s+rank\s+in"
                   r"\s+(?:input|compute)\s+\(\d+%\s+of\s+the\s+step(?:,\s+a\s+smaller\s+cost:\s+"
                   r"named\s+on\s+its\s+own\s+once\s+this\s+gap\s+is\s+fixed)?\)\.")


def without_new_sentences(text: str) -> str:
    """`text` less the sentences verdicts gained or changed since the old code (_SEEN,
    _STALL_ADVICE, _CPU_UNREAD, _GRAD_BYTES, _BOTH_WHERE, _ALSO): apply it to both sides
    of a comparison."""
    text = _ALSO.sub("", _BOTH_WHERE.sub(r"\1…\2", _GRAD_BYTES.sub(r"\1\2", text)))
    return _CPU_UNREAD.sub("", _STALL_ADVICE.sub(r"\1", _SEEN.sub("", text)))


def old_tree(commit: str, into: Path) -> Path:
    """`commit`'s traceml_tui and agent, importable from `into` (the agent under the
    package name it is installed as)."""
    known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT,
                           capture_output=True)
    if known.returncode != 0:
        pytest.skip(f"commit {commit} is not in this clone's history (a shallow clone?)")
    archive = subprocess.run(["git", "archive", "--format=tar", commit, "traceml_tui", "agent"],
                             cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "agent").rename(into / "traceml_agent")
    return into


def env(pythonpath: Path | None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This environment with PYTHONPATH set to `pythonpath` (None: the installed code)."""
    out = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k not in drop}
    if pythonpath is not None:
        out["PYTHONPATH"] = str(pythonpath)
    return out


def run_json(script: str, pythonpath: Path | None, drop: tuple[str, ...] = ()) -> Any:
    """What `script` prints as JSON, run by the code at `pythonpath` (None: this tree)."""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env(pythonpath, drop), cwd=pythonpath or ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)
