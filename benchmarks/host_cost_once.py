"""One run of bench_engine's host-cost measurement, for instruction counting.

Timings on a shared virtual machine vary by tens of percent; instruction counts do
not. Run it under callgrind twice, with N and N + 1000 requests, and divide the
difference of the event-loop thread's totals by 1000 (the first N absorb start-up)::

    valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file=cg.100 \\
        python benchmarks/host_cost_once.py 100
    valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file=cg.1100 \\
        python benchmarks/host_cost_once.py 1100
    grep summary: cg.100-01 cg.1100-01      # thread 01 is the event loop's

Use the interpreter binary itself (not a pyenv shim), and PYTHONPATH to pick the tree
to measure.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine

if __name__ == "__main__":
    asyncio.run(bench_engine.host_cost(int(sys.argv[1])))
