"""The settings ``aiodla compile`` writes beside a loadable: ``MODEL.bin.detect.json``.

One JSON document (schema ``aiodla-compiled/1``) says what replaced the graph's cut
tail and how the model's input was prepared when it was calibrated: ``detect`` (the
:class:`aiodla.Detect` keywords: head, classes, strides, anchors, reg_max, outputs),
``preprocess`` (the :class:`aiodla.ImagePreprocess` keywords but ``source``), ``input``
(name, height, width), and what the compiler did (``family``, ``source``, ``trimmed``,
``quantized``, ``build``, ``check``). :meth:`aiodla.Detect.for_model` reads it; this
module only reads and writes it (no ONNX needed).
"""

from __future__ import annotations

import json
import os
from typing import Any

from ._errors import ConfigurationError

__all__ = ["SCHEMA", "THRESHOLDS", "read_settings", "settings_path", "write_settings"]

SCHEMA = "aiodla-compiled/1"
SUFFIX = ".detect.json"
#: The Detect keywords a caller may set over the compiled ones: thresholds and caps.
THRESHOLDS = ("conf", "iou", "max_det", "max_candidates", "class_agnostic")


def settings_path(model: str | os.PathLike[str]) -> str:
    """Where the settings of ``model`` (the loadable's path) are: ``MODEL.bin.detect.json``."""
    return os.fspath(model) + SUFFIX


def write_settings(model: str | os.PathLike[str], document: dict[str, Any]) -> str:
    path = settings_path(model)
    with open(path, "w", encoding="utf-8") as file:
        json.dump({"schema": SCHEMA, **document}, file, indent=2)
        file.write("\n")
    return path


def read_settings(model: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings document of ``model``; ConfigurationError naming the file when it is
    missing, unreadable or not one."""
    if not isinstance(model, (str, os.PathLike)):
        raise ConfigurationError(f"model={model!r} must be the loadable's path")
    path = settings_path(model)
    try:
        with open(path, encoding="utf-8") as file:
            document = json.load(file)
    except FileNotFoundError:
        raise ConfigurationError(
            f"{path!r} does not exist: Detect.for_model reads the settings that 'aiodla "
            f"compile MODEL.onnx -o {os.fspath(model)}' writes beside the loadable"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot read {path!r}: {exc}") from exc
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise ConfigurationError(f"{path!r} is not an aiodla compile settings file ({SCHEMA})")
    for key in ("detect", "preprocess", "input"):
        if not isinstance(document.get(key), dict):
            raise ConfigurationError(f"{path!r} has no {key!r} object")
    return document
