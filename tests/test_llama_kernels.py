"""llama.cpp's CPU kernels for the CPU at hand (`specdecode.backends.llama_kernels`).

- Features read from /proc/cpuinfo's text: an AMX Xeon, an AMD Zen 4, an old AVX2 CPU, an ARM.
- The variant chosen: the best the CPU runs, without AMX where the OS refuses its tiles; what
  a build compiles.
- The manifest: written and read back; a variant that failed its smoke test, or whose features
  the CPU lacks, or whose file is missing, is never chosen.
- Which library is bound: LLAMA_CPP_LIB_PATH first, then SPECDECODE_LLAMA_KERNELS=wheel, then a
  build for the installed version, else the wheel's; in a process of its own, the variant
  loaded is what `kernels()` reports.
- The build's smoke verdicts (a crash, another variant, non-finite logits) and its CMake flags.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import USER_CACHE_HOME

from specdecode.backends import llama_kernels
from specdecode.backends.llama_kernels import (
    CHOICE_VARIABLE,
    LIB_VARIABLE,
    Manifest,
    build_dir,
    choose_library,
    cpu_features,
    cpu_variants,
    library_path,
    runnable,
    variants_to_build,
)
from specdecode.cli import main
from specdecode.cli.kernels_command import chosen_variants, smoke_verdict
from specdecode.errors import SpecdecodeError

COMMON = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat clflush mmx fxsr sse sse2 nx lm"
SAPPHIRE_RAPIDS = (
    f"processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: {COMMON} pni pclmulqdq "
    "ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand bmi1 avx2 bmi2 avx512f "
    "avx512dq adx avx512ifma clflushopt avx512cd sha_ni avx512bw avx512vl avx_vnni avx512_bf16 "
    "avx512vbmi umip avx512_vbmi2 gfni vaes avx512_vnni avx512_bitalg avx512_vpopcntdq "
    "amx_bf16 avx512_fp16 amx_tile amx_int8\n\nprocessor\t: 1\nflags\t\t: fpu\n"
)
ZEN4 = (
    f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {COMMON} pni pclmulqdq ssse3 fma cx16 "
    "sse4_1 sse4_2 popcnt aes xsave avx f16c rdrand bmi1 avx2 bmi2 avx512f avx512dq avx512ifma "
    "avx512cd sha_ni avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vbmi2 gfni vaes avx512_vnni\n"
)
HASWELL = (
    f"processor\t: 0\nmodel name\t: Intel(R) Core(TM) i7-4770\nflags\t\t: {COMMON} pni ssse3 fma "
    "cx16 sse4_1 sse4_2 popcnt aes xsave avx f16c rdrand bmi1 avx2 bmi2 erms\n"
)
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 crc32 atomics\n"
AVX512 = {"AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"}
AVX2 = {"SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"}


def test_features_are_read_from_cpuinfo():
    assert cpu_features(SAPPHIRE_RAPIDS) == AVX2 | AVX512 | {"AVX_VNNI", "AMX_TILE", "AMX_INT8"}
    assert cpu_features(ZEN4) == AVX2 | AVX512
    assert cpu_features(HASWELL) == AVX2
    assert cpu_features(ARM) is None  # not x86: no variant, the wheel's library
    assert cpu_features("flags\t: fpu avx512f avx512cd\n") == frozenset()  # AVX512 wants all five subsets


def test_the_best_variant_the_cpu_runs_is_chosen():
    assert runnable(cpu_features(SAPPHIRE_RAPIDS))[:2] == ["sapphirerapids", "zen4"]
    assert runnable(cpu_features(ZEN4))[0] == "zen4"
    assert runnable(cpu_features(HASWELL)) == [
        "haswell",
        "piledriver",
        "ivybridge",
        "sandybridge",
        "sse42",
        "x64",
    ]
    assert runnable(frozenset()) == ["x64"]
    assert variants_to_build(cpu_features(SAPPHIRE_RAPIDS)) == ["sapphirerapids", "zen4", "haswell"]
    assert variants_to_build(cpu_features(ZEN4)) == ["zen4", "haswell"]
    assert variants_to_build(cpu_features(HASWELL)) == ["haswell"]
    assert variants_to_build(frozenset({"SSE42"})) == ["sse42", "x64"]


def test_amx_is_used_only_where_the_os_permits_its_tiles(monkeypatch):
    xeon = cpu_features(SAPPHIRE_RAPIDS)
    monkeypatch.setattr(llama_kernels, "amx_permitted", lambda: False)
    assert runnable(llama_kernels.usable_features(xeon))[0] == "zen4"
    monkeypatch.setattr(llama_kernels, "amx_permitted", lambda: True)
    assert runnable(llama_kernels.usable_features(xeon))[0] == "sapphirerapids"
    monkeypatch.setattr(llama_kernels, "amx_permitted", lambda: pytest.fail("asked without AMX"))
    assert llama_kernels.usable_features(cpu_features(ZEN4)) == cpu_features(ZEN4)


def test_this_machines_amx_permission_is_asked_of_the_os():
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "amx_tile" in flags:
        pytest.skip("this CPU has AMX: the answer depends on its kernel")
    assert llama_kernels.amx_permitted() is False


def fake_build(directory: Path, smoke: dict[str, bool], files: tuple[str, ...] | None = None) -> Path:
    """A build directory with empty variant files and a manifest of these smoke results."""
    directory.mkdir(parents=True)
    for name in files if files is not None else smoke:
        (directory / llama_kernels.library_file(name)).touch()
    variants = {
        name: {"features": list(llama_kernels.VARIANTS[name]), "smoke": {"passed": ok, "detail": ""}}
        for name, ok in smoke.items()
    }
    manifest = Manifest(llama_kernels.llama_cpp_python_version() or "0", variants, {"model": "test"}, {})
    manifest.write(directory)
    return directory


def test_the_manifest_round_trips_and_failed_or_unrunnable_variants_are_never_chosen(tmp_path, monkeypatch):
    smoke = {"sapphirerapids": True, "zen4": True, "haswell": False, "x64": True, "sse42": True}
    directory = fake_build(tmp_path / "build", smoke, files=("sapphirerapids", "zen4", "haswell", "x64"))
    manifest = Manifest.read(directory)
    assert manifest.variants["haswell"]["smoke"]["passed"] is False and manifest.cpu == {"model": "test"}
    assert manifest.passed() == ["sapphirerapids", "zen4", "x64", "sse42"]
    monkeypatch.setattr(llama_kernels, "machine_features", lambda: cpu_features(ZEN4))
    # sapphirerapids: no AMX here; haswell: failed; sse42: no file
    assert cpu_variants(directory, {}) == ["zen4", "x64"]
    assert cpu_variants(directory, {CHOICE_VARIABLE: "x64"}) == ["x64"]
    with pytest.raises(SpecdecodeError, match="not passed its smoke test"):
        cpu_variants(directory, {CHOICE_VARIABLE: "haswell"})
    with pytest.raises(SpecdecodeError, match="no such variant"):
        cpu_variants(directory, {CHOICE_VARIABLE: "pentium"})
    (directory / llama_kernels.MANIFEST).write_text(json.dumps({"format": -1}))
    assert Manifest.read(directory) is None  # another format: as if none


def test_the_library_bound_follows_the_users_path_the_switch_and_the_build(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(llama_kernels, "machine_features", lambda: cpu_features(HASWELL))
    assert choose_library({LIB_VARIABLE: "/elsewhere"}).directory == Path("/elsewhere")
    nothing_built = choose_library({})
    assert nothing_built.directory is None and "specdecode kernels --build" in nothing_built.reason
    version = llama_kernels.llama_cpp_python_version()
    if version is None:
        pytest.skip("llama-cpp-python is not installed")
    built = fake_build(build_dir(version), {"zen4": True, "haswell": True})
    assert choose_library({}).directory == built  # haswell runs here
    assert choose_library({CHOICE_VARIABLE: "wheel"}).directory is None
    assert choose_library({LIB_VARIABLE: "/elsewhere", CHOICE_VARIABLE: "wheel"}).directory == Path(
        "/elsewhere"
    )
    monkeypatch.setattr(llama_kernels, "machine_features", lambda: frozenset())
    assert choose_library({}).directory is None  # only x64 would run, and it is not built


def test_the_path_is_set_for_the_import_only(monkeypatch):
    monkeypatch.delenv(LIB_VARIABLE, raising=False)
    with library_path(Path("/built")):
        assert os.environ[LIB_VARIABLE] == "/built"
    assert LIB_VARIABLE not in os.environ
    with library_path(None):
        assert LIB_VARIABLE not in os.environ


def test_cmake_flags_compile_one_variant():
    flags = llama_kernels.cmake_feature_flags("haswell")
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags
    assert "-DGGML_AVX512=OFF" in flags and "-DGGML_AMX_INT8=OFF" in flags


def test_smoke_verdicts():
    assert smoke_verdict("zen4", -4, "", "a line\n")["detail"] == "killed by signal 4 a line"
    good = {"variant": "zen4", "files": {"/x/smoke-f32.gguf": {"finite": True, "invariant_rows": 63}}}
    assert smoke_verdict("zen4", 0, json.dumps(good), "") == {
        "passed": True,
        "detail": "invariant rows per type: f32 63",
        "files": good["files"],
    }
    assert not smoke_verdict("haswell", 0, json.dumps(good), "")["passed"]
    good["files"]["/x/smoke-f32.gguf"]["finite"] = False
    assert smoke_verdict("zen4", 0, json.dumps(good), "")["detail"] == "non-finite logits"


def test_the_variants_asked_for_must_run_here(monkeypatch):
    haswell = cpu_features(HASWELL)
    assert chosen_variants(None, haswell) == ["haswell"]
    assert chosen_variants("all", haswell) == runnable(haswell)
    assert chosen_variants("x64, haswell", haswell) == ["x64", "haswell"]
    with pytest.raises(SpecdecodeError, match="cannot run zen4"):
        chosen_variants("zen4", haswell)


KERNELS = (
    "from specdecode.backends import llama_lib as lib; print(lib.kernels()['variant'], lib.library_dir())"
)


def kernels_in_a_process(**env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k not in (LIB_VARIABLE, CHOICE_VARIABLE)}
    done = subprocess.run(
        [sys.executable, "-c", KERNELS], env={**environ, **env}, capture_output=True, text=True, check=True
    )
    return done.stdout.split()


def users_build() -> Path:
    """The build in the user's own cache (the tests run with a cache of their own)."""
    pytest.importorskip("llama_cpp")
    base = Path(USER_CACHE_HOME) if USER_CACHE_HOME else Path.home() / ".cache"
    directory = (
        base
        / "specdecode"
        / llama_kernels.CACHE_NAME
        / build_dir(llama_kernels.llama_cpp_python_version()).name
    )
    if Manifest.read(directory) is None:
        pytest.skip("no kernels built in the user's cache (specdecode kernels --build)")
    return directory


def test_the_built_variant_is_loaded_and_reported():
    directory = users_build()
    expected = cpu_variants(directory, {})[0]
    assert kernels_in_a_process(XDG_CACHE_HOME=str(directory.parents[2])) == [expected, str(directory)]
    wheel = kernels_in_a_process(XDG_CACHE_HOME=str(directory.parents[2]), SPECDECODE_LLAMA_KERNELS="wheel")
    assert wheel[0] == "None" and wheel[1] != str(directory)
    assert (
        kernels_in_a_process(XDG_CACHE_HOME=str(directory.parents[2]), LLAMA_CPP_LIB_PATH=wheel[1]) == wheel
    )


def test_a_variant_that_does_not_load_gives_way_to_the_next(tmp_path):
    """The best variant's library broken after its smoke test: the next one runs, no crash."""
    directory = users_build()
    passed = cpu_variants(directory, {})
    if len(passed) < 2:
        pytest.skip("the build holds one variant that runs here")
    copy = tmp_path / "build"
    shutil.copytree(directory, copy, symlinks=True)
    (copy / llama_kernels.library_file(passed[0])).write_bytes(b"not a library")
    assert kernels_in_a_process(LLAMA_CPP_LIB_PATH=str(copy)) == [passed[1], str(copy)]


def test_the_command_says_what_runs(capsys):
    pytest.importorskip("llama_cpp")
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert ("in use: " in out and "variants it runs" in out) or "not x86-64" in out
