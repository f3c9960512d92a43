"""Emulator loadables: aiodla's own model format for machines without a DLA.

Build one with :func:`make_loadable`; the emulated runtime and the GPU stand-in
``libcudla.so.1`` both run it. The byte format is documented in ``_format``; the
model spec (a model's tensors as JSON, :func:`read_spec_document`) in ``_spec``.
"""

from ._format import EmulatorModel as EmulatorModel
from ._format import is_emulator_loadable as is_emulator_loadable
from ._format import make_loadable as make_loadable
from ._format import parse_loadable as parse_loadable
from ._spec import read_spec_document as read_spec_document

__all__ = (
    "EmulatorModel",
    "is_emulator_loadable",
    "make_loadable",
    "parse_loadable",
    "read_spec_document",
)
