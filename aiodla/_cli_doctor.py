"""The ``aiodla doctor`` command: the checks of ``_doctor``, as lines or as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ._cli_frame import EXIT_FAILURE, debug_option, seconds_option
from ._doctor import Host, diagnose

__all__ = ["doctor_command"]


@click.command(name="doctor", short_help="Check that this machine is ready for the DLA.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (see docs).")
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/"),
    envvar="AIODLA_DOCTOR_ROOT",
    show_default=True,
    help="Read proc/device-tree and etc/nv_tegra_release under this directory.",
)
@seconds_option(
    "--timeout",
    30.0,
    "Seconds each probe (the CUDA stack, nvpmodel, jetson_clocks) may take.",
    above_zero=True,
)
@debug_option
def doctor_command(as_json: bool, root: Path, timeout: float) -> int:
    """Check the platform, cuDLA, the DLA cores, CUDA, cuda-bindings, NVRTC, the kernel
    cache, the power mode and clocks, shared memory and open-file limits.

    Each check is a line: ok, warn or fail, with the fix for warn and fail. Exits 0
    when nothing failed, 1 otherwise. Never hangs: every probe has a timeout.
    """
    report = diagnose(Host(root=root, timeout=timeout))
    if as_json:
        click.echo(json.dumps(report.document(), indent=2))
    else:
        for line in report.lines():
            click.echo(line)
    return 0 if report.ok else EXIT_FAILURE
