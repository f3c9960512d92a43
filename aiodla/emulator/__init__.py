"""Emulator loadables: aiodla's own model format for machines without a DLA.

Build one with :func:`make_loadable`; the emulated runtime and the GPU stand-in
``libcudla.so.1`` both run it. The byte format is documented in ``_format``; the
model spec (a model's tensors as JSON, :func:`read_spec_document`) in ``_spec``.

The emulated runtime can compute a model's real outputs instead of the loadable's op
(``compute=``, see ``_compute``): :func:`onnx_compute` runs the ONNX network the
loadable was built from, :func:`replay` answers with outputs recorded on a Jetson by
``aiodla record``.
"""

from ._compute import ComputeFunction as ComputeFunction
from ._format import EmulatorModel as EmulatorModel
from ._format import is_emulator_loadable as is_emulator_loadable
from ._format import make_loadable as make_loadable
from ._format import parse_loadable as parse_loadable
from ._onnx import OnnxCompute as OnnxCompute
from ._onnx import onnx_compute as onnx_compute
from ._recording import Replay as Replay
from ._recording import replay as replay
from ._spec import read_spec_document as read_spec_document

__all__ = (
    "ComputeFunction",
    "EmulatorModel",
    "OnnxCompute",
    "Replay",
    "is_emulator_loadable",
    "make_loadable",
    "onnx_compute",
    "parse_loadable",
    "read_spec_document",
    "replay",
)
