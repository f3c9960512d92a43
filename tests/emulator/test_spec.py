"""The model spec reader in its own module: ModelError for bad documents, and
``aiodla.testing`` reads specs without loading the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aiodla import ModelError, TensorSpec, _cli
from aiodla.emulator import read_spec_document
from aiodla.emulator._format import parse_loadable
from aiodla.emulator._spec import SPEC_FORMAT, SPEC_VERSION, fitting_op, read_spec, spec_document

from support import affine_model


def document() -> dict[str, object]:
    model = parse_loadable(affine_model())
    return spec_document("model.bin", model.descriptors, model)


class TestReader:
    def test_a_written_spec_reads_back_to_the_same_descriptors(self) -> None:
        model = parse_loadable(affine_model())
        inputs, outputs, settings = read_spec_document(document())
        assert (tuple(inputs), tuple(outputs)) == model.descriptors
        assert settings["op"] == model.op

    @pytest.mark.parametrize(
        ("change", "words"),
        [
            ({"format": "other"}, f'no "format": "{SPEC_FORMAT}"'),
            ({"version": SPEC_VERSION + 1}, "version 2"),
            ({"inputs": []}, "'inputs' must be a non-empty list"),
        ],
    )
    def test_a_bad_document_is_a_model_error(self, change: dict[str, object], words: str) -> None:
        with pytest.raises(ModelError, match=words):
            read_spec_document({**document(), **change}, "spec.json")

    def test_a_file_that_is_not_json_is_a_model_error_naming_it(self, tmp_path: Path) -> None:
        path = tmp_path / "spec.json"
        path.write_bytes(b"\xff not json")
        with pytest.raises(ModelError, match=r"spec\.json"):
            read_spec(str(path))

    def test_mix_fits_what_no_paired_op_does(self) -> None:
        a, b = TensorSpec("a", (1, 3, 4, 4)), TensorSpec("b", (1, 5, 2, 2))
        a2, b2 = TensorSpec("a2", (1, 3, 4, 4)), TensorSpec("b2", (1, 5, 2, 2))
        a1, b1 = TensorSpec("a1", (1, 3, 1, 1)), TensorSpec("b1", (1, 5, 1, 1))
        assert fitting_op([a, b], [a2, b2]) == "affine"
        assert fitting_op([a, b], [a1, b1]) == "mean_hw"
        assert fitting_op([a, b], [a1, b2]) == "mix"  # one pair each way
        assert fitting_op([a, b], [b2, a2]) == "mix"  # output i is not input i's shape
        assert fitting_op([a, b], [a2]) == "mix"
        assert fitting_op([a], [TensorSpec("logits", (1, 1000, 1, 1))]) == "mix"

    def test_the_command_line_still_exports_the_reader(self) -> None:
        assert _cli.read_spec_document is read_spec_document


def test_the_testing_package_does_not_import_the_command_line() -> None:
    code = "import sys, aiodla.testing; print('aiodla._cli' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
