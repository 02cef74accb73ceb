"""The README's code examples run as written (every ```python block not meant for torchrun, and not an
excerpt of a script under examples/, which tests/test_examples.py runs and compares with the README)."""
from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "torchrun" not in b and not b.startswith("# excerpt of examples/")]


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, capsys):
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": "readme_example"})
