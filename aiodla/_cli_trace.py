"""``aiodla trace-plot``: a trace that ``engine.trace()`` or ``aiodla bench --trace``
wrote, drawn as a picture (see ``aiodla._trace_plot``)."""

from __future__ import annotations

import importlib.util

import click

from ._cli_frame import CommandError, debug_option
from ._trace_plot import COLORINGS, plot_trace, read_trace

__all__ = ["trace_option", "trace_plot"]

trace_option = click.option(
    "--trace",
    type=click.Path(dir_okay=False, writable=True),
    metavar="T.json",
    help="Write the run's timeline there (Chrome trace JSON; see 'aiodla trace-plot').",
)


@click.command("trace-plot", short_help="Draw a trace's timeline into a PNG or SVG.")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.argument("out", type=click.Path(dir_okay=False, writable=True))
@click.option(
    "--color",
    type=click.Choice(COLORINGS),
    default="model",
    show_default=True,
    help="Colour the DLA tasks by model, or each request by its state.",
)
@click.option("--start", type=float, metavar="MS", help="Draw from MS ms into the trace.")
@click.option("--end", type=float, metavar="MS", help="Draw until MS ms into the trace.")
@click.option("--title", help="The picture's title [default: the trace's engine].")
@debug_option
def trace_plot(
    trace: str, out: str, color: str, start: float | None, end: float | None, title: str | None
) -> None:
    """Draw TRACE (Chrome trace-event JSON from engine.trace() or 'aiodla bench
    --trace') into OUT: one row per DLA core over time, with the event loop's steps and
    the completion sweeps above. The format follows OUT's suffix (.png, .svg, .pdf).
    Open TRACE itself in Perfetto UI or chrome://tracing for every detail.
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise CommandError("trace-plot needs matplotlib: pip install matplotlib")
    document = read_trace(trace)
    engine = document.get("otherData", {}).get("engine", "engine")
    written = plot_trace(
        document, out, color=color, start=start, end=end, title=title or f"aiodla: {engine}"
    )
    click.echo(f"wrote {written}")
