"""Environment variables through which `traceml run` hands the agent its run identity.

Shared by the launcher (which sets them) and the agent (which reads them), so the
names live in one place.
"""

ENDPOINT = "TRACEML_ENDPOINT"  # tcp://host:port of the collector's ingest socket
RUN_NAME = "TRACEML_RUN_NAME"
RUN_DIR = "TRACEML_RUN_DIR"
DISABLE = "TRACEML_DISABLE"  # "1": the agent does nothing (an escape hatch for users)
DEBUG = "TRACEML_DEBUG"  # "1": the agent prints what it installs
SECRET = "TRACEML_SECRET"  # the run's 64-hex-character secret, from which its CURVE keys derive
# host:port of torchrun's store holding the run's secret (agent/handover.py), for nodes
# that have neither $TRACEML_SECRET nor a shared run folder.
SECRET_STORE = "TRACEML_SECRET_STORE"
# torchrun's own: which attempt this worker is (0 first; it rises on every restart of the
# group under --max-restarts). The agent sends it in its hello (judge/attempts.py).
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
