"""The committed gRPC module is what grpcio-tools makes of the .proto, and the .proto
is the protocol's: every message we define matches tritonclient's own, field by field.
Also the command line's parts that need no server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiodla.serve import parse_model
from aiodla.serve._pb import _generate
from aiodla.serve._pb import grpc_service_pb2 as ours

REPO = Path(__file__).resolve().parents[2]


def test_regenerating_gives_the_committed_files(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    for path in _generate.generate(tmp_path):
        committed = _generate.HERE / path.name
        assert path.read_text() == committed.read_text(), (
            f"{committed} is stale: run python -m aiodla.serve._pb._generate"
        )


def fields(descriptor: Any) -> list[tuple[Any, ...]]:
    rows = []
    for field in descriptor.fields:
        kind = field.message_type.full_name if field.message_type else field.type
        rows.append((field.number, field.name, kind, field.is_repeated))
    for nested in descriptor.nested_types:
        rows.append((nested.name, fields(nested)))
    return rows


def test_messages_and_service_match_tritonclient() -> None:
    from tritonclient.grpc import service_pb2 as triton

    ours_file, theirs_file = ours.DESCRIPTOR, triton.DESCRIPTOR
    assert ours_file.package == theirs_file.package == "inference"
    assert ours_file.message_types_by_name
    for name, message in ours_file.message_types_by_name.items():
        assert fields(message) == fields(theirs_file.message_types_by_name[name]), name
    service = ours_file.services_by_name["GRPCInferenceService"]
    theirs = theirs_file.services_by_name["GRPCInferenceService"]
    for method in service.methods:
        other = theirs.methods_by_name[method.name]
        assert method.input_type.full_name == other.input_type.full_name
        assert method.output_type.full_name == other.output_type.full_name


def test_model_names() -> None:
    assert parse_model("models/det.bin") == ("det", "models/det.bin")
    assert parse_model("cam=models/det.bin") == ("cam", "models/det.bin")
    with pytest.raises(ValueError, match="PATH or NAME=PATH"):
        parse_model("=x.bin")


def test_without_the_extra_the_command_says_how_to_get_it() -> None:
    code = (
        "import sys; sys.modules['aiohttp'] = None\n"
        "from aiodla._cli import main; main(['serve', 'x.bin'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert done.returncode == 1
    assert "pip install 'aiodla[serve]'" in done.stderr, done.stderr


def test_two_models_of_one_name_are_refused(tmp_path: Path) -> None:
    from support import affine_model

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in ("a", "b"):
        (tmp_path / folder / "det.bin").write_bytes(affine_model())
    done = subprocess.run(
        [sys.executable, "-m", "aiodla", "serve", str(tmp_path / "a/det.bin"), str(tmp_path / "b/det.bin"), "--runtime", "emulated"],
        capture_output=True, text=True, cwd=REPO, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "two models named 'det'" in done.stderr, done.stderr
