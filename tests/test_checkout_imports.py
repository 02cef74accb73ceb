"""Nothing in the checkout shadows a package of the user's stack.

``python -m pytest`` (and any ``python`` started in the checkout) puts the checkout first on ``sys.path``.
A top-level folder that is a regular package (or a module) there wins over an installed package of the
same name: a ``kernels/`` folder once hid Hugging Face's ``kernels``, which transformers 5 imports, and
``from diffusers import AutoencoderKL`` failed from the checkout's root. These tests run a Python in
the checkout's root, as a user would.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
OURS = {"latentfast", "tests"}


def top_level_names() -> list[str]:
    """Every folder at the checkout's top level that an ``import`` could find (setup.py is the build's
    entry point, not a folder: ``import setup`` is nobody's package)."""
    return sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name.isidentifier() and p.name not in OURS
                  and p.name not in sys.stdlib_module_names)  # the standard library's names win over any folder


def run_in_checkout(code: str, tmp_path: pathlib.Path) -> dict:
    """Runs ``code`` with ``python -c`` in the checkout's root (so ``sys.path[0]`` is the checkout) and
    returns the JSON it prints."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_no_top_level_name_of_the_checkout_shadows_an_installed_package(tmp_path):
    names = top_level_names()
    assert "bench" in names and "examples" in names  # the listing sees the folders that are there
    # A stand-in "site-packages" at the end of sys.path holds a regular package of every such name: what
    # `import NAME` finds from the checkout's root must be that package, never a folder of the checkout.
    site = tmp_path / "site"
    for name in names:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("")
    found = run_in_checkout(f"""
        import importlib.util, json, sys
        sys.path.append({str(site)!r})
        out = {{}}
        for name in {names!r}:
            spec = importlib.util.find_spec(name)
            out[name] = [spec.origin] + list(spec.submodule_search_locations or [])
        print(json.dumps(out))
    """, tmp_path)
    for name in names:
        assert found[name][0] == str(site / name / "__init__.py"), (
            f"`import {name}` from the checkout's root finds {found[name]} instead of the installed package: "
            f"a top-level {name}/ with an __init__.py (or {name}.py) shadows it; move it under latentfast/")


def test_no_top_level_folder_is_a_regular_package_or_module(tmp_path):
    # without any installed package of those names: each finds nothing, or only a namespace portion
    # (a folder without __init__.py), which an installed package of the same name always beats
    found = run_in_checkout(f"""
        import importlib.util, json
        out = {{}}
        for name in {top_level_names()!r}:
            spec = importlib.util.find_spec(name)
            out[name] = None if spec is None else (spec.origin if spec.has_location else None)
        print(json.dumps(out))
    """, tmp_path)
    regular = {name: origin for name, origin in found.items() if origin is not None and origin.startswith(str(ROOT))}
    assert not regular, f"top-level packages or modules of the checkout: {regular}"
    assert not (ROOT / "kernels").exists(), "the Triton kernels live in latentfast/kernels/"


@pytest.mark.slow
def test_diffusers_and_transformers_import_from_the_checkouts_root(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    found = run_in_checkout("""
        import json
        from diffusers import AutoencoderKL
        from transformers import CLIPTextModel
        import latentfast.kernels
        print(json.dumps({"ok": [AutoencoderKL.__name__, CLIPTextModel.__name__, latentfast.kernels.__name__]}))
    """, tmp_path)
    assert found["ok"] == ["AutoencoderKL", "CLIPTextModel", "latentfast.kernels"]


def test_importing_the_cache_package_loads_no_builder_importer_storage_or_vision_module(tmp_path):
    # `import latentfast.cache` costs ~20 ms over torch (python -X importtime); the builders, the trainer
    # importers, object storage and the vision modules come on first use of a name that needs them
    found = run_in_checkout("""
        import json, sys
        import latentfast.cache as cache
        before = sorted(m for m in sys.modules if m.startswith(("latentfast.cache.", "latentfast.vision", "diffusers",
                                                                "transformers", "obstore")))
        cache.LatentCache, cache.read_batch
        reader = sorted(m for m in sys.modules if m.startswith(("latentfast.cache.builders", "latentfast.cache.trainers",
                                                                "latentfast.vision", "diffusers", "transformers")))
        cache.build_image_cache
        builder = "latentfast.cache.builders.images" in sys.modules
        missing = [name for name in cache.__all__ if not hasattr(cache, name)]  # every name still resolves
        print(json.dumps({"before": before, "reader": reader, "builder": builder, "missing": missing}))
    """, tmp_path)
    assert found["before"] == [], found["before"]
    assert found["reader"] == [], found["reader"]
    assert found["builder"] and found["missing"] == [], found
