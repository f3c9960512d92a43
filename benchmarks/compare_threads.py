"""CPU per request by thread at two revisions of aiodla, interleaved in one run.

Each round runs ``bench_threads.py`` once (every setting, one repeat) against each tree,
in a fresh process and alternating which goes first, so the two revisions see the same
machine: noise on a shared machine moves both. Prints, per setting, the median over
rounds (min..max) of the loop's, the poller's and the host's CPU per request and x ideal
for each tree, the ratio new / base, the light-load p50 / busy-poll floor, and the
issue's two ratios: host CPU per request at 1 ms and 3.8 ms over the zero-service host
cost, measured in the same run.

Usage (a tree is a directory holding an ``aiodla`` package, e.g. ``git archive`` output)::

    python benchmarks/compare_threads.py --base /tmp/base --new . [--rounds 5]
        [--runtime emulated|cuda] [--seconds 1.0] [--json PATH] [-- extra bench_threads args]
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
from typing import Any

HERE = Path(__file__).resolve().parent
COLUMNS = ("loop_us", "poller_us", "host_us", "x_ideal")


def one_run(tree: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "threads.json"
        command = [
            sys.executable,
            str(HERE / "bench_threads.py"),
            "--runtime",
            args.runtime,
            "--repeats",
            "1",
            "--seconds",
            str(args.seconds),
            "--json",
            str(out),
            *extra,
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(HERE)])}
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        report: dict[str, Any] = json.loads(out.read_text())
    return report


def median_of(rounds: list[dict[str, Any]], case: str, column: str) -> list[float]:
    return [r["results"][case][column]["median"] for r in rounds]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def zero_ratios(report: dict[str, Any]) -> dict[str, float]:
    """Host CPU per request at 1 ms and 3.8 ms (saturated) over the zero-service cost."""
    results = report["results"]
    zero = results["0 us saturated"]["host_us"]["median"]
    return {
        case.split(" us")[0] + " us / 0 us": results[case]["host_us"]["median"] / zero
        for case in ("1000 us saturated", "3800 us saturated")
        if case in results
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--new", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runtime", choices=("emulated", "cuda"), default="emulated")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--json", type=Path)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    trees = {"base": args.base.resolve(), "new": args.new.resolve()}
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "new": []}
    for round_number in range(args.rounds):
        order = ("base", "new") if round_number % 2 == 0 else ("new", "base")
        for name in order:
            runs[name].append(one_run(trees[name], args, extra))
            print(f"round {round_number + 1}/{args.rounds}: {name} done", flush=True)
    cases = list(runs["base"][0]["results"])
    summary: dict[str, Any] = {}
    print(
        f"\nCPU per request (us) by thread, {args.runtime} runtime, median of {args.rounds} "
        "interleaved rounds (min..max); ratio new / base of the medians"
    )
    for case in cases:
        summary[case] = {}
        cells = []
        for column in COLUMNS:
            base = spread(median_of(runs["base"], case, column))
            new = spread(median_of(runs["new"], case, column))
            ratio = new["median"] / base["median"] if base["median"] else float("nan")
            summary[case][column] = {"base": base, "new": new, "new_over_base": ratio}
            digits = 1 if column.endswith("_us") else 3
            cells.append(
                f"{column.removesuffix('_us')} "
                f"{base['median']:.{digits}f}->{new['median']:.{digits}f} "
                f"({new['min']:.{digits}f}..{new['max']:.{digits}f}) x{ratio:.2f}"
            )
        print(f"{case:<20} " + " | ".join(cells))
    for name in ("base", "new"):
        light = [r["light"]["p50_over_floor"]["median"] for r in runs[name] if "light" in r]
        ratios = [zero_ratios(r) for r in runs[name]]
        keys = ratios[0].keys() if ratios else []
        summary[f"{name} ratios"] = {key: spread([r[key] for r in ratios]) for key in keys}
        if light:
            summary[f"{name} ratios"]["light p50 / floor"] = spread(light)
        text = ", ".join(
            f"{key} {value['median']:.2f} ({value['min']:.2f}..{value['max']:.2f})"
            for key, value in summary[f"{name} ratios"].items()
        )
        print(f"{name}: {text}")
    if args.json:
        report = {
            "summary": summary,
            "trees": {name: str(path) for name, path in trees.items()},
            "revisions": {name: runs[name][0].get("revision") for name in runs},
            "rounds": runs,
            "parameters": {"runtime": args.runtime, "seconds": args.seconds, "extra": extra},
        }
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
