"""The examples of README.md and docs/quickstart.md, run as they are written.

Every fenced block of the two documents is either run or shown:

* ```bash and ```sh blocks run in bash (`set -e`), ```python blocks in the Python running these
  tests; all in one scratch directory, in document order, with this environment's programs
  (`specdecode`, `python`) first on PATH. Each block must succeed. A command that a test
  cannot run (it installs packages, or is the test suite itself) is excepted by its exact
  text in NOT_RUN, never skipped silently.
* ```text blocks show what the block just before them printed: the terminal's lines, start-up
  lines, generated text and statistics. The generated text must be what the command printed
  (see `generated_text`); timings and acceptance counts vary from run to run and are not
  compared. No other language is allowed, so that no example escapes.

"Your own model" examples are written with placeholders, which the test replaces by the
bundled pair's directories (`specdecode.defaults.bundled_pair`): `path/to/model` is the bundled
target, `path/to/draft` its draft. The shown outputs are therefore the bundled pair's.

A server example is a block holding one `specdecode serve ... --port 8080` line: the test starts
it on a free port instead, waits until it answers, runs the blocks after it against that port
(every `127.0.0.1:8080` becomes the free one), and stops it when the document ends.

Greedy text depends on the arithmetic: the shown outputs were made on a CPU with bfloat16
arithmetic (AVX512-BF16 or AMX), where `--dtype auto` runs the bundled pair in bfloat16. On other
machines the blocks still run and must print text, but the text is not compared.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from specdecode import LoadOptions
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.backends.load import load_backend
from specdecode.defaults import bundled_pair

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "docs/quickstart.md")
SHELLS = ("bash", "sh")
RUN = (*SHELLS, "python")
SHOWN = "text"

# Shell lines no test can run, by their exact text (a trailing `# comment` aside), and why.
NOT_RUN = {
    "make demo": "sets up the virtual environment these tests run in",
    "make test": "runs this test suite",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": "installs packages",
    "pip install '.[all,llama-cpp]'": "installs packages",
    "make llama-tools": "builds llama.cpp's programs: minutes",
    "specdecode export --engines llama.cpp --gguf-type q8_0 --out q8": "the comparison's files",
    "python -m specdecode.compare.llama_tools --target q8/llama.cpp/target.gguf --draft "
    "q8/llama.cpp/draft.gguf --raw -n 128 --rounds 2": "the comparison: llama.cpp's programs, 5 minutes",
}

PLACEHOLDERS = ("path/to/model", "path/to/draft")  # in bundled_pair()'s order: target, draft
DOCUMENTED_PORT = "8080"
SERVE = re.compile(r"^specdecode serve\b.*--port 8080\b")
# Where the statistics start: the command's `seed N` line, or `stats.format()`'s first line.
SUMMARY = re.compile(r"^(seed \d+|prompt +\d+ tokens)")
START_UP = ("specdecode: ", "note: ", "warning: ")  # stderr lines before the generated text
COMMAND_TIMEOUT_S = 300


@dataclass(frozen=True)
class Fence:
    """A fenced block: its language, its code, and the lines (0-based) of its two fences."""

    language: str
    code: str
    first: int
    last: int


@dataclass(frozen=True)
class Block:
    """A block to run, and what the document shows it printing (the ```text block after it)."""

    language: str
    code: str
    line: int  # where its fence opens, 1-based
    shown: str | None = None


def fences(lines: list[str]) -> Iterator[Fence]:
    """Every fenced block; fences must start their line, so that none hides in an indented one."""
    index = 0
    while index < len(lines):
        assert not re.match(r"^\s+```", lines[index]), f"an indented fence at line {index + 1}"
        opening = re.match(r"^```(\S*)\s*$", lines[index])
        if opening is None:
            index += 1
            continue
        first = index
        index += 1
        while index < len(lines) and lines[index] != "```":
            index += 1
        assert index < len(lines), f"the block opened at line {first + 1} is never closed"
        yield Fence(opening.group(1), "".join(line + "\n" for line in lines[first + 1 : index]), first, index)
        index += 1


def document_blocks(document: str) -> list[Block]:
    """The runnable blocks of a document, each with the output shown right after it: a ```text
    block that only blank lines separate from a runnable block. Any other ```text block is an
    error, as is any other language."""
    lines = (ROOT / document).read_text().splitlines()
    blocks: list[Block] = []
    previous: Fence | None = None
    for fence in fences(lines):
        where = f"{document} line {fence.first + 1}"
        assert fence.language in (*RUN, SHOWN), (
            f"{where}: a ```{fence.language} block; the test runs {', '.join(RUN)} blocks "
            f"and compares {SHOWN} blocks, so examples must be one of those"
        )
        if fence.language == SHOWN:
            follows_run = previous is not None and previous.language in RUN
            assert follows_run and not any(line.strip() for line in lines[previous.last + 1 : fence.first]), (
                f"{where}: a ```{SHOWN} block that does not directly follow a block the test runs"
            )
            blocks[-1] = replace(blocks[-1], shown=fence.code)
        else:
            blocks.append(Block(fence.language, fence.code, fence.first + 1))
        previous = fence
    return blocks


def command_part(line: str) -> str:
    """A shell line without its trailing comment (`  # ...`), as NOT_RUN names it."""
    return line.split("  #")[0].strip()


def runnable_script(code: str) -> str:
    """A shell block without its NOT_RUN lines."""
    return "".join(line for line in code.splitlines(keepends=True) if command_part(line) not in NOT_RUN)


def generated_text(output: str) -> list[str]:
    """The generated text in what a block printed or shows: start-up lines and the statistics
    (from their first line on) removed, trailing spaces and blank lines dropped."""
    lines = [line.rstrip() for line in output.splitlines()]
    while lines and lines[0].startswith(START_UP):
        lines.pop(0)
    for index, line in enumerate(lines):
        if SUMMARY.match(line):
            del lines[index:]
            break
    while lines and not lines[-1]:
        lines.pop()
    return lines


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server(command: str, cwd: Path, env: dict[str, str]) -> Iterator[str]:
    """The documented `specdecode serve` command on a free port for the duration of the `with`
    block; yields the port. Its output goes to a log file, which no full pipe can stall."""
    port = str(free_port())
    log_path = cwd / f"serve-{port}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            ["bash", "-c", "exec " + command.replace(f"--port {DOCUMENTED_PORT}", f"--port {port}")],
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while True:
            assert process.poll() is None, f"the server ended at start-up:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, "the server did not answer in time"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.5)
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """One scratch directory for both documents: files one block writes, later blocks read."""
    return tmp_path_factory.mktemp("examples")


@pytest.fixture(scope="module")
def environment() -> dict[str, str]:
    """This environment's programs (`specdecode`, `python`) first on PATH, as after
    `source .venv/bin/activate`."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


@pytest.fixture(scope="module")
def same_arithmetic() -> bool:
    """Whether this machine runs the bundled pair as the one that made the shown outputs did: on
    a CPU, on llama.cpp's row-invariant kernels (what `--backend auto` picks where they are
    built), on the GGUF file written from the pair's bfloat16 weights."""
    target = load_backend(bundled_pair()[0], LoadOptions())
    return isinstance(target, LlamaCppBackend)


@pytest.fixture(scope="module")
def outputs() -> dict[tuple[str, str], str]:
    """What each distinct block printed: a block shown in both documents runs once."""
    return {}


def test_every_example_is_run_or_shown_output():
    blocks = [block for document in DOCUMENTS for block in document_blocks(document)]
    assert any(block.language == "python" for block in blocks)
    assert any(block.shown is not None for block in blocks)
    shell_lines = {
        command_part(line) for block in blocks if block.language in SHELLS for line in block.code.splitlines()
    }
    assert set(NOT_RUN) <= shell_lines, f"NOT_RUN names lines no document has: {set(NOT_RUN) - shell_lines}"


def test_generated_text_is_found_between_start_up_lines_and_statistics():
    terminal = (
        "specdecode: loading the target model from t\nspecdecode: ready in 1.0 s\n"
        "\n    return x  \n\nseed 7\nprompt           8 tokens     0.005 s\n"
    )
    assert generated_text(terminal) == ["", "    return x"]
    assert generated_text("\n    return x\n") == ["", "    return x"]
    assert generated_text("a\nprompt           8 tokens     0.005 s\nb\n") == ["a"]


@pytest.mark.slow
@pytest.mark.parametrize("document", DOCUMENTS)
def test_examples_run_and_print_what_they_show(document, workdir, environment, outputs, same_arithmetic):
    substitutions = dict(zip(PLACEHOLDERS, (str(path) for path in bundled_pair()), strict=True))
    local = f"127.0.0.1:{DOCUMENTED_PORT}"
    with ExitStack() as stack:
        port = None
        for block in document_blocks(document):
            where = f"{document} line {block.line}"
            code = block.code
            for placeholder, path in substitutions.items():
                code = code.replace(placeholder, path)
            if block.language in SHELLS and SERVE.match(code):
                assert code.count("\n") == 1, f"{where}: a server block holds its one command alone"
                assert port is None, f"{where}: a second server"
                port = stack.enter_context(server(code.strip(), workdir, environment))
                continue
            if local in code:
                assert port is not None, f"{where}: a client before any server block"
                output = run_block(
                    block.language, code.replace(local, f"127.0.0.1:{port}"), workdir, environment, where
                )
            else:
                if (block.language, code) not in outputs:
                    outputs[(block.language, code)] = run_block(
                        block.language, code, workdir, environment, where
                    )
                output = outputs[(block.language, code)]
            if block.shown is None:
                continue
            printed = generated_text(output)
            assert any(printed), f"{where}: printed no text:\n{output}"
            if same_arithmetic:
                assert printed == generated_text(block.shown), (
                    f"{where}: printed other text than shown:\n{output}"
                )


def run_block(language: str, code: str, cwd: Path, env: dict[str, str], where: str) -> str:
    """Run one block; its stdout (the generated text, and a script's prints), failing with its
    stderr when it fails."""
    if language == "python":
        command = [sys.executable, "-c", code]
    else:
        command = ["bash", "-e", "-c", runnable_script(code)]
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"{where} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout
