"""Triton's own client against ``aiodla serve``: health, metadata, and one inference
over HTTP (binary tensors) and over gRPC, for any model the server serves.

Start a server (on a Jetson, drop ``--runtime emulated`` and serve your loadable)::

    aiodla emulate --input x:1x3x32x32:float16:chw16 --output y:1x3x32x32:float32 -o det.bin
    aiodla serve det.bin --runtime emulated          # HTTP :8000, gRPC :8001

then::

    pip install 'tritonclient[http,grpc]'
    python examples/triton_client.py det [--http 127.0.0.1:8000] [--grpc 127.0.0.1:8001]
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

# tritonclient ships no type information (no py.typed): its calls are Any here.
import tritonclient.grpc as grpcclient  # type: ignore[import-untyped]
import tritonclient.http as httpclient  # type: ignore[import-untyped]
from tritonclient.utils import (  # type: ignore[import-untyped]
    InferenceServerException,
    triton_to_np_dtype,
)


def random_inputs(metadata: dict[str, Any], module: Any) -> list[Any]:
    """One random tensor per input, of the shape and datatype the server states (a
    size that may vary, -1, as a 480 x 640 camera frame's)."""
    rng = np.random.default_rng(0)
    inputs = []
    for tensor in metadata["inputs"]:
        stated = [int(d) for d in tensor["shape"]]
        shape = [d if d >= 0 else (480, 640)[min(i, 1)] for i, d in enumerate(stated)]
        dtype = np.dtype(triton_to_np_dtype(tensor["datatype"]))
        if dtype.kind in "iu":
            values = rng.integers(0, 100, shape).astype(dtype)
        else:
            values = rng.standard_normal(shape).astype(dtype)
        infer_input = module.InferInput(tensor["name"], shape, tensor["datatype"])
        infer_input.set_data_from_numpy(values)  # HTTP: binary tensor data extension
        inputs.append(infer_input)
    return inputs


def describe(name: str, out: Any) -> str:
    mean = f", mean {out.mean():.4f}" if out.size else ""  # (a detector's may have no rows)
    return f"{name}: {out.dtype} {out.shape}{mean}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--http", default="127.0.0.1:8000")
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    args = parser.parse_args()

    http = httpclient.InferenceServerClient(args.http)
    print("HTTP live:", http.is_server_live(), "ready:", http.is_server_ready())
    metadata = http.get_model_metadata(args.model)
    print("metadata:", metadata)
    result = http.infer(args.model, random_inputs(metadata, httpclient), request_id="http-1")
    for tensor in metadata["outputs"]:
        print("HTTP", describe(tensor["name"], result.as_numpy(tensor["name"])))
    try:
        http.infer("no-such-model", [])
    except InferenceServerException as exc:
        print("unknown model:", exc.status(), exc.message())
    http.close()

    grpc = grpcclient.InferenceServerClient(args.grpc)
    print("gRPC live:", grpc.is_server_live(), "ready:", grpc.is_server_ready())
    # The deadline bounds the request on the server too: DEADLINE_EXCEEDED if it passes.
    result = grpc.infer(
        args.model, random_inputs(metadata, grpcclient), request_id="grpc-1", client_timeout=5.0
    )
    for tensor in metadata["outputs"]:
        print("gRPC", describe(tensor["name"], result.as_numpy(tensor["name"])))
    grpc.close()


if __name__ == "__main__":
    main()
