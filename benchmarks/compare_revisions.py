"""The engine at two git revisions, measured interleaved in one run.

For a change meant to keep performance (a restructuring, say): each round runs
``bench_engine``'s host-cost and throughput measurements once against the base
revision's ``aiodla`` and once against the new one's, alternating which goes first,
each in a fresh process. Prints medians, spread and the ratio new / base.

Usage::

    python benchmarks/compare_revisions.py --base 4c2f6ff [--new HEAD] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in the child: ``aiodla`` comes from the PYTHONPATH it was given.
CHILD = """
import asyncio, json, sys
sys.path.insert(0, {benchmarks!r})
import aiodla, bench_engine
latency, seconds, requests = {latency!r}, {seconds!r}, {requests!r}
async def main():
    await bench_engine.host_cost(requests)  # warm up: the first engine of a process pays more
    cost = await bench_engine.host_cost(requests)
    pinned = await bench_engine.host_cost(requests, pin=True)
    rate = await bench_engine.run_aiodla(latency, seconds, 64)
    return {{"aiodla": aiodla.__file__, "host_us": cost["host_us"], "loop_us": cost["loop_us"],
            "poller_us": cost["poller_us"], "host_one_cpu_us": pinned["host_us"],
            "throughput": rate}}
print(json.dumps(asyncio.run(main())))
"""


def export(revision: str, into: Path) -> Path:
    """The package as it was at ``revision``, unpacked under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "aiodla"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(source: Path, args: argparse.Namespace) -> dict[str, float]:
    code = CHILD.format(
        benchmarks=str(ROOT / "benchmarks"),
        latency=args.latency,
        seconds=args.seconds,
        requests=args.host_requests,
    )
    return run_in(source, code)


def run_in(source: Path, code: str) -> dict[str, float]:
    """Run ``code`` in a fresh Python whose ``aiodla`` is the one under ``source``; the
    JSON object its last line prints, less its ``aiodla`` key (the package's path,
    checked to be under ``source``)."""
    env = {**os.environ, "PYTHONPATH": str(source)}
    out = subprocess.run(
        # Run from the tree itself: the current directory comes first on sys.path.
        [sys.executable, "-c", code],
        env=env,
        cwd=source,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    assert result.pop("aiodla").startswith(str(source)), "measured the wrong aiodla"  # type: ignore[attr-defined]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--new", default="HEAD", help="git revision to measure")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--latency", type=float, default=0.001)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--host-requests", type=int, default=5000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temp:
        base, new = Path(temp, "base"), Path(temp, "new")
        base.mkdir()
        new.mkdir()
        sources = {"base": export(args.base, base), "new": export(args.new, new)}
        runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
        for round_number in range(args.rounds):
            order = ["base", "new"] if round_number % 2 == 0 else ["new", "base"]
            for name in order:
                runs[name].append(measure(sources[name], args))
    print(
        f"base {args.base} against {args.new}, {args.rounds} interleaved rounds "
        f"(median, min..max); host cost at zero latency, throughput at "
        f"{args.latency * 1e3:g} ms x 2 cores, c=64"
    )
    summary = {}
    for key, unit in (
        ("host_us", "us/request"),
        ("loop_us", "us/request"),
        ("poller_us", "us/request"),
        ("host_one_cpu_us", "us/request"),
        ("throughput", "requests/s"),
    ):
        row = {}
        for name in ("base", "new"):
            values = [run[key] for run in runs[name]]
            row[name] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
        ratio = row["new"]["median"] / row["base"]["median"]
        summary[key] = {**row, "ratio": ratio}
        print(
            f"  {key:15} base {row['base']['median']:9.1f} ({row['base']['min']:.1f}.."
            f"{row['base']['max']:.1f})  new {row['new']['median']:9.1f} "
            f"({row['new']['min']:.1f}..{row['new']['max']:.1f}) {unit}  new/base {ratio:.3f}"
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(
                {"base": args.base, "parameters": vars(args), "summary": summary, "runs": runs},
                file,
                indent=2,
            )


if __name__ == "__main__":
    main()
