"""``aiodla serve``: the KServe v2 / Triton inference protocol over HTTP and gRPC
(the ``aiodla[serve]`` extra).

::

    async with Engine("det.bin") as engine, Server({"det": engine}) as server:
        ...   # tritonclient.http on 127.0.0.1:8000, tritonclient.grpc on :8001

or from the command line: ``aiodla serve det.bin --http 127.0.0.1:8000``.

The names are re-exported on first use: the command line imports this package to list
``aiodla serve`` on a base install, which lacks the extra's libraries.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._app import Server as Server
    from ._app import ServeStatistics as ServeStatistics
    from ._app import parse_model as parse_model
    from ._app import serve as serve
    from ._kserve import DATATYPES as DATATYPES
    from ._served import ServedModel as ServedModel

__all__ = ("DATATYPES", "ServeStatistics", "ServedModel", "Server", "parse_model", "serve")

_WHERE = {name: "._app" for name in __all__} | {"DATATYPES": "._kserve", "ServedModel": "._served"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)
