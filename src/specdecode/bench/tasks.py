"""The benchmark's prompt sets, Spec-Bench style, built offline from held-out code.

Four kinds of work, because the strategies shine on different ones:

* completion: a function's signature and docstring; the model writes the body;
* editing: a function and an instruction ("add type hints", "rename x to y"); the rewritten
  function repeats most of the input, which is where model-free drafting wins;
* extraction: a function with a long docstring, then a request to quote that docstring;
* free: the first lines of a module, continued freely (little to copy from the prompt);
* free-t1: the same prompts sampled at temperature 1.0 (llama.cpp's other sampling defaults,
  a fixed seed per prompt, `match` verification, so every system's output is still plain
  generation's), where fewer drafted tokens are kept than under greedy decoding.

Every prompt comes from the held-out split of the standard-library corpus (files the bundled
models never trained on), by a fixed rule: files in path order, functions in source order, the
first ones that fit the size limits. Nothing is chosen by how well a strategy does on it.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from specdecode.bench.flags import TASK_NAMES
from specdecode.errors import SpecdecodeError, read_text_file
from specdecode.sampling import SamplingParams
from specdecode.train.corpus import corpus_files, split_files, stdlib_root

TEMPERATURES = {"free-t1": 1.0}  # tasks sampled rather than greedy
MAX_FUNCTION_CHARS = 900  # keeps prompt + answer inside the 512 positions the bundled pair trained on
MIN_FUNCTION_LINES = 6
FREE_PROMPT_LINES = 5
EDIT_INSTRUCTIONS = (
    "Add type hints to every parameter and to the return value.",
    "Rename the parameter `{arg}` to `{arg}_value`.",
    "Add a comment above every statement that explains it.",
)


@dataclass(frozen=True)
class Task:
    name: str
    prompts: tuple[str, ...]
    temperature: float = 0.0  # 0: greedy

    def sampling(self, prompt_index: int) -> SamplingParams:
        """Greedy, or sampled with a seed fixed per prompt: every run of every system on one
        prompt generates the same tokens, which is what the exactness column checks."""
        return SamplingParams(temperature=self.temperature, seed=prompt_index)


@dataclass(frozen=True)
class Function:
    """A function of a held-out file: its dedented source and what the prompts need of it."""

    name: str
    source: str
    header: str  # the signature and docstring, when it has one
    docstring: str | None
    first_argument: str | None


def heldout_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_root()
    files = split_files(corpus_files(root), root)[1]
    if not files:
        raise SpecdecodeError(f"the corpus under {root} has no held-out files")
    return files


def functions_of(path: Path) -> Iterator[Function]:
    """Undecorated functions and methods of a file, in source order, within the size limits."""
    text = read_text_file(path)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    lines = text.split("\n")
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
            continue
        source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])) + "\n"
        if len(source) > MAX_FUNCTION_CHARS or source.count("\n") < MIN_FUNCTION_LINES or "\t" in source:
            continue
        body_start = node.body[0]
        header_end = body_start.end_lineno if ast.get_docstring(node) else body_start.lineno - 1
        header = textwrap.dedent("\n".join(lines[node.lineno - 1 : header_end])) + "\n"
        arguments = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
        yield Function(node.name, source, header, ast.get_docstring(node), (arguments or [None])[0])


def completion_prompt(function: Function, index: int) -> str | None:
    """The header without its last newline: byte-level BPE merges a newline with the next
    line's indentation, so a prompt ending in a bare newline ends where no training text did."""
    return function.header.rstrip("\n") if function.docstring else None


def editing_prompt(function: Function, index: int) -> str | None:
    instruction = EDIT_INSTRUCTIONS[index % len(EDIT_INSTRUCTIONS)]
    if "{arg}" in instruction:
        if function.first_argument is None:
            return None
        instruction = instruction.format(arg=function.first_argument)
    return f"# {instruction}\n\n# Before:\n{function.source}\n# After:\n"


def extraction_prompt(function: Function, index: int) -> str | None:
    if not function.docstring or function.docstring.count("\n") < 3:
        return None
    return f'{function.source}\n\n# The docstring of {function.name}, quoted word for word:\nDOC = """'


PROMPT_MAKERS: dict[str, Callable[[Function, int], str | None]] = {
    "completion": completion_prompt,
    "editing": editing_prompt,
    "extraction": extraction_prompt,
}


def function_prompts(
    files: Sequence[Path],
    make: Callable[[Function, int], str | None],
    count: int,
    used: set[tuple[Path, str]],
) -> list[str]:
    """Up to `count` prompts, at most one per file, so a set spans several modules; functions
    in `used` (taken by another task) are skipped, and those taken here are added to it."""
    prompts: list[str] = []
    for path in files:
        for function in functions_of(path):
            prompt = None if (path, function.name) in used else make(function, len(prompts))
            if prompt is not None:
                prompts.append(prompt)
                used.add((path, function.name))
                break
        if len(prompts) == count:
            break
    return prompts


def free_prompts(files: Sequence[Path], count: int) -> list[str]:
    """The first lines of modules that have at least that many non-blank lines."""
    prompts = []
    for path in files:
        lines = [line for line in read_text_file(path).split("\n") if line.strip()]
        if len(lines) >= 2 * FREE_PROMPT_LINES:
            prompts.append("\n".join(lines[:FREE_PROMPT_LINES]))
        if len(prompts) == count:
            break
    return prompts


def build_tasks(names: Sequence[str], per_task: int, files: Sequence[Path] | None = None) -> list[Task]:
    """The prompt sets of the named tasks, `per_task` prompts each (fewer only if the corpus
    runs out), from the held-out files."""
    unknown = [name for name in names if name not in TASK_NAMES]
    if unknown:
        raise SpecdecodeError(f"unknown task {unknown[0]!r} (choose from {', '.join(TASK_NAMES)})")
    if per_task < 1:
        raise SpecdecodeError(f"prompts per task must be >= 1, not {per_task}")
    files = sorted(files if files is not None else heldout_files(), key=str)
    built, used = {}, set()
    for name in TASK_NAMES:  # all, in one order: a task's prompts do not depend on the others asked
        prompts = (
            free_prompts(files, per_task)
            if name.startswith("free")
            else function_prompts(files, PROMPT_MAKERS[name], per_task, used)
        )
        if not prompts and name in names:
            raise SpecdecodeError(f"the held-out files give no prompt for the {name} task")
        built[name] = Task(name, tuple(prompts), TEMPERATURES.get(name, 0.0))
    return [built[name] for name in names]


def as_chats(tasks: Sequence[Task], render: Callable[[str], str]) -> list[Task]:
    """The tasks with each prompt rendered as the user's message of a chat (`bench --chat`)."""
    return [replace(task, prompts=tuple(render(prompt) for prompt in task.prompts)) for task in tasks]


def custom_task(prompts: Sequence[str]) -> Task:
    """The user's own prompts (-p / -f), run as one task in place of the built-in ones."""
    if any(not prompt for prompt in prompts):
        raise SpecdecodeError("empty prompt")
    return Task("custom", tuple(prompts))
