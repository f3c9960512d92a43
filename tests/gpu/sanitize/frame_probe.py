"""Does a CUDA call keep its Python caller's caller alive?

Under compute-sanitizer (synccheck, 6accc63) tests/gpu's pool-memory test finds four
finished requests kept alive by the frame one level above the Python function that
makes a launch (``_launch`` above ``launch_kernel``, ``enqueue_new`` above
``launch_graph``), with one reference that no object the collector sees holds. This
probe asks the question without aiodla: for each CUDA call, a function ``outer`` holds
a marker and calls ``call``, which makes the CUDA call; once ``outer`` has returned,
its marker must be gone. Printed per call: ``kept`` (outer's frame outlived it) or
``freed``. Run it plain and under each tool, with and without host backtraces:

    python3 tests/gpu/sanitize/frame_probe.py
    compute-sanitizer --tool synccheck python3 tests/gpu/sanitize/frame_probe.py
    compute-sanitizer --tool synccheck --show-backtrace no python3 tests/gpu/sanitize/frame_probe.py

Exit status 1 when any call kept a frame.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Callable
from typing import Any

KERNEL = b'extern "C" __global__ void nothing() {}'


class Marker:
    pass


def call(function: Callable[..., Any], *args: Any) -> None:
    """The frame that makes the CUDA call (the current frame while it runs)."""
    result = function(*args)
    error = result[0] if isinstance(result, tuple) else result
    if int(error):
        raise RuntimeError(f"{function.__name__} failed: {error!r}")


def outer(function: Callable[..., Any], *args: Any) -> weakref.ref[Marker]:
    """The caller's caller: its marker lives exactly as long as its frame."""
    marker = Marker()
    call(function, *args)
    return weakref.ref(marker)


def kernel_function() -> Any:
    from cuda.bindings import driver, nvrtc

    (err, program) = nvrtc.nvrtcCreateProgram(KERNEL, b"probe.cu", 0, [], [])
    assert int(err) == 0, err
    (err,) = nvrtc.nvrtcCompileProgram(program, 0, [])
    assert int(err) == 0, err
    err, size = nvrtc.nvrtcGetPTXSize(program)
    ptx = b" " * size
    (err,) = nvrtc.nvrtcGetPTX(program, ptx)
    assert int(err) == 0, err
    err, module = driver.cuModuleLoadData(ptx)
    assert int(err) == 0, err
    err, function = driver.cuModuleGetFunction(module, b"nothing")
    assert int(err) == 0, err
    return function


def main() -> int:
    from cuda.bindings import driver
    from cuda.bindings import runtime as rt

    (err,) = rt.cudaFree(0)  # the primary context, current on this thread
    assert int(err) == 0, err
    err, stream = rt.cudaStreamCreate()
    assert int(err) == 0, err
    err, event = rt.cudaEventCreate()
    assert int(err) == 0, err
    err, memory = rt.cudaMallocAsync(64, stream)
    assert int(err) == 0, err
    function = kernel_function()

    err, graph = rt.cudaGraphCreate(0)
    assert int(err) == 0, err
    err, _node = rt.cudaGraphAddEmptyNode(graph, None, 0)
    assert int(err) == 0, err
    err, executable = rt.cudaGraphInstantiate(graph, 0)
    assert int(err) == 0, err

    calls: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
        ("cudaStreamQuery", rt.cudaStreamQuery, (stream,)),
        ("cudaEventRecord", rt.cudaEventRecord, (event, stream)),
        ("cudaMemsetAsync", rt.cudaMemsetAsync, (memory, 0, 64, stream)),
        (
            "cuLaunchKernel",
            driver.cuLaunchKernel,
            (function, 1, 1, 1, 32, 1, 1, 0, int(stream), 0, 0),
        ),
        ("cudaGraphLaunch", rt.cudaGraphLaunch, (executable, stream)),
    ]
    kept = 0
    for name, function_, args in calls:
        refs = [outer(function_, *args) for _ in range(3)]
        rt.cudaStreamSynchronize(stream)
        gc.collect()
        alive = sum(ref() is not None for ref in refs)
        kept += alive
        print(f"{name:16s} {'kept' if alive else 'freed'} ({alive} of {len(refs)})", flush=True)
    return 1 if kept else 0


if __name__ == "__main__":
    sys.exit(main())
