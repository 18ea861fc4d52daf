"""Which of llama.cpp's CPU kernels the llama.cpp backend runs: llama-cpp-python's own library
(the wheel's: a portable AVX2-level build) or llama.cpp's CPU variants built for this package,
one chosen for the CPU at hand as llama.cpp's releases choose.

llama.cpp built with GGML_BACKEND_DL and GGML_CPU_ALL_VARIANTS puts its CPU kernels in one
library per instruction-set level (libggml-cpu-haswell.so, -zen4, -sapphirerapids, ...), loaded
at run time. `specdecode kernels --build` compiles libllama, libggml, libggml-base and the
variants this CPU can run into the user's cache, from the installed llama-cpp-python's own
source, without llamafile's sgemm (whose f32, f16 and bf16 rows change with the size of a pass;
the repacked layouts stay: they make K-quant steps 1.2-1.5x faster, their row cap is the probe's,
and `-nr` turns them off per model), smoke-tests each variant in a process of its own and
writes a manifest. Here, before
`import llama_cpp` (llama-cpp-python binds its library then, from LLAMA_CPP_LIB_PATH if set):

- LLAMA_CPP_LIB_PATH set by the user is respected;
- SPECDECODE_LLAMA_KERNELS=wheel keeps the wheel's library (for comparisons);
  SPECDECODE_LLAMA_KERNELS=<variant> asks for one variant of the build;
- otherwise the build for the installed version is used where its manifest names a variant
  that passed its smoke test and whose features this CPU has (AMX only where the OS permits
  its tiles); else the wheel's library.

After the import, `load_cpu_backend` registers the best such variant of the loaded library's
directory with ggml (before llama_backend_init, which would search elsewhere), falling back to
the next one where a load fails. Standard library only: it runs before llama_cpp is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecdecodeError
from specdecode.local import cache_dir

LIB_VARIABLE = "LLAMA_CPP_LIB_PATH"  # llama-cpp-python's own: the directory of its libllama
CHOICE_VARIABLE = "SPECDECODE_LLAMA_KERNELS"  # "wheel", a variant's name, or unset: the best
WHEEL = "wheel"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
CACHE_NAME = "llama-kernels"

# How the libraries are built: every CPU variant as a library of its own, chosen at run time,
# and no llamafile sgemm, whose f32/f16/bf16 rows change with the pass size. The repacked weight
# layouts are kept: a run-time switch (`-nr`) turns them off. Part of the build's key.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_CPU_ALL_VARIANTS=ON",
    "-DGGML_LLAMAFILE=OFF",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
)

# ggml's x86 CPU variants and the features each is compiled for, as llama.cpp's
# ggml/src/CMakeLists.txt declares them (ggml_add_cpu_backend_variant under GGML_CPU_ALL_VARIANTS).
VARIANTS: dict[str, tuple[str, ...]] = {
    "x64": (),
    "sse42": ("SSE42",),
    "sandybridge": ("SSE42", "AVX"),
    "ivybridge": ("SSE42", "AVX", "F16C"),
    "piledriver": ("SSE42", "AVX", "F16C", "FMA"),
    "haswell": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
    "skylakex": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512"),
    "cannonlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI"),
    "cascadelake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI"),
    "icelake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI"),
    "cooperlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI", "AVX512_BF16"),
    "zen4": (
        *("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
        *("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"),
    ),
    "alderlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI"),
    "sapphirerapids": (
        *("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
        *("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8"),
    ),
}
# Each feature: the /proc/cpuinfo flags it needs (the cpuid bits ggml's score checks,
# ggml/src/ggml-cpu/arch/x86/cpu-feats.cpp) and its weight in that score, which ranks variants.
FEATURES: dict[str, tuple[tuple[str, ...], int]] = {
    "FMA": (("fma",), 1),
    "F16C": (("f16c",), 1 << 1),
    "SSE42": (("sse4_2",), 1 << 2),
    "BMI2": (("bmi2",), 1 << 3),
    "AVX": (("avx",), 1 << 4),
    "AVX2": (("avx2",), 1 << 5),
    "AVX_VNNI": (("avx_vnni",), 1 << 6),
    "AVX512": (("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"), 1 << 7),
    "AVX512_VBMI": (("avx512vbmi",), 1 << 8),
    "AVX512_BF16": (("avx512_bf16",), 1 << 9),
    "AVX512_VNNI": (("avx512_vnni",), 1 << 10),
    "AMX_TILE": (("amx_tile",), 0),
    "AMX_INT8": (("amx_int8",), 1 << 11),
}
AMX = frozenset({"AMX_TILE", "AMX_INT8"})
WHEEL_LEVEL = "haswell"  # what the wheel's portable build (GGML_NATIVE=OFF) compiles for


def cpu_features(cpuinfo: str) -> frozenset[str] | None:
    """ggml's names of the features an x86 CPU reports in /proc/cpuinfo's text (its first
    processor's flags); None for another architecture, whose variants are not listed here."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            return frozenset(name for name, (needs, _) in FEATURES.items() if flags.issuperset(needs))
    return None


def machine_features() -> frozenset[str] | None:
    """This CPU's features (Linux on x86-64 only; elsewhere None: the wheel's library)."""
    if not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        return cpu_features(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def amx_permitted() -> bool:
    """Whether Linux lets this process use AMX tiles: a CPU may have them while the OS refuses
    their state (ggml's variant score asks cpuid only, and an AMX kernel then dies of an
    illegal instruction). The request ggml makes itself (arch_prctl ARCH_REQ_XCOMP_PERM for
    XFEATURE_XTILEDATA), asked here first."""
    request_permission, tile_data, arch_prctl = 0x1023, 18, 158  # SYS_arch_prctl on x86-64
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return (
            libc.syscall(
                ctypes.c_long(arch_prctl), ctypes.c_long(request_permission), ctypes.c_long(tile_data)
            )
            == 0
        )
    except (OSError, AttributeError):
        return False


def usable_features(features: frozenset[str] | None) -> frozenset[str]:
    """`features` less AMX where the OS does not permit its tiles (asked only of a CPU that has them)."""
    if not features:
        return frozenset()
    if features & AMX and not amx_permitted():
        return features - AMX
    return features


def score(variant: str) -> int:
    """ggml's own ranking of a variant (the higher, the more the CPU must have)."""
    return 1 + sum(FEATURES[feature][1] for feature in VARIANTS[variant])


def runnable(features: frozenset[str]) -> list[str]:
    """The variants a CPU with `features` runs, best first."""
    fit = [name for name, needs in VARIANTS.items() if features.issuperset(needs)]
    return sorted(fit, key=score, reverse=True)


def variants_to_build(features: frozenset[str]) -> list[str]:
    """The best variant the CPU runs, the best without AMX where that one needs it (a fallback
    should the tiles fail), and the wheel's level (or x64, where the CPU lacks it)."""
    fit = runnable(features)
    without_amx = [name for name in fit if not AMX & set(VARIANTS[name])]
    last = WHEEL_LEVEL if WHEEL_LEVEL in fit else "x64"
    return list(dict.fromkeys([*fit[:1], *without_amx[:1], last]))


def cmake_feature_flags(variant: str) -> list[str]:
    """The CMake flags that compile one CPU backend as `variant` (GGML_NATIVE off), for a build
    of llama.cpp's programs with the kernels this package uses."""
    wanted = set(VARIANTS[variant])
    return ["-DGGML_NATIVE=OFF", *(f"-DGGML_{name}={'ON' if name in wanted else 'OFF'}" for name in FEATURES)]


def llama_cpp_python_version() -> str | None:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def build_dir(version: str) -> Path:
    """Where the build for a llama-cpp-python version lives: keyed by the version and the flags."""
    flags = hashlib.sha256(" ".join(CMAKE_FLAGS).encode()).hexdigest()[:8]
    return cache_dir(CACHE_NAME) / f"llama-cpp-python-{version}-{flags}"


def library_file(variant: str) -> str:
    return f"libggml-cpu-{variant}.so"


@dataclass(frozen=True)
class Manifest:
    """What a build holds: the llama-cpp-python version it came from, each variant's features
    and smoke-test result, and the CPU it was tested on."""

    version: str
    variants: dict[str, dict]  # name -> {"features": [...], "smoke": {"passed": bool, "detail": str, ...}}
    cpu: dict[str, object]
    build: dict[str, object]  # how it was built: flags, seconds

    def passed(self) -> list[str]:
        return [name for name, entry in self.variants.items() if entry.get("smoke", {}).get("passed")]

    def write(self, directory: Path) -> None:
        data = {"format": MANIFEST_FORMAT, **self.__dict__}
        (directory / MANIFEST).write_text(json.dumps(data, indent=1))

    @classmethod
    def read(cls, directory: Path) -> Manifest | None:
        """The manifest in `directory`; None where there is none, or one of another format."""
        try:
            data = json.loads((directory / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if data.get("format") != MANIFEST_FORMAT:
            return None
        return cls(data["version"], data["variants"], data["cpu"], data["build"])


@dataclass(frozen=True)
class Library:
    """The llama.cpp library chosen before `import llama_cpp`: the directory to bind (None:
    the wheel's) and why, in plain words."""

    directory: Path | None
    reason: str


def choose_library(environ: Mapping[str, str] = os.environ) -> Library:
    """The directory llama-cpp-python should bind (see the module's docstring for the order)."""
    if environ.get(LIB_VARIABLE):
        return Library(Path(environ[LIB_VARIABLE]), f"{LIB_VARIABLE} names it")
    choice = environ.get(CHOICE_VARIABLE, "").strip()
    if choice == WHEEL:
        return Library(None, f"{CHOICE_VARIABLE}={WHEEL}")
    version = llama_cpp_python_version()
    if version is None:
        return Library(None, "llama-cpp-python is not installed")
    directory = build_dir(version)
    manifest = Manifest.read(directory)
    if manifest is None or manifest.version != version:
        return Library(None, f"no kernels built for llama-cpp-python {version} (specdecode kernels --build)")
    if not cpu_variants(directory, environ):
        return Library(None, "none of the built variants runs on this CPU (specdecode kernels --build)")
    return Library(directory, f"built for llama-cpp-python {version}")


def cpu_variants(directory: Path, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The CPU variants in `directory` to try, best first: those this CPU runs, present as
    files, and (where a manifest is there) that passed their smoke test; only the one
    SPECDECODE_LLAMA_KERNELS names where it names one."""
    features = usable_features(machine_features())
    manifest = Manifest.read(directory)
    chosen = [
        name
        for name in runnable(features)
        if (directory / library_file(name)).is_file() and (manifest is None or name in manifest.passed())
    ]
    asked = environ.get(CHOICE_VARIABLE, "").strip()
    if asked and asked != WHEEL:
        if asked not in VARIANTS:
            raise SpecdecodeError(
                f"{CHOICE_VARIABLE}={asked}: no such variant (choose from wheel, {', '.join(VARIANTS)})"
            )
        if asked not in chosen:
            raise SpecdecodeError(
                f"{CHOICE_VARIABLE}={asked}: not built in {directory}, not passed its smoke test, "
                "or this CPU lacks its features (specdecode kernels shows which run here)"
            )
        return [asked]
    return chosen


@contextlib.contextmanager
def library_path(directory: Path | None) -> Iterator[None]:
    """LLAMA_CPP_LIB_PATH set to `directory` for the import only (child processes choose again)."""
    if directory is None or os.environ.get(LIB_VARIABLE) == str(directory):
        yield
        return
    os.environ[LIB_VARIABLE] = str(directory)
    try:
        yield
    finally:
        del os.environ[LIB_VARIABLE]


def has_cpu_variants(directory: Path) -> bool:
    """Whether `directory` holds a build whose CPU kernels are loaded at run time."""
    return any(directory.glob("libggml-cpu-*.so"))


def load_cpu_backend(directory: Path) -> str | None:
    """Register the best CPU variant of the build in `directory` with ggml, and return its
    name; None for a build with its CPU kernels linked in (the wheel's). A variant that does
    not load gives way to the next; none loading is an error (llama.cpp would have no CPU).
    Where this CPU's variants are not listed here (not x86-64 Linux), ggml picks by its score."""
    if not has_cpu_variants(directory):
        return None
    ggml = ctypes.CDLL(str(directory / "libggml.so"))  # the very one libllama linked
    ggml.ggml_backend_load.argtypes, ggml.ggml_backend_load.restype = [ctypes.c_char_p], ctypes.c_void_p
    ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    cpu = 0  # GGML_BACKEND_DEVICE_TYPE_CPU
    if machine_features() is None:
        ggml.ggml_backend_load_all_from_path(str(directory).encode())
        tried, loaded = ["ggml's choice"], ggml.ggml_backend_dev_by_type(cpu)
        if loaded:
            return tried[0]
    else:
        tried = cpu_variants(directory)
        for name in tried:
            loaded = ggml.ggml_backend_load(str(directory / library_file(name)).encode())
            if loaded and ggml.ggml_backend_dev_by_type(cpu):
                return name
    raise SpecdecodeError(
        f"llama.cpp's libraries in {directory} load their CPU kernels at run time, and none of "
        f"{', '.join(tried) or 'their variants'} loaded on this CPU: rebuild them (specdecode kernels "
        f"--build) or use llama-cpp-python's own ({CHOICE_VARIABLE}={WHEEL}, {LIB_VARIABLE} unset)"
    )
