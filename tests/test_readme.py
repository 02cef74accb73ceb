"""The code examples of the README and of the docs site (docs/*.md) run as written: every ```python block
not meant for torchrun, and not an excerpt of a script under examples/ (tests/test_examples.py runs those
scripts and compares the excerpts with them)."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(f"{page.relative_to(ROOT)} block {i}", block) for page in PAGES
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
          if "torchrun" not in block and not block.startswith("# excerpt of examples/")]


def test_readme_and_docs_have_examples():
    names = [name for name, _ in BLOCKS]
    assert any(name.startswith("README.md") for name in names) and len(names) >= 10, names


def test_the_readme_stays_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


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


@pytest.mark.parametrize("name, block", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_readme_example_runs(name, block, capsys, request):
    if "s3://" in block:
        request.getfixturevalue("s3_env")
    exec(compile(block, name, "exec"), {"__name__": "readme_example"})
