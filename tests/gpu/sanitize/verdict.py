"""Read compute-sanitizer logs and say whether anything is wrong.

    python3 tests/gpu/sanitize/verdict.py [--trap DIR]... DIR...

Each DIR holds the logs of one sanitized command, one file per process
(``--log-file DIR/%p.log``). Every report counts as an error except the summaries and
banners, with one exception, and only in the directories given with ``--trap``: those
hold the run of the deliberate trapping-kernel test alone (a child process launches a
kernel that executes ``__trap()``, which loses its CUDA context on purpose). In that run
a process whose log shows the launch failure (error 719, cudaErrorLaunchFailure) is the
trapping child, and in that process only, the launch-failure reports, the trap itself
and the leaks (the child leaves with ``os._exit`` once the context is gone, freeing
nothing) are expected. Anything else in that process, and every report of any other
process, still counts.

Three more reports are expected wherever they appear, each at most once a process: the
CUDA errors that tests/gpu/test_runtime_gpu.py provokes on purpose through
cuda.bindings.runtime to check that CudaRuntime names them (DELIBERATE, below; matched
by call, error and a backtrace through cuda.bindings' cyruntime, never libcudla).

memcheck's leak reports (``Leaked N bytes at ...``, printed at exit with the host
backtrace of the allocation) are judged by that backtrace. The test frameworks'
allocators keep device memory pooled until the process ends, by design: CuPy's memory
pool (frames in ``cupy_backends`` / ``cupy/cuda``) and PyTorch's caching allocator
(``libc10_cuda``). A leak allocated through one of them is theirs and excused
(DEPENDENCY_ALLOCATORS). Every other leak counts, and in particular anything allocated
through aiodla's own paths (AIODLA_ALLOCATORS): ``cuda.bindings`` (the runtime's
``cyruntime``/``cydriver``, which aiodla's CUDA runtime calls) or the stand-in
``libcudla``, even when a dependency's frame is also on the stack.

NVIDIA's video decoder allocates inside PyNvVideoCodec's decoder: its decode surfaces
(CUDA arrays) and working memory in ``libnvcuvid`` on the stream's first sequence header
(``NvDecoder::HandleVideoSequence``), and PyNvVideoCodec's own output pictures
(``NvDecoder::HandlePictureDisplay``); they are freed only when that decoder is
destroyed. aiodla drops its decoder when a source's stream closes, however it ended
(tests/video/test_video_nvdec_planes.py holds that without a GPU), and copies each
picture into memory of its own (``cudaMalloc`` through cuda.bindings, which counts). A
leak whose allocation backtrace starts in ``libnvcuvid`` or PyNvVideoCodec, runs through
PyNvVideoCodec, and never through aiodla's own paths is the decoder library's and
excused (NVDEC_DECODER); anything else still counts.

cuda.bindings fills its table of driver entry points through ``cuGetProcAddress`` the
first time a driver call is made, asking for every function it knows; those the
installed driver does not have answer CUDA_ERROR_INVALID_VALUE or CUDA_ERROR_NOT_FOUND.
Such a report is the bindings' own probe and excused (BINDINGS_PROBE) when the failing
call is ``cuGetProcAddress`` and the first frame of its backtrace is inside the bindings'
``cydriver``; any other failing call, or a lookup from anywhere else, counts.

Prints one line a log and the unexcused reports; exits 1 when there is any, 0 otherwise.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PREFIX = "========= "
INFO = re.compile(
    r"^(COMPUTE-SANITIZER|ERROR SUMMARY|LEAK SUMMARY|RACECHECK SUMMARY|"
    r"Target application returned an error|Saved host backtrace|Warning: )"
)
LAUNCH_FAILURE = re.compile(
    r"error 719|cudaErrorLaunchFailure|CUDA_ERROR_LAUNCH_FAILED|unspecified launch failure"
)
TRAP = re.compile(r"\btrap\b|__trap|[Dd]evice-side trap|Hardware exception")
LEAK = re.compile(r"^Leaked [\d,]+ bytes")
# (call, error) of test_make_current_on_a_missing_device, test_timing_events_measure_a_task
# (elapsed time of an event made without timing) and test_out_of_memory_is_named.
DELIBERATE = (
    ("cudaSetDevice", "cudaErrorInvalidDevice (error 101)"),
    ("cudaEventElapsedTime", "cudaErrorInvalidResourceHandle (error 400)"),
    ("cudaMalloc", "cudaErrorMemoryAllocation (error 2)"),
)
BINDINGS_PROBE = re.compile(
    r"^Program hit CUDA_ERROR_(INVALID_VALUE|NOT_FOUND) \(error \d+\) due to .* on CUDA API "
    r"call to cuGetProcAddress(_v\d+)?\.\n[^\n]*\n[^\n]*in cydriver\."
)
DEPENDENCY_ALLOCATORS = re.compile(r"cupy_backends|cupy/cuda|cupy\.cuda|libc10_cuda")
AIODLA_ALLOCATORS = re.compile(r"cuda/bindings|cyruntime|cydriver|libcudla")
NVDEC_DECODER = re.compile(r"\bin (libnvcuvid\.so|PyNvVideoCodec)")
NVDEC_BINDINGS = re.compile(r"\bin PyNvVideoCodec")
SUMMARY = re.compile(r"^(ERROR SUMMARY: \d+ errors?|LEAK SUMMARY: .*|RACECHECK SUMMARY: .*)")


def records(text: str) -> tuple[list[str], list[str]]:
    """(reports, summary lines): a report is a line at the prefix's indent plus the
    indented lines below it (backtraces), joined by newlines."""
    reports: list[list[str]] = []
    summaries: list[str] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith(PREFIX.rstrip()):
            continue
        body = line[len(PREFIX) :] if line.startswith(PREFIX) else ""
        if not body.strip():
            current = None
        elif body.startswith(" "):
            if current is not None:
                current.append(body.strip())
        elif SUMMARY.match(body):
            summaries.append(body.strip())
            current = None
        elif INFO.match(body):
            current = None
        else:
            current = [body.strip()]
            reports.append(current)
    return ["\n".join(r) for r in reports], summaries


def dependency_leak(report: str) -> bool:
    """Whether a leak report's allocation backtrace runs through a test framework's
    pooling allocator and never through aiodla's own allocation paths."""
    frames = report.split("\n", 1)[1] if "\n" in report else ""
    return bool(DEPENDENCY_ALLOCATORS.search(frames)) and not AIODLA_ALLOCATORS.search(frames)


def nvdec_decoder_leak(report: str) -> bool:
    """Whether a leak report is of memory PyNvVideoCodec's decoder allocated: its first
    frame in libnvcuvid or PyNvVideoCodec, a frame of PyNvVideoCodec, none of aiodla's
    allocation paths."""
    first, _, frames = report.partition("\n")
    lines = [line for line in frames.split("\n") if line.startswith("Host Frame:")]
    return (
        bool(LEAK.match(first))
        and bool(lines)
        and bool(NVDEC_DECODER.search(lines[0]))
        and bool(NVDEC_BINDINGS.search(frames))
        and not AIODLA_ALLOCATORS.search(frames)
    )


def judge(directory: Path, trap: bool) -> tuple[list[str], list[str]]:
    """(lines to print, unexcused reports) for one command's logs."""
    lines: list[str] = []
    bad: list[str] = []
    logs = sorted(p for p in directory.glob("*.log") if p.is_file())
    if not logs:
        bad.append(f"{directory.name}: no sanitizer log was written")
    for log in logs:
        reports, summaries = records(log.read_text(errors="replace"))
        trapping = trap and any(LAUNCH_FAILURE.search(r) for r in reports)
        excused = [
            r
            for r in reports
            if trapping and (LAUNCH_FAILURE.search(r) or TRAP.search(r) or LEAK.match(r))
        ]
        seen: set[tuple[str, str]] = set()
        for r in reports:
            if r in excused:
                continue
            first = r.split("\n", 1)[0]
            for call, error in DELIBERATE:
                if (
                    (call, error) not in seen
                    and first.startswith(f"Program hit {error} ")
                    and first.endswith(f"on CUDA API call to {call}.")
                    and "cyruntime" in r
                    and "libcudla" not in r
                ):
                    seen.add((call, error))
                    excused.append(r)
                    break
        excused.extend(
            r
            for r in reports
            if r not in excused
            and (
                (LEAK.match(r) and dependency_leak(r))
                or nvdec_decoder_leak(r)
                or BINDINGS_PROBE.match(r)
            )
        )
        rest = [r for r in reports if r not in excused]
        # A summary that counts more errors than were printed (a print limit) still fails.
        counted = sum(
            int(m.group(1)) for s in summaries if (m := re.match(r"ERROR SUMMARY: (\d+)", s))
        )
        # racecheck ends with its own summary instead of an ERROR SUMMARY.
        for s in summaries:
            m = re.match(r"RACECHECK SUMMARY: .*\((\d+) errors?, (\d+) warnings?\)", s)
            if m and (int(m.group(1)) or int(m.group(2))):
                rest.append(s)
        if not any(s.startswith(("ERROR SUMMARY", "RACECHECK SUMMARY")) for s in summaries):
            rest.append("no ERROR SUMMARY: the sanitized process was killed before it ended")
        if counted > len(reports):
            rest.append(f"ERROR SUMMARY counts {counted} errors, {len(reports)} were printed")
        tag = " (the trapping child: its launch failures and leaks excused)" if trapping else ""
        lines.append(
            f"{directory.name}/{log.name}: {len(reports)} reports, {len(excused)} excused, "
            f"{len(rest)} errors{tag}; " + " | ".join(summaries)
        )
        bad.extend(f"{directory.name}/{log.name}: {r}" for r in rest)
    return lines, bad


def main(argv: list[str]) -> int:
    trap_dirs: list[Path] = []
    plain_dirs: list[Path] = []
    args = iter(argv)
    for arg in args:
        if arg == "--trap":
            trap_dirs.append(Path(next(args)))
        else:
            plain_dirs.append(Path(arg))
    problems: list[str] = []
    for directory, trap in [(d, False) for d in plain_dirs] + [(d, True) for d in trap_dirs]:
        lines, bad = judge(directory, trap)
        print("\n".join(lines))
        problems.extend(bad)
    if problems:
        print(f"\nsanitizer: {len(problems)} errors outside the deliberate trap:")
        for problem in problems[:200]:
            print("  " + problem.replace("\n", "\n    "))
        return 1
    print("\nsanitizer: 0 errors outside the deliberate trap")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
