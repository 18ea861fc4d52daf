"""The packed weights: lossless, refused when damaged, the bundled models decoded to exactly the
files they were, and the repository small enough to travel (machines that take at most 64 MiB)."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdecode.backends import packed_weights
from specdecode.backends.packed_weights import MAGIC, materialize, pack, read_index, unpack
from specdecode.defaults import BUNDLED, bundled_dflash, bundled_eagle3, bundled_pair
from specdecode.errors import SpecdecodeError

ROOT = Path(__file__).parents[1]
MAX_TRACKED_BYTES = 56 * 1024 * 1024
# The SHA-256 of each bundled model.safetensors as it was committed before being packed.
BUNDLED_SHA256 = {
    "target": "5cc6189092c4375e7292f6a6c0b32660c4ea40a31149ba3bb8ade6b6aae7fe7f",
    "draft": "b6358f67a5062d6b968ecd0f5c4b249a77745b5a9ab683098354ee6971ee5525",
    "eagle3": "852a1e85d655ef10505870cdb22b921f9c41642f22dddaa290586cd45f222f5b",
    "dflash": "da361e8f661a253bccef70d22e48c01ebb119d7b239a219e585566df9472e1a9",
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def weights(tmp_path) -> Path:
    """A small safetensors file: bf16 over many exponents (zeros, subnormals, infinities and NaN
    too), an int64 and a bool tensor."""
    generator = torch.Generator().manual_seed(0)
    scales = torch.logspace(-40, 38, 64, dtype=torch.float64).to(torch.float32)
    wide = torch.randn(64, 33, generator=generator) * scales[:, None]
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, float("inf"), -float("inf"), float("nan"), 1.0])
    tensors = {
        "wide": wide.to(torch.bfloat16),
        "special": special.to(torch.bfloat16),
        "odd": torch.randn(7, generator=generator).to(torch.bfloat16),
        "ids": torch.randint(-(2**62), 2**62, (50,), generator=generator),
        "mask": torch.rand(37, generator=generator) > 0.5,
        "normal": (torch.randn(300, 40, generator=generator) * 0.02).to(torch.bfloat16),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    return path


@pytest.fixture
def packed(weights) -> Path:
    container = weights.with_name("model.safetensors.packed")
    pack(weights, container)
    return container


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "specdecode" / "models"


def test_round_trip_is_bit_for_bit(weights, packed, tmp_path):
    unpack(packed, tmp_path / "decoded")
    assert (tmp_path / "decoded").read_bytes() == weights.read_bytes()
    index, _ = read_index(packed)
    assert [segment["bf16"] for segment in index["segments"]].count(True) == 4


def test_bf16_planes_pack_smaller_than_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file(
        {"w": (torch.randn(256, 256, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()}, path
    )
    pack(path, tmp_path / "w.packed")
    assert (tmp_path / "w.packed").stat().st_size < 0.8 * path.stat().st_size


def damage(container: Path, how: str) -> None:
    data = bytearray(container.read_bytes())
    index, start = read_index(container)
    if how == "flipped":
        data[-100] ^= 0x10
    elif how == "truncated":
        del data[-10:]
    elif how == "extended":
        data += b"\0"
    elif how == "magic":
        data[0] ^= 1
    elif how == "index":
        data[len(MAGIC) + 8] = ord("[")
    elif how == "sha256":
        index["sha256"] = hashlib.sha256(b"another file").hexdigest()
        new = json.dumps(index).encode()
        data[len(MAGIC) :] = struct.pack("<Q", len(new)) + new + data[start:]
    container.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "how, message",
    [
        ("flipped", "damaged|SHA-256"),
        ("truncated", "truncated"),
        ("extended", "do not add up"),
        ("magic", "not a packed safetensors file"),
        ("index", "index"),
        ("sha256", "SHA-256 differs"),
    ],
)
def test_a_damaged_container_is_refused(packed, tmp_path, how, message):
    damage(packed, how)
    with pytest.raises(SpecdecodeError, match=message):
        unpack(packed, tmp_path / "decoded")
    assert not (tmp_path / "decoded").exists()


def test_what_is_not_safetensors_is_refused(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x05\0\0\0\0\0\0\0{oops")
    with pytest.raises(SpecdecodeError, match="not a safetensors file"):
        pack(tmp_path / "bad", tmp_path / "bad.packed")


def model_directory(weights: Path, packed: Path) -> Path:
    directory = weights.parent / "model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    shutil.move(packed, directory / packed.name)
    return directory


def test_materialize_decodes_once_into_the_cache(weights, packed, cache, tmp_path, monkeypatch):
    directory = model_directory(weights, packed)
    (tmp_path / "vocab.txt").write_text("shared")
    decoded = materialize(directory, {"vocab.txt": tmp_path / "vocab.txt"})
    assert decoded.parent == cache
    assert sorted(p.name for p in decoded.iterdir()) == ["config.json", "model.safetensors", "vocab.txt"]
    assert (decoded / "model.safetensors").read_bytes() == weights.read_bytes()
    assert (decoded / "vocab.txt").read_text() == "shared"

    def no_decoding(*args):
        raise AssertionError("decoded twice")

    with monkeypatch.context() as patched:
        patched.setattr(packed_weights, "unpack", no_decoding)
        assert materialize(directory, {"vocab.txt": tmp_path / "vocab.txt"}) == decoded
    (directory / "config.json").write_text('{"changed": 1}')  # other contents: another directory
    assert materialize(directory, {"vocab.txt": tmp_path / "vocab.txt"}) != decoded


def test_a_damaged_cache_is_decoded_again(weights, packed, cache):
    directory = model_directory(weights, packed)
    decoded = materialize(directory)
    (decoded / "model.safetensors").write_bytes(b"cut short")
    assert materialize(directory) == decoded
    assert (decoded / "model.safetensors").read_bytes() == weights.read_bytes()
    assert [p.name for p in cache.iterdir()] == [decoded.name]  # nothing left behind


def test_concurrent_decoding_gives_one_whole_directory(weights, packed, cache):
    directory = model_directory(weights, packed)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(materialize(directory))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert (results[0] / "model.safetensors").read_bytes() == weights.read_bytes()
    assert [p.name for p in cache.iterdir()] == [results[0].name]


def test_an_unwritable_cache_falls_back_to_a_temporary_directory(weights, packed, tmp_path, monkeypatch):
    directory = model_directory(weights, packed)
    (tmp_path / "not-a-directory").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-directory"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(packed_weights.tempfile, "tempdir", str(tmp_path / "tmp"))
    decoded = materialize(directory)
    assert decoded.is_relative_to(tmp_path / "tmp")
    assert (decoded / "model.safetensors").read_bytes() == weights.read_bytes()


def test_a_plain_directory_is_used_as_it_is(weights):
    assert materialize(weights.parent) == weights.parent


def test_the_bundled_models_decode_to_exactly_the_files_they_were(cache):
    if not (BUNDLED / "target" / "model.safetensors.packed").is_file():
        pytest.skip("this installation carries no bundled models")
    target, draft = bundled_pair()
    head, drafter = bundled_eagle3(), bundled_dflash()
    assert head is not None and drafter is not None
    for role, directory in (("target", target), ("draft", draft), ("eagle3", head), ("dflash", drafter)):
        assert directory.parent == cache
        assert sha256(directory / "model.safetensors") == BUNDLED_SHA256[role], role
    assert (draft / "tokenizer.json").read_bytes() == (BUNDLED / "target" / "tokenizer.json").read_bytes()
    assert {p.name for p in draft.iterdir()} == {p.name for p in target.iterdir()}


def test_the_tracked_tree_travels():
    """Every file git tracks, added up, stays under the 56 MiB the machines take (with room)."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout, or no git to list it")
    paths = [ROOT / name for name in listing.stdout.decode().split("\0") if name]
    total = sum(path.lstat().st_size for path in paths if path.is_symlink() or path.exists())
    assert total < MAX_TRACKED_BYTES, f"the tracked files add up to {total / 2**20:.1f} MiB"
