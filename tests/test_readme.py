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


@pytest.fixture
def s3_env(monkeypatch):
    """What the object-storage example expects of its shell: a loopback S3 server (moto) holding the bucket
    "latents", named by the standard AWS variables."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto.server")
    from latentfast.testing import create_bucket, s3_options, s3_server

    with s3_server() as endpoint:
        create_bucket(endpoint, "latents")
        options = s3_options(endpoint)
        for var, key in (("AWS_ENDPOINT_URL", "endpoint_url"), ("AWS_ACCESS_KEY_ID", "access_key_id"),
                         ("AWS_SECRET_ACCESS_KEY", "secret_access_key"), ("AWS_REGION", "region")):
            monkeypatch.setenv(var, options[key])
        yield endpoint


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, capsys, request):
    if "s3://" in BLOCKS[index]:
        request.getfixturevalue("s3_env")
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": "readme_example"})
