"""``aiodla compile``: from a detector's ONNX export to a loadable the DLA runs whole.

:func:`compile_model` cuts the export's decode tail at the raw per-scale heads (NVIDIA's
ONNX GraphSurgeon), checks every remaining layer against the DLA's layer rules
(:func:`check_layers`, ``dla_rules.json``), quantizes with explicit Q/DQ nodes when
asked, and builds (where TensorRT is), writes the build command (where it is not), or
emulates the result; :meth:`aiodla.Detect.for_model` then reads the Detect that
replaces the tail. Needs ``aiodla[compile]``.
"""

from ._compile import CompileError as CompileError
from ._compile import CompileResult as CompileResult
from ._compile import compile_model as compile_model
from ._exporter import export_output as export_output
from ._exporter import exporter_detections as exporter_detections
from ._heads import HeadCut as HeadCut
from ._rules import Finding as Finding
from ._rules import check_layers as check_layers

__all__ = (
    "CompileError",
    "CompileResult",
    "Finding",
    "HeadCut",
    "check_layers",
    "compile_model",
    "export_output",
    "exporter_detections",
)
