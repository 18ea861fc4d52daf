"""`specdecode kernels [--build]`: which of llama.cpp's CPU kernels the llama.cpp backend runs,
and the build of llama.cpp's CPU variants for this CPU (`specdecode.backends.llama_kernels`).

The build compiles the installed llama-cpp-python's own llama.cpp (its source release, fetched
with pip) into the user's cache, then runs each variant in a process of its own on tiny GGUF
files of every type the export writes without llama.cpp: a variant that crashes, dies of an
illegal instruction or gives non-finite logits is marked failed in the manifest and never
chosen. Where it cannot build (no cmake, no compiler, no network for the source), it says so
and llama.cpp keeps running on llama-cpp-python's own library.

The parser imports nothing heavy (see `specdecode.cli`); the handlers import what they use.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from specdecode.cli.settings import say
from specdecode.errors import SpecdecodeError

SMOKE_FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0")
SMOKE_SECONDS = 600  # per variant, all files
# Run in a process of its own per variant, through the same selection every run takes.
SMOKE = """
import json, sys, torch
from specdecode.backends import llama_lib
from specdecode.backends.load import load_backend
from specdecode.backends.options import LoadOptions
llama_lib.require_library()
found = {"variant": llama_lib.VARIANT, "files": {}}
for path in sys.argv[1:]:
    backend = load_backend(path, LoadOptions(backend="llama.cpp", threads=1, n_ctx=256))
    logits = backend.evaluate(list(range(5, 40)))
    backend.invariant  # runs the row probe: passes of many sizes
    found["files"][path.rsplit("/", 1)[-1]] = {
        "finite": bool(torch.isfinite(logits).all()), "invariant_rows": backend.model.invariant_rows,
    }
print(json.dumps(found))
"""


def add_kernels_parser(commands: argparse._SubParsersAction) -> None:
    """`kernels [--build]`: the CPU kernels llama.cpp runs here, and their build."""
    kernels = commands.add_parser(
        "kernels",
        help="show or build llama.cpp's CPU kernels for this CPU (the llama.cpp backend's)",
        description=(
            "Which llama.cpp library the llama.cpp backend runs: llama.cpp's CPU variants built "
            "for this CPU (the best it runs, row-invariant in every pass size) or "
            "llama-cpp-python's own portable build. --build compiles them (about 5 CPU-minutes, "
            "once per llama-cpp-python version) into $XDG_CACHE_HOME/specdecode/llama-kernels. "
            "SPECDECODE_LLAMA_KERNELS=wheel runs llama-cpp-python's own library instead; "
            "LLAMA_CPP_LIB_PATH, when set, is always respected."
        ),
        epilog="examples:\n  specdecode kernels\n  specdecode kernels --build",
    )
    kernels.add_argument(
        "--build", action="store_true", help="build the variants this CPU runs, test and keep them"
    )
    kernels.add_argument(
        "--variants",
        help="with --build: the variants to build, comma-separated, or 'all' that this CPU runs "
        "(default: the best, the best without AMX, and haswell or x64)",
    )
    kernels.add_argument(
        "--source",
        type=Path,
        help="with --build: llama.cpp's source tree of the installed llama-cpp-python (its "
        "vendor/llama.cpp; default: fetched with pip)",
    )
    kernels.add_argument(
        "--force",
        action="store_true",
        help="with --build: build again where the variants are built and passed their smoke test",
    )
    kernels.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="compile jobs")
    kernels.add_argument(
        "--cmake-flags",
        action="store_true",
        help="print the CMake flags that compile llama.cpp's CPU backend as the best variant this "
        "CPU runs (for a build of llama.cpp's own programs), and nothing else",
    )
    kernels.set_defaults(handler="specdecode.cli.kernels_command:run_kernels")


def run_kernels(args: argparse.Namespace) -> None:
    from specdecode.backends import llama_kernels

    if args.cmake_flags:
        best = llama_kernels.runnable(llama_kernels.usable_features(llama_kernels.machine_features()))
        print(" ".join(llama_kernels.cmake_feature_flags(best[0]) if best else []))
        return
    if args.build:
        build(args.variants, args.source, args.jobs, args.force)
    show()


def show() -> None:
    """The CPU, the variants it runs, the build kept and the library in use, in plain words."""
    from specdecode.backends import llama_kernels as kernels
    from specdecode.local import cpu_info

    features = kernels.machine_features()
    model = cpu_info().get("model name", "unknown CPU")
    if features is None:
        print(f"CPU: {model}: not x86-64 Linux, where llama.cpp's CPU variants are chosen here")
    else:
        amx = ""
        if features & kernels.AMX:
            amx = (
                "; AMX tiles permitted" if kernels.amx_permitted() else "; AMX tiles NOT permitted by the OS"
            )
        print(f"CPU: {model}: {' '.join(sorted(features)) or 'no listed features'}{amx}")
        print(
            f"variants it runs, best first: {', '.join(kernels.runnable(kernels.usable_features(features)))}"
        )
    version = kernels.llama_cpp_python_version()
    if version is None:
        print("llama-cpp-python is not installed: the llama.cpp backend is unavailable")
        return
    directory = kernels.build_dir(version)
    manifest = kernels.Manifest.read(directory)
    if manifest is None:
        print(f"llama-cpp-python {version}: no kernels built (specdecode kernels --build)")
    else:
        timing = manifest.build
        print(
            f"llama-cpp-python {version}: built in {directory} on {manifest.cpu.get('model', '?')}, "
            f"{timing.get('wall_seconds', 0):.0f} s ({timing.get('cpu_seconds', 0):.0f} CPU-s)"
        )
        for name, entry in manifest.variants.items():
            smoke = entry.get("smoke", {})
            verdict = "passed" if smoke.get("passed") else "FAILED"
            print(f"  {name}: {verdict} its smoke test: {smoke.get('detail', '')}")
    from specdecode.backends import llama_lib

    try:
        llama_lib.require_library()
    except SpecdecodeError as exc:
        print(f"in use: none: {exc}")
        return
    if llama_lib.VARIANT is not None:
        print(f"in use: {llama_lib.VARIANT} from {llama_lib.library_dir()} ({llama_lib.LIBRARY.reason})")
    else:
        print(
            f"in use: llama-cpp-python's own library in {llama_lib.library_dir()} "
            f"({llama_lib.LIBRARY.reason})"
        )


def build(variants: str | None, source: Path | None, jobs: int, force: bool = False) -> None:
    """Compile, smoke-test and keep the variants (see the module's docstring); variants kept
    already, built with the same flags and passed, are not built again unless `force`."""
    import resource  # Unix's: the build is for Linux

    from specdecode.backends import llama_kernels as kernels
    from specdecode.local import cpu_info

    version = kernels.llama_cpp_python_version()
    if version is None:
        raise SpecdecodeError("llama-cpp-python is not installed: pip install 'specdecode[llama-cpp]'")
    features = kernels.machine_features()
    if features is None:
        raise SpecdecodeError(
            "llama.cpp's CPU variants are built here for x86-64 Linux only: llama.cpp runs on "
            "llama-cpp-python's own library"
        )
    usable = kernels.usable_features(features)
    names = chosen_variants(variants, usable)
    missing = [tool for tool in ("cmake", "make", "c++") if shutil.which(tool) is None]
    if missing:
        raise SpecdecodeError(
            f"cannot build llama.cpp's kernels: no {', '.join(missing)} on PATH; llama.cpp runs on "
            "llama-cpp-python's own library (a portable AVX2-level build)"
        )
    target = kernels.build_dir(version)
    kept = kernels.Manifest.read(target)
    if not force and kept is not None and kept.version == version and set(names) <= set(kept.passed()):
        say(f"the variants {', '.join(names)} are built and passed their smoke test (--force builds again)")
        return
    # Kept where a step fails, so that running the command again resumes the compilation.
    work = target.parent / f"{target.name}.work"
    work.mkdir(parents=True, exist_ok=True)
    log = work / "build.log"
    if source is None:
        source = fetch_source(version, work)
    say(f"building llama.cpp's libraries and the variants {', '.join(names)} (-j {jobs})")
    started, children = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    library = compile_libraries(source, work / "cmake", names, jobs, log)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    timing = {
        "flags": list(kernels.CMAKE_FLAGS),
        "wall_seconds": round(time.monotonic() - started, 1),
        "cpu_seconds": round(used.ru_utime + used.ru_stime - children.ru_utime - children.ru_stime, 1),
    }
    say(f"built in {timing['wall_seconds']:.0f} s ({timing['cpu_seconds']:.0f} CPU-s)")
    staged = work / "lib"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    for path in library.iterdir():
        if path.name.startswith("lib") and ".so" in path.name:
            shutil.copy2(path, staged / path.name, follow_symlinks=False)
    with tempfile.TemporaryDirectory() as models:
        results = smoke_test(staged, names, Path(models))
    cpu = {"model": cpu_info().get("model name", "unknown"), "features": sorted(features)}
    entries = {name: {"features": list(kernels.VARIANTS[name]), "smoke": results[name]} for name in names}
    kernels.Manifest(version, entries, cpu, timing).write(staged)
    shutil.rmtree(target, ignore_errors=True)
    staged.rename(target)
    shutil.rmtree(work)
    passed = [name for name in names if results[name]["passed"]]
    if not passed:
        raise SpecdecodeError(f"no variant passed its smoke test (see {target / kernels.MANIFEST})")


def chosen_variants(asked: str | None, usable: frozenset[str]) -> list[str]:
    from specdecode.backends import llama_kernels as kernels

    fit = kernels.runnable(usable)
    if not asked:
        return kernels.variants_to_build(usable)
    if asked == "all":
        return fit
    names = [name.strip() for name in asked.split(",") if name.strip()]
    unknown = [name for name in names if name not in kernels.VARIANTS]
    if unknown:
        raise SpecdecodeError(
            f"--variants: no variant {', '.join(unknown)} (choose from {', '.join(kernels.VARIANTS)})"
        )
    if not_here := [name for name in names if name not in fit]:
        raise SpecdecodeError(
            f"--variants: this CPU cannot run {', '.join(not_here)} (it runs {', '.join(fit)})"
        )
    return names


def fetch_source(version: str, work: Path) -> Path:
    """llama.cpp's source as llama-cpp-python's source release of `version` holds it (fetched
    into `work` unless already there)."""
    source = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    say(f"fetching llama-cpp-python {version}'s source release with pip")
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps"]
    run([*command, f"llama-cpp-python=={version}", "-d", str(work)], "pip could not fetch the source")
    archives = sorted(work.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise SpecdecodeError(f"pip fetched no source release of llama-cpp-python {version}")
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python 3.10.12 and later
    with tarfile.open(archives[0]) as archive:
        archive.extractall(work, **safe)
    return source


def compile_libraries(source: Path, cmake_dir: Path, names: list[str], jobs: int, log: Path) -> Path:
    """libllama, libggml, libggml-base and the variants `names`; returns where they are.

    ggml's target depends on every variant, so the libraries are built with the Makefiles'
    /fast targets (no dependencies), in their order of linking: a variant links the object
    library of its feature check (its score), <variant>-feats."""
    from specdecode.backends.llama_kernels import CMAKE_FLAGS

    if not (source / "CMakeLists.txt").is_file():
        raise SpecdecodeError(f"{source} is not llama.cpp's source tree (no CMakeLists.txt)")
    configure = ["cmake", "-S", str(source), "-B", str(cmake_dir), "-G", "Unix Makefiles", *CMAKE_FLAGS]
    run([*configure, "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON"], "cmake could not configure llama.cpp", log)
    make = ["make", "-C", str(cmake_dir), f"-j{max(1, jobs)}"]
    variants = [f"ggml-cpu-{name}" for name in names]
    for targets in (
        ["ggml-base"],
        ["ggml"],
        [f"{variant}-feats" for variant in variants],
        ["llama", *variants],
    ):
        run([*make, *(f"{target}/fast" for target in targets)], "compiling llama.cpp failed", log)
    return cmake_dir / "bin"


def smoke_test(library: Path, names: list[str], models: Path) -> dict[str, dict]:
    """Each variant in a process of its own on tiny GGUF files: passed, or why not."""
    files = smoke_models(models)
    results = {}
    for name in names:
        env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(library), "SPECDECODE_LLAMA_KERNELS": name}
        env["SPECDECODE_NO_PASS_CACHE"] = "1"
        say(f"smoke test: {name}")
        try:
            done = subprocess.run(
                [sys.executable, "-c", SMOKE, *map(str, files)],
                env=env,
                capture_output=True,
                text=True,
                timeout=SMOKE_SECONDS,
            )
        except subprocess.TimeoutExpired:
            results[name] = {"passed": False, "detail": f"no answer in {SMOKE_SECONDS} s"}
            continue
        results[name] = smoke_verdict(name, done.returncode, done.stdout, done.stderr)
        say(f"  {results[name]['detail']}")
    return results


def smoke_verdict(name: str, returncode: int, stdout: str, stderr: str) -> dict:
    """A variant's smoke result from its process: passed only if it loaded that very variant
    and every file gave finite logits; with the rows each file's probe found invariant."""
    if returncode != 0:
        why = f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
        last = stderr.strip().splitlines()[-1:] or [""]
        return {"passed": False, "detail": f"{why} {last[0]}".strip()}
    found = json.loads(stdout.strip().splitlines()[-1])
    if found["variant"] != name:
        return {"passed": False, "detail": f"loaded {found['variant']} instead"}
    files = found["files"]
    if not all(entry["finite"] for entry in files.values()):
        return {"passed": False, "detail": "non-finite logits", "files": files}
    rows = ", ".join(
        f"{Path(file).stem.split('-')[-1]} {entry['invariant_rows']}" for file, entry in files.items()
    )
    return {"passed": True, "detail": f"invariant rows per type: {rows}", "files": files}


def smoke_models(directory: Path) -> list[Path]:
    """A tiny random Llama as GGUF files of every type written without llama.cpp."""
    import torch

    from specdecode.backends.gguf_files import export_gguf
    from specdecode.testing import make_llama, make_tokenizer, save_model

    tokenizer = make_tokenizer()
    model = make_llama(len(tokenizer), hidden=64, dtype=torch.float32)
    source = save_model(directory / "model", model, tokenizer)
    return [export_gguf(source, directory / f"smoke-{fmt}.gguf", fmt) for fmt in SMOKE_FORMATS]


def run(command: list[str], failure: str, log: Path | None = None) -> None:
    """A build step, its output appended to `log`; where it fails, its error lines are shown
    (the compiler's warnings would bury them)."""
    done = subprocess.run(command, capture_output=True, text=True)
    output = done.stdout + done.stderr
    if log is not None:
        with log.open("a") as file:
            file.write(f"$ {' '.join(command)}\n{output}\n")
    if done.returncode != 0:
        lines = output.strip().splitlines()
        errors = [
            line for line in lines if ("error" in line.lower() or "***" in line) and "warning" not in line
        ]
        shown = "\n".join((errors or lines)[-12:])
        where = f" (all of it in {log})" if log is not None else ""
        raise SpecdecodeError(f"{failure}{where}:\n{shown}")
