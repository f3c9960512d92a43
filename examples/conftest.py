"""Lets ``pytest examples/detector_tests.py`` run from the repository root, as its
docstring says: the repository's pytest settings disable aiodla's plugin entry point
(tests/conftest.py loads it so coverage starts first), so the examples load it here.
A project of one's own needs none of this: installed aiodla's entry point loads it."""

pytest_plugins = ["aiodla.testing.plugin"]
