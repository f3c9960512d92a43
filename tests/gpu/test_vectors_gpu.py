"""The stand-in's bytes equal the emulated runtime's, for every shared test vector.

Both runtimes are driven through the Runtime protocol alone (the same ModelSetup), so
this also holds the CUDA runtime's plumbing (descriptors, registration, copies, task
submission) to the emulated runtime's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiodla.runtime import EmulatedRuntime
from aiodla.runtime._cuda import CudaRuntime

from _setup import ModelSetup
from vectors import Vector, vectors

pytestmark = pytest.mark.gpu

VECTORS = vectors()


def _outputs(runtime: Any, vector: Vector, core: int) -> list[list[bytes]]:
    results = []
    # Overflow to inf and NaN to 0 are the format's defined results, not accidents.
    with (
        np.errstate(over="ignore", invalid="ignore"),
        ModelSetup(runtime, core, vector.loadable) as setup,
    ):
        setup.fill_outputs(0xA5)  # stale bytes a task must overwrite, padding included
        for buffers in vector.buffers:
            outputs, status = setup.run(buffers)
            assert status == 0
            results.append(outputs)
    return results


@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
@pytest.mark.parametrize("core", [0, 1])
def test_same_bytes_as_the_emulated_runtime(
    vector: Vector, core: int, runtime: CudaRuntime, standin: Any
) -> None:
    emulated = EmulatedRuntime(cores=2)
    try:
        expected = _outputs(emulated, vector, core)
    finally:
        emulated.close()
    got = _outputs(runtime, vector, core)
    for index, (want, have) in enumerate(zip(expected, got, strict=True)):
        for spec, a, b in zip(vector.model.outputs, want, have, strict=True):
            if a != b:
                diff = np.flatnonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8))
                pytest.fail(
                    f"{vector.name} request {index} output {spec.name!r}: {diff.size} bytes "
                    f"differ, first at {diff[:8].tolist()}"
                )
    assert standin.live_handles() == {"devices": 0, "modules": 0, "registrations": 0}
