"""The command line's frame: one-line errors with their exit status, and ``--debug``.

Every command of ``aiodla._cli`` runs inside :class:`ErrorReportingGroup`, which turns
any failure into one line on stderr naming its cause (exit status 1, 2 for a bad
argument, 130 when interrupted); ``--debug`` prints the traceback instead.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click

from ._errors import AiodlaError, status_name
from .runtime._protocol import CudaCallError, cudla_status
from .runtime._select import RUNTIME_CHOICES

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "CommandError",
    "ErrorReportingGroup",
    "debug_option",
    "describe",
    "one_line",
]

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

_F = TypeVar("_F", bound=Callable[..., Any])


class CommandError(click.ClickException):
    """A command could not do its work; the message names the cause, on one line."""


# -- the group and its error handling ----------------------------------------------------


def one_line(text: str) -> str:
    return " ".join(text.split())


def _wants_debug(args: Sequence[str]) -> bool:
    options = args[: args.index("--")] if "--" in args else args
    return "--debug" in options


class ErrorReportingGroup(click.Group):
    """Runs a command and turns every failure into one line and an exit status."""

    # Always standalone: every outcome, success included, ends in sys.exit here.
    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any
    ) -> NoReturn:
        argv = list(sys.argv[1:] if args is None else args)
        debug = _wants_debug(argv)
        if debug:
            logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")
        extra["standalone_mode"] = False
        try:
            result = super().main(argv, prog_name or "aiodla", **extra)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "aiodla"
            _fail(
                exc,
                debug,
                f"{where}: error: {exc.format_message()} (see '{where} --help')",
                EXIT_USAGE,
            )
        except click.Abort as exc:
            _fail(exc, debug, "aiodla: interrupted", EXIT_INTERRUPTED)
        except click.ClickException as exc:
            _fail(exc, debug, f"aiodla: error: {exc.format_message()}", exc.exit_code)
        except (AiodlaError, OSError, CudaCallError) as exc:
            _fail(exc, debug, f"aiodla: error: {describe(exc)}", EXIT_FAILURE)
        except Exception as exc:
            status = cudla_status(exc)
            if status is not None:  # a cuDLA call failed outside the engine's own wrapping
                _fail(
                    exc, debug, f"aiodla: error: cuDLA: {status_name(status)}: {exc}", EXIT_FAILURE
                )
            hint = "" if debug else " (run with --debug for the traceback)"
            _fail(
                exc,
                debug,
                f"aiodla: internal error: {type(exc).__name__}: {exc}{hint}",
                EXIT_FAILURE,
            )
        sys.exit(result if isinstance(result, int) else 0)


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        return f"cannot open {os.fsdecode(exc.filename)!r}: {exc.strerror}"
    return str(exc) or type(exc).__name__


def _fail(exc: BaseException, debug: bool, message: str, code: int) -> NoReturn:
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    click.echo(one_line(message), err=True)
    sys.exit(code)


def debug_option(function: _F) -> _F:
    # main() reads --debug from the raw arguments, so that it applies even to a failure
    # in parsing them; declaring it here makes it legal in every position.
    return click.option(
        "--debug",
        is_flag=True,
        expose_value=False,
        help="On error, print the full traceback too.",
    )(function)


# -- options shared by the commands that open engines -----------------------------------------


def parse_cores(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        cores = tuple(int(part) for part in value.split(","))
    except ValueError:
        cores = ()
    if not cores or min(cores) < 0:
        raise click.BadParameter(f"{value!r} must be DLA core numbers joined by commas, e.g. 0,1")
    return cores


def cores_option(help: str) -> Callable[[_F], _F]:
    return click.option(
        "--cores", default="0,1", show_default=True, callback=parse_cores, help=help
    )


# A model file is data: the compute function an emulator loadable names runs only when
# the user says so (see aiodla.emulator._compute).
def _compute_from_here(ctx: click.Context, param: click.Parameter, trusted: bool) -> bool:
    # The compute module a loadable names is the user's, beside their model
    # ('--compute ci_reference:compute'); 'aiodla' as an installed script has no
    # working directory on its path (python -m would), so it is added, last, so that
    # an installed module of the same name still wins.
    if trusted and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    return trusted


trust_compute_option = click.option(
    "--trust-compute",
    is_flag=True,
    callback=_compute_from_here,
    help="Import and run the compute function (MODULE:FUNCTION) that an emulator "
    "loadable names; only for files you trust. Its module is looked for on the Python "
    "path and, after it, in the working directory.",
)


def count_option(name: str, default: int, help: str) -> Callable[[_F], _F]:
    """An option that counts something (an int >= 1), its default shown."""
    return click.option(
        name, type=click.IntRange(min=1), default=default, show_default=True, help=help
    )


def seconds_option(
    name: str, default: float, help: str, *, above_zero: bool = False
) -> Callable[[_F], _F]:
    """An option of seconds (>= 0, or > 0 with ``above_zero``), its default shown."""
    return click.option(
        name,
        type=click.FloatRange(min=0, min_open=above_zero),
        default=default,
        show_default=True,
        metavar="S",
        help=help,
    )


def runtime_option(help: str = "Which runtime runs MODEL.") -> Callable[[_F], _F]:
    """``--runtime``: of every command that runs a model."""
    return click.option(
        "--runtime",
        type=click.Choice(RUNTIME_CHOICES),
        default="auto",
        show_default=True,
        help=help,
    )


streams_option = count_option("--streams", 2, "CUDA streams (slots) per core.")
