"""`latentfast cache build | inspect | verify` through the subparsers the main CLI mounts."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from latentfast.cache import LatentCache, cache_path
from latentfast.cache.cli import add_cache_subparsers
from test_cache import build, cache_files, make_lines


def run_cli(*argv) -> int:
    parser = argparse.ArgumentParser(prog="latentfast")
    add_cache_subparsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cache", *argv])
    return args.func(args)


def test_build_inspect_verify(tmp_path, capsys):
    manifest = make_lines(str(tmp_path), n=12)
    out = str(tmp_path / "out")
    common = ["--out", out, "--lines", "--encoder", "toy", "--line-height", "16", "--max-line-width", "96", "--batch-size", "4",
              "--quiet"]
    assert run_cli("build", "--images", str(tmp_path / "img"), *common, "--layout", "ragged") == 0
    assert LatentCache(out).layout == "ragged"
    # the manifest lists the same images in the same order: same latents, same reference build
    reference = str(tmp_path / "reference")
    build(manifest, reference, layout="ragged")
    assert LatentCache(reference).widths.tolist() == LatentCache(out).widths.tolist()
    assert open(cache_path(out, "train", "data"), "rb").read() == open(cache_path(reference, "train", "data"), "rb").read()

    assert run_cli("build", "--manifest", manifest, *common, "--split", "val") == 0
    assert cache_files(out, "val").keys() == {"val.latents.f16.dat", "val.latents.widths.npy", "val.latents.meta.json",
                                              "val.latents.white.npy", "val.latents.crc32.npy",
                                              "val.latents.keys.json", "val.latents.hashes.npy"}
    capsys.readouterr()

    assert run_cli("inspect", out, "--split", "val") == 0
    text = capsys.readouterr().out
    assert "rows: 12   layout: padded" in text and "padding waste:" in text and "latent width histogram:" in text
    assert "pretrained: latentfast.toy.ToyVAE(seed=0,hidden=16)" in text
    assert run_cli("inspect", out, "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "ragged" and info["padding_waste_pct"] == 0.0
    assert sum(c for _, _, c in info["histogram"]) == 12

    assert run_cli("verify", out, "--split", "val") == 0
    assert "verify OK: 12 rows" in capsys.readouterr().out
    with open(cache_path(out, "val", "data"), "r+b") as fh:
        fh.seek(10)
        byte = fh.read(1)
        fh.seek(10)
        fh.write(bytes([byte[0] ^ 0x40]))
    assert run_cli("verify", out, "--split", "val") == 1
    assert "verify FAILED" in (err := capsys.readouterr().err) and "block 0 (rows 0..11)" in err
    os.truncate(cache_path(out, "train", "data"), 6)
    assert run_cli("verify", out) == 1
    assert "shorter than the meta implies" in capsys.readouterr().err


def test_build_requires_a_source_and_a_known_encoder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_cli("build", "--out", str(tmp_path))
    capsys.readouterr()
    assert run_cli("build", "--images", str(tmp_path), "--out", str(tmp_path), "--encoder", "vae") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--encoder must be 'toy', 'module:factory' or 'diffusers:PATH', got 'vae'" in err


def test_encoder_factory(tmp_path):
    make_lines(str(tmp_path), n=5)
    args = ["--images", str(tmp_path / "img"), "--lines", "--line-height", "16", "--max-line-width", "96", "--quiet"]
    assert run_cli("build", *args, "--out", str(tmp_path / "a"), "--encoder", "toy", "--toy-seed", "4") == 0
    assert run_cli("build", *args, "--out", str(tmp_path / "b"), "--encoder", "test_cache_cli:seed4_toy") == 0
    assert cache_files(str(tmp_path / "a")) == cache_files(str(tmp_path / "b"))


def seed4_toy():
    from latentfast.toy import ToyVAE

    return ToyVAE(seed=4)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_module_entry_point(tmp_path):
    make_lines(str(tmp_path), n=4)
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "latentfast.cache.cli", "cache"]
    built = subprocess.run([*cmd, "build", "--images", str(tmp_path / "img"), "--out", out, "--lines", "--encoder", "toy",
                            "--line-height", "16", "--max-line-width", "96"], capture_output=True, text=True, timeout=100)
    assert built.returncode == 0, built.stderr
    assert f"latent cache written: {cache_path(out, 'train', 'data')}" in built.stdout
    assert len(LatentCache(out)) == 4
