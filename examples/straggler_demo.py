"""The straggler demo: 4 ranks of DDP on CPU, rank 2 loading its batches slowly.

    traceml run examples/straggler_demo.py --nproc-per-node=4 --headless

traceml should name rank 2 and the dataloader phase (INPUT STRAGGLER), even though
the other ranks' backward passes are what get slower (they wait for rank 2 in the
allreduce: that wait is reported as "sync", not as their compute).
"""

import sys

from ddp_toy import main

DEFAULTS = {"--scenario": "input", "--rank": "2", "--delay-ms": "30", "--steps": "150"}

if __name__ == "__main__":
    for flag, value in DEFAULTS.items():
        if flag not in sys.argv:
            sys.argv += [flag, value]
    main()
