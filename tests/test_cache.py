"""What the package keeps in the user's cache, and the GGUF copies `--backend auto` writes there.

- A GGUF copy of a directory is kept only where the model runs from it: a target whose rows
  llama.cpp does not keep exact runs on PyTorch and leaves no copy (nor a half-written one),
  and the verdict is remembered, so the next run writes nothing either.
- Before writing, the load's progress callback says where and how big (the estimate within
  a fifth of the file written); a copy over SPECDECODE_CACHE_LIMIT, or one that would fill the
  disk, is not written: auto says why and runs PyTorch, `--backend llama.cpp` is an error.
- `specdecode cache list` shows each kind (where, how big, what it is, when last used) and
  each copy's source directory; `cache clear` removes one kind or all, or only says so.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import TargetSpec, cached_tokenizer, draft_model, in_dtype, target_model

from specdecode import cache
from specdecode.backends import pass_cache
from specdecode.backends.hf_gguf import models_dir
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.backends.load import load_backend
from specdecode.backends.native import NativeBackend
from specdecode.backends.options import LoadOptions
from specdecode.cli import main
from specdecode.errors import SpecdecodeError
from specdecode.testing import save_model

OPTIONS = LoadOptions(threads=1, n_ctx=256)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(cache.LIMIT_VARIABLE, raising=False)


@pytest.fixture
def pair(tmp_path):
    """The test pair as float32 Hugging Face directories."""
    tokenizer = cached_tokenizer()
    spec = TargetSpec()
    return (
        save_model(tmp_path / "target", in_dtype(target_model(spec), torch.float32), tokenizer),
        save_model(tmp_path / "draft", in_dtype(draft_model(spec, 0.02), torch.float32), tokenizer),
    )


@pytest.fixture
def rows_invariant(monkeypatch):
    """Set the row probe's verdict (which this build's kernels would otherwise decide)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")

    def choose(verdict: bool) -> None:
        monkeypatch.setattr(LlamaCppBackend, "invariant", property(lambda self: verdict))

    return choose


def kept() -> list[str]:
    """Everything under the GGUF copies' folder, hidden (staging) entries included."""
    return sorted(path.name for path in models_dir().iterdir()) if models_dir().exists() else []


def test_a_target_that_runs_on_pytorch_leaves_no_copy(pair, rows_invariant):
    rows_invariant(False)
    target, _ = pair
    said: list[str] = []
    backend = load_backend(target, OPTIONS, "target", said.append)
    assert isinstance(backend, NativeBackend) and "multi-row passes" in backend.backend_note
    (line,) = said  # it was written to be probed, and said so
    assert "kept only if llama.cpp runs it" in line
    assert not [name for name in kept() if name.endswith(".gguf") or name.startswith(".")]
    assert [name for name in kept() if name.endswith(".rows-differ")]
    said.clear()
    again = load_backend(target, OPTIONS, "target", said.append)  # the verdict remembered
    assert isinstance(again, NativeBackend) and "multi-row passes" in again.backend_note and said == []
    other = load_backend(target, LoadOptions(threads=2, n_ctx=256), "target", said.append)
    assert isinstance(other, NativeBackend) and len(said) == 1  # other threads: probed again


def test_a_target_whose_rows_hold_keeps_its_copy(pair, rows_invariant):
    rows_invariant(True)
    target, _ = pair
    said: list[str] = []
    backend = load_backend(target, OPTIONS, "target", said.append)
    assert isinstance(backend, LlamaCppBackend) and "written once to" in backend.backend_note
    (name,) = [name for name in kept() if name.endswith(".gguf")]
    copy = models_dir() / name
    assert backend.model.path == copy and not [name for name in kept() if name.startswith(".")]
    (line,) = said
    assert line.startswith("writing target as a ") and f"f32 GGUF file to {copy}" in line
    estimate = cache.parse_size(line.removeprefix("writing target as a ").split(" f32")[0])
    assert abs(estimate - copy.stat().st_size) < copy.stat().st_size / 5
    said.clear()
    assert "kept in" in load_backend(target, OPTIONS, "target", said.append).backend_note and said == []


def test_the_probe_of_a_new_copy_is_kept_for_its_place(pair, monkeypatch):
    """The probe runs before the copy is in place; its verdict is stored under the place, so the
    next run neither writes nor probes."""
    pytest.importorskip("llama_cpp")
    from specdecode.backends.llama_probe import WIDE_PASSES, RowAgreement, RowProbe

    monkeypatch.setenv("SPECDECODE_NO_PASS_CACHE", "0")
    probed: list[str] = []

    def agreeing(self: RowProbe) -> RowAgreement:  # what the row-invariant build finds
        probed.append(str(self.model.path))
        self.model.invariant_rows, self.model.wide_rows_agree = max(WIDE_PASSES), True
        return RowAgreement(4, 4, 4)

    monkeypatch.setattr(RowProbe, "probe_invariance", agreeing)
    target, _ = pair
    first = load_backend(target, OPTIONS, "target")
    assert isinstance(first, LlamaCppBackend) and probed == [str(first.model.path)]
    again = load_backend(target, OPTIONS, "target")
    assert isinstance(again, LlamaCppBackend) and again.invariant and len(probed) == 1


def test_a_copy_past_the_limit_or_the_free_space_is_not_written(pair, rows_invariant, monkeypatch):
    rows_invariant(True)
    _, draft = pair
    monkeypatch.setenv(cache.LIMIT_VARIABLE, "64K")
    said: list[str] = []
    backend = load_backend(draft, OPTIONS, "draft", said.append)
    assert isinstance(backend, NativeBackend) and said == [] and kept() in ([], ["file-hashes.json"])
    assert "cache limit of 64 KiB" in backend.backend_note and cache.LIMIT_VARIABLE in backend.backend_note
    with pytest.raises(SpecdecodeError, match=r"cache limit of 64 KiB.*`specdecode cache list`"):
        load_backend(draft, LoadOptions(backend="llama.cpp", threads=1, n_ctx=256))
    monkeypatch.setenv(cache.LIMIT_VARIABLE, "1T")
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda where: usage._replace(free=cache.FREE_MARGIN))
    backend = load_backend(draft, OPTIONS, "draft", said.append)
    assert isinstance(backend, NativeBackend) and "does not fit on the disk" in backend.backend_note
    monkeypatch.setenv(cache.LIMIT_VARIABLE, "a lot")
    with pytest.raises(SpecdecodeError, match="SPECDECODE_CACHE_LIMIT='a lot' is not a size"):
        cache.limit()


def test_the_command_says_where_and_how_big_before_writing(pair, capsys, rows_invariant):
    target, draft = pair
    args = ["generate", "-m", str(target), "-md", str(draft), "-p", "def f(x):", "-n", "2", "-t", "1"]
    assert main(args) == 0
    lines = capsys.readouterr().err.splitlines()
    writing = [line for line in lines if line.startswith("specdecode: writing draft as a ")]
    assert len(writing) == 1 and f"f32 GGUF file to {models_dir()}" in writing[0]
    assert lines.index(writing[0]) > lines.index(f"specdecode: loading the draft model from {draft}")


SIZES = {"0": 0, "12345": 12345, "500M": 500 * 2**20, "8G": 8 * 2**30, "8GiB": 8 * 2**30, "1.5 gb": 3 * 2**29}


@pytest.mark.parametrize(("text", "size"), SIZES.items())
def test_sizes_parse_in_powers_of_1024(text, size):
    assert cache.parse_size(text) == size


def test_sizes_are_shown_in_the_unit_that_fits():
    assert [cache.format_size(n) for n in (0, 1023, 1024, 1536 * 2**20, 540 * 10**6, 3 * 2**40)] == [
        "0 B",
        "1023 B",
        "1 KiB",
        "1.5 GiB",
        "515 MiB",
        "3 TiB",
    ]


def test_cache_list_and_clear(pair, capsys, rows_invariant, tmp_path):
    rows_invariant(True)
    target, _ = pair
    root = tmp_path / "cache" / "specdecode"
    assert main(["cache", "list"]) == 0  # an empty cache, nothing created
    assert f"{root}: 0 B in all, limit 8 GiB" in capsys.readouterr().out and not root.exists()
    load_backend(target, OPTIONS, "draft")
    pass_cache.write_value({"model": "a test"}, "costs", {"1": 0.5})
    (root / "old-kind").mkdir()
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    (copy,) = models_dir().glob("*.gguf")
    held = cache.format_size(sum(entry.size for entry in cache.entries("gguf-models")))
    assert f"gguf-models: {held}, 3 items, last used " in out  # the copy, its source, the hashes
    assert f"\n  {root / 'gguf-models'}\n" in out and f"{copy.name}  copy of {target.resolve()}" in out
    assert "pass-costs: " in out and "1 item, last used " in out and f"{root / 'old-kind'}" in out
    assert main(["cache", "clear", "--kind", "gguf-models", "--dry-run"]) == 0
    assert f"would remove {root / 'gguf-models'}" in capsys.readouterr().out and copy.is_file()
    assert main(["cache", "clear", "--kind", "gguf-models"]) == 0
    assert f"removed {root / 'gguf-models'} ({held})\nfreed {held}" in capsys.readouterr().out
    assert not models_dir().exists() and pass_cache.cache_dir().exists()
    assert main(["cache", "clear"]) == 0
    assert f"removed {root / 'pass-costs'}" in capsys.readouterr().out and not pass_cache.cache_dir().exists()
