"""Slurm for real: a slurmctld and two slurmd (Debian's slurm-wlm, with munge) started
for these tests on this machine, as two nodes (two node names on one host, each slurmd
on its own port); `srun` on one and on two nodes and `sbatch` of
examples/slurm/train.sbatch run traceml as a user's job would. Skipped, with the reason,
where the daemons cannot be installed or started (not root, no packages). The node names
do not resolve, so the two-node runs pass --master-addr 127.0.0.1, as a cluster whose
node names are not its fast network's does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import EXAMPLES, free_ports

MUNGED_PID = "/run/munge/munged.pid"
DAEMONS = ("slurmctld", "slurmd", "munged", "srun", "sbatch", "sinfo")
MISSING = [d for d in DAEMONS if shutil.which(d) is None]
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(bool(MISSING) or os.geteuid() != 0,
                                 reason=f"no Slurm here ({', '.join(MISSING)} missing)"
                                 if MISSING else "starting slurmd needs root")]


def _munge() -> bool:
    """munged running, with a key (the packages install one; make it if not). True if
    we started it (then the module stops it: nothing of the suite's outlives it)."""
    if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
        return False
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run(["mungekey", "-c"], check=True, capture_output=True)
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"],
                   capture_output=True, check=False)
    for _ in range(50):
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return True
        time.sleep(0.1)
    _stop_munge()
    pytest.skip("munged did not start")


def _stop_munge() -> None:
    try:
        os.kill(int(Path(MUNGED_PID).read_text()), signal.SIGTERM)
    except (OSError, ValueError):
        pass


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node cluster: its slurm.conf's path (SLURM_CONF for the commands)."""
    started_munge = _munge()
    root = tmp_path_factory.mktemp("slurm")
    for d in ("state", "spool-tn0", "spool-tn1", "log"):
        (root / d).mkdir()
    host = socket.gethostname().split(".")[0]
    ctld_port = free_ports(3)
    cpus = max(1, (os.cpu_count() or 2) // 2)
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=traceml-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
ReturnToService=2
MpiDefault=none
NodeName=tn0 NodeHostname={host} NodeAddr=127.0.0.1 Port={ctld_port + 1} CPUs={cpus} State=UNKNOWN
NodeName=tn1 NodeHostname={host} NodeAddr=127.0.0.1 Port={ctld_port + 2} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run(["slurmctld", "-f", str(conf)], env=env, check=True, capture_output=True)
    for node in ("tn0", "tn1"):
        subprocess.run(["slurmd", "-f", str(conf), "-N", node], env=env, check=True,
                       capture_output=True)
    try:
        for _ in range(150):
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                   text=True).stdout.strip()
            if state == "idle":  # both nodes (one line: same state)
                break
            time.sleep(0.2)
        else:
            pytest.skip(f"slurmd did not come up: {state!r}; see {root}/log")
        yield env
    finally:
        for pid_file in ("slurmd-tn0.pid", "slurmd-tn1.pid", "slurmctld.pid"):
            try:
                os.kill(int((root / pid_file).read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        if started_munge:
            _stop_munge()


def _srun_straggler(slurm: dict, out: Path, nodes: int, nproc: int
                    ) -> subprocess.CompletedProcess:
    """One srun line: `traceml run` of the toy with rank 1 slow on input, on `nodes` nodes."""
    return subprocess.run(
        ["srun", f"-N{nodes}", "--ntasks-per-node=1", sys.executable, "-m", "traceml_tui", "run",
         str(EXAMPLES / "ddp_toy.py"), "--nproc-per-node", str(nproc), "--master-addr",
         "127.0.0.1", "--out", str(out), "--headless", "--", "--scenario", "input", "--rank",
         "1", "--delay-ms", "25", "--steps", "50"],
        env={**slurm, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240,
        cwd=Path(__file__).resolve().parents[2])


def test_srun_runs_traceml_as_a_job_step(slurm, tmp_path):
    """One srun line: the run is named after the Slurm job and the straggler is found."""
    out = tmp_path / "runs"
    done = _srun_straggler(slurm, out, nodes=1, nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = out.iterdir()
    assert run_dir.name.startswith("ddp_toy-slurm")  # named after the Slurm job
    doc = json.loads((run_dir / "final_summary.json").read_text())
    assert doc["complete"] and doc["run"]["world_size"] == 2
    assert (doc["diagnosis"]["label"], doc["diagnosis"]["rank"]) == ("INPUT STRAGGLER", 1)


def test_sbatch_of_the_example_script(slurm, tmp_path):
    """examples/slurm/train.sbatch on the two nodes, made to fit CPU nodes: no GPU
    request, the demo script instead of train.py, the run folder under tmp, and node 0's
    address given (the test's node names do not resolve)."""
    out = tmp_path / "runs"
    script = (EXAMPLES / "slurm" / "train.sbatch").read_text()
    script = (script.replace("#SBATCH --gpus-per-node=8\n", "")
              .replace("#SBATCH --cpus-per-task=32", "#SBATCH --cpus-per-task=1")
              .replace("OUT=$HOME/traceml_runs", f"OUT={out}")
              .replace("srun traceml run train.py", f"srun {sys.executable} -m traceml_tui run "
                                                    f"{EXAMPLES / 'ddp_toy.py'}")
              .replace("-- --epochs 10", "--master-addr 127.0.0.1 --headless -- --steps 30"))
    assert "ddp_toy.py" in script and "--nodes=2" in script  # the example still has them
    batch = tmp_path / "train.sbatch"
    batch.write_text(script)
    done = subprocess.run(["sbatch", "--wait", f"--output={tmp_path}/slurm-%j.out",
                           str(batch)], env={**slurm, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    logs = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert done.returncode == 0, done.stderr + logs[-3000:]
    job_id = done.stdout.split()[-1]
    run_dir = out / f"ddp_toy-slurm{job_id}"
    doc = json.loads((run_dir / "final_summary.json").read_text())
    assert doc["complete"] and doc["run"]["exit_code"] == 0 and doc["run"]["nnodes"] == 2
    assert [r["steps"] for r in doc["ranks"]] == [30] * doc["run"]["world_size"]


def test_srun_on_two_nodes_names_the_slow_rank(slurm, tmp_path):
    """One srun line on two nodes: one traceml run per node, one job, one summary."""
    out = tmp_path / "runs"
    done = _srun_straggler(slurm, out, nodes=2, nproc=1)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = out.iterdir()
    doc = json.loads((run_dir / "final_summary.json").read_text())
    assert doc["run"]["nnodes"] == 2 and doc["run"]["world_size"] == 2
    assert (doc["diagnosis"]["label"], doc["diagnosis"]["rank"]) == ("INPUT STRAGGLER", 1)
