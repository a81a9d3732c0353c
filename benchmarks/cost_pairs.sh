#!/usr/bin/env bash
# The collector's cost, this checkout against an older one, in one run on a quiet box:
#   bash benchmarks/cost_pairs.sh OLD_FOLDER OUT [NEW_16K_S] [OLD_16K_S] [DIRECT_S] [ROUNDS]
# OLD_FOLDER links the old tree's traceml_tui, and its agent as traceml_agent (put on
# PYTHONPATH; e.g. a `git worktree add --detach` of the old commit). The scripts run
# from /tmp so this checkout is not on the path; OUT says where each side's code came
# from. Direct 1,024 ranks (DIRECT_S, default 20 s, ROUNDS alternating rounds, default 2:
# 20 s rounds move a few points between runs here, 60 s rounds about one), 1,024 through
# 128 relays (120 s), 16,384 through 2,048 relays (NEW_16K_S, default 600; old OLD_16K_S,
# 300; 0 skips the relay soaks, for direct rounds alone).
set -u
OLD=$1; OUT=$2; NEW16=${3:-600}; OLD16=${4:-300}; DIRECT=${5:-20}; ROUNDS=${6:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
H=$(git -C "$HERE" rev-parse --short HEAD)
cd /tmp
code() { python -c 'import traceml_tui, traceml_agent; print(traceml_tui.__file__, traceml_agent.__file__)'; }
side() { if [ "$1" = old ]; then PYTHONPATH=$OLD "${@:2}"; else "${@:2}"; fi; }
echo "== $(date -u) load: $(cut -d' ' -f1-3 /proc/loadavg) HEAD $H, old via PYTHONPATH=$OLD" >> "$OUT"
echo "old code from: $(PYTHONPATH=$OLD code)" >> "$OUT"
echo "new code from: $(code)" >> "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  for s in new old; do
    echo "-- direct 1024 ${DIRECT}s $s round $r $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" >> "$OUT"
    side $s python "$HERE/collector_ingest.py" --ranks 1024 --seconds "$DIRECT" 2>&1 \
      | grep -E "collector:|evaluate|write_live|KEPT" >> "$OUT"
  done
done
if [ "$NEW16" = 0 ]; then echo "== done $(date -u)" >> "$OUT"; exit 0; fi
for s in new old; do
  echo "-- soak 1024 relays 120s $s $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" >> "$OUT"
  side $s python "$HERE/soak.py" --ranks 1024 --step-ms 100 --seconds 120 2>&1 | tail -1 >> "$OUT"
done
for s in new old; do
  secs=$NEW16; [ $s = old ] && secs=$OLD16
  echo "-- soak 16384 relays ${secs}s $s $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" >> "$OUT"
  side $s python "$HERE/soak.py" --ranks 16384 --ranks-per-node 8 --seconds "$secs" 2>&1 | tail -1 >> "$OUT"
done
echo "== done $(date -u)" >> "$OUT"
