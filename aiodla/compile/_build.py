"""The DLA build of a trimmed network: TensorRT's ``trtexec`` with the flags a cuDLA
standalone loadable needs, run where TensorRT is, written down where it is not.

Where ``trtexec`` is not installed but TensorRT's Python package is, the same build
runs through its API (:func:`build_with_api`): the DLA as the default device type, the
``DLA_STANDALONE`` engine capability, no ``GPU_FALLBACK`` flag, each I/O tensor FP16
in ``CHW16``.

``--useDLACore``, ``--buildDLAStandalone`` (a loadable cuDLA loads: every layer on the
DLA, no TensorRT engine around it) and no ``--allowGPUFallback``; FP16, plus INT8 for a
network with Q/DQ nodes (explicit quantization; the layers left without Q/DQ run in
FP16). The I/O formats are the DLA's native ones, one per tensor from its shape and
precision (:func:`io_formats`): cuDLA takes no reformatting outside the DLA, so a
standalone build without them fails (NVIDIA-AI-IOT/cuDLA-samples #34, #36).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from .._errors import ModelError

__all__ = ["Build", "find_trtexec", "io_formats", "trtexec_command"]

#: Where JetPack installs trtexec (not on PATH by default).
JETPACK_TRTEXEC = "/usr/src/tensorrt/bin/trtexec"


@dataclasses.dataclass(frozen=True)
class Build:
    """The build: its command, and what running it gave (``built`` False where no
    TensorRT is: then ``reason`` says so)."""

    command: tuple[str, ...]
    built: bool
    reason: str
    log: str = ""

    @property
    def shell(self) -> str:
        return shlex.join(self.command)


def io_formats(shapes: Sequence[tuple[int, ...]]) -> tuple[str, ...]:
    """trtexec's I/O format per tensor (``type:format``): ``fp16:chw16`` for each 4-D
    tensor (FP16, channels in blocks of 16: the DLA's native feature layout, which
    cuDLA reads without reformatting), INT8 networks included: their input is the
    float image that ImagePreprocess writes, and their heads feed Detect, both without
    a quantization scale to carry. Any other rank is a ModelError: DLA I/O is 4-D."""
    formats = []
    for shape in shapes:
        if len(shape) != 4:
            raise ModelError(f"a DLA tensor is 4-D (N, C, H, W); this one is {list(shape)}")
        formats.append("fp16:chw16")
    return tuple(formats)


def trtexec_command(
    onnx: str,
    loadable: str,
    *,
    inputs: Sequence[tuple[int, ...]],
    outputs: Sequence[tuple[int, ...]],
    int8: bool,
    core: int = 0,
    trtexec: str = "trtexec",
) -> tuple[str, ...]:
    """The trtexec command that builds ``onnx`` into the standalone DLA ``loadable``."""
    command = [
        trtexec,
        f"--onnx={onnx}",
        f"--saveEngine={loadable}",
        f"--useDLACore={core}",
        "--buildDLAStandalone",
        "--fp16",
    ]
    if int8:
        command.append("--int8")
    command += [
        f"--inputIOFormats={','.join(io_formats(inputs))}",
        f"--outputIOFormats={','.join(io_formats(outputs))}",
    ]
    return tuple(command)


def find_trtexec() -> str | None:
    """trtexec on PATH, else JetPack's; None where TensorRT is not installed."""
    found = shutil.which("trtexec")
    if found:
        return found
    return JETPACK_TRTEXEC if os.access(JETPACK_TRTEXEC, os.X_OK) else None


def _tensorrt() -> Any:
    """TensorRT's Python package, or None where it is not installed."""
    try:
        import tensorrt
    except ImportError:
        return None
    return tensorrt


def build_with_api(
    trt: Any, command: tuple[str, ...], onnx: str, loadable: str, *, int8: bool, core: int
) -> Build:
    """The build of :func:`trtexec_command`, through TensorRT's Python API."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    with open(onnx, "rb") as file:
        parsed = parser.parse(file.read(), onnx)
    if not parsed:
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        return Build(command, built=False, reason=f"TensorRT cannot parse {onnx!r}: {errors}")
    config = builder.create_builder_config()
    config.default_device_type = trt.DeviceType.DLA
    config.DLA_core = core
    config.engine_capability = trt.EngineCapability.DLA_STANDALONE
    config.set_flag(trt.BuilderFlag.FP16)
    if int8:
        config.set_flag(trt.BuilderFlag.INT8)
    tensors = [network.get_input(i) for i in range(network.num_inputs)]
    tensors += [network.get_output(i) for i in range(network.num_outputs)]
    for tensor in tensors:  # io_formats' choice: FP16, CHW16
        tensor.dtype = trt.float16
        tensor.allowed_formats = 1 << int(trt.TensorFormat.CHW16)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        return Build(command, built=False, reason="TensorRT's builder failed (its log is above)")
    with open(loadable, "wb") as file:
        file.write(bytes(serialized))
    return Build(command, built=True, reason=f"built by TensorRT {trt.__version__}'s Python API")


def build(
    command: tuple[str, ...],
    loadable: str,
    trtexec: str | None,
    *,
    onnx: str = "",
    int8: bool = False,
    core: int = 0,
) -> Build:
    """Run the build where trtexec (or TensorRT's Python API) is; elsewhere say plainly
    that this machine cannot."""
    if trtexec is None:
        trt = _tensorrt()
        if trt is not None:
            return build_with_api(trt, command, onnx, loadable, int8=int8, core=core)
        return Build(
            command,
            built=False,
            reason=(
                "this machine cannot build a DLA loadable: neither TensorRT's trtexec nor its "
                "Python package is installed (both come with JetPack on a Jetson, trtexec at "
                "/usr/src/tensorrt/bin/trtexec); run the command there, beside the ONNX "
                "file it names"
            ),
        )
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        return Build(command, built=False, reason=f"cannot run {trtexec!r}: {exc}")
    log = (done.stdout or "") + (done.stderr or "")
    if done.returncode != 0 or not os.path.exists(loadable):
        tail = "\n".join(log.strip().splitlines()[-15:])
        return Build(
            command,
            built=False,
            reason=f"trtexec failed (exit {done.returncode}):\n{tail}",
            log=log,
        )
    return Build(command, built=True, reason="built by trtexec", log=log)
