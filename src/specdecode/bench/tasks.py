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

Two agent-like tasks are sessions of several turns run in order on one pipeline, each turn's
prompt the conversation so far, the model's own earlier answers included (an agent re-reading
and re-emitting its output, where a cache that learns across requests pays):

* agent-edit: a function and an edit instruction, then further edits of the previous answer;
* agent-records: a record of a function's facts as JSON, re-emitted with one field changed
  each turn.

Five chat tasks are written as a user's messages, for instruction-tuned models through their
chat template (`bench --chat`): chat-edit, chat-complete, chat-summarise (a long docstring of a
held-out file to summarise), chat-qa (a question over such a document) and chat-free (explain
a held-out module).

Every prompt comes from the held-out split of the standard-library corpus (files the bundled
models never trained on), by a fixed rule: files in path order, functions in source order, the
first ones that fit the size limits. Nothing is chosen by how well a strategy does on it.
"""

from __future__ import annotations

import ast
import json
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from specdecode.bench.names import ALL_TASKS
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
SESSION_TURNS = 3  # turns of an agent-like session
DOCUMENT_CHARS = (300, 1500)  # a docstring long enough to summarise, short enough for a prompt


@dataclass(frozen=True)
class Task:
    name: str
    prompts: tuple[str, ...]
    temperature: float = 0.0  # 0: greedy
    # Sessions: per prompt, the user's later turns, each sent after the model's previous answer.
    follow_ups: tuple[tuple[str, ...], ...] = ()
    # The prompt text of a conversation (the user's turns and the answers, alternating): the
    # turns one after the other, or a chat template's rendering (`as_chats`).
    conversation: Callable[[Sequence[str]], str] = "".join
    seed: int = 0  # a sampled prompt's seed: this plus the prompt's index

    def prompt_text(self, prompt_index: int) -> str:
        """The first turn's prompt, as the model reads it."""
        return self.conversation([self.prompts[prompt_index]])

    def turns(self, prompt_index: int) -> tuple[str, ...]:
        """The user's turns of a prompt: the prompt alone, or a session's every turn."""
        later = self.follow_ups[prompt_index] if self.follow_ups else ()
        return (self.prompts[prompt_index], *later)

    def sampling(self, prompt_index: int) -> SamplingParams:
        """Greedy, or sampled with a seed fixed per prompt: every run of every system on one
        prompt generates the same tokens, which is what the exactness column checks."""
        return SamplingParams(temperature=self.temperature, seed=self.seed + prompt_index)


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
    instruction = _instruction(function, index)
    if instruction is None:
        return None
    return f"# {instruction}\n\n# Before:\n{function.source}\n# After:\n"


def extraction_prompt(function: Function, index: int) -> str | None:
    if not function.docstring or function.docstring.count("\n") < 3:
        return None
    return f'{function.source}\n\n# The docstring of {function.name}, quoted word for word:\nDOC = """'


def fenced(source: str) -> str:
    return f"```python\n{source}```"


def chat_edit_prompt(function: Function, index: int) -> str | None:
    instruction = _instruction(function, index)
    if instruction is None:
        return None
    return f"{instruction} Reply with the whole function.\n\n{fenced(function.source)}"


def chat_complete_prompt(function: Function, index: int) -> str | None:
    if not function.docstring:
        return None
    return f"Write the body of this function; reply with the whole function.\n\n{fenced(function.header)}"


def _instruction(function: Function, index: int) -> str | None:
    """The index-th edit instruction (cycling), None where it needs an argument the function lacks."""
    instruction = EDIT_INSTRUCTIONS[index % len(EDIT_INSTRUCTIONS)]
    if "{arg}" not in instruction:
        return instruction
    return instruction.format(arg=function.first_argument) if function.first_argument else None


PROMPT_MAKERS: dict[str, Callable[[Function, int], str | None]] = {
    "completion": completion_prompt,
    "editing": editing_prompt,
    "extraction": extraction_prompt,
    "chat-edit": chat_edit_prompt,
    "chat-complete": chat_complete_prompt,
}


def agent_edit_session(function: Function) -> tuple[str, ...] | None:
    """A function and every edit instruction, one per turn, each on the previous answer: the
    answer re-emits most of the function each time."""
    if function.first_argument is None:
        return None
    instructions = [_instruction(function, i) for i in range(SESSION_TURNS)]
    first = f"# {instructions[0]}\n\n# Before:\n{function.source}\n# After:\n"
    later = (
        f"\n\n# {instruction} Write the whole function again.\n# After:\n" for instruction in instructions[1:]
    )
    return (first, *later)


def function_record(function: Function, path: Path) -> dict[str, object]:
    """Facts read off a function's source: what a tool might hand an agent as JSON."""
    return {
        "module": path.stem,
        "function": function.name,
        "first_argument": function.first_argument,
        "lines": function.source.count("\n"),
        "documented": function.docstring is not None,
        "summary": (function.docstring or "").split("\n")[0],
        "reviewed": False,
    }


def agent_records_session(function: Function, path: Path) -> tuple[str, ...]:
    """A record as JSON, then one changed field per turn: each answer repeats the record."""
    record = function_record(function, path)
    changes = [("reviewed", True), ("lines", record["lines"] + 1), ("function", f"{function.name}_v2")]
    first = (
        f"Record:\n{json.dumps(record, indent=2)}\n\n"
        f"Write the record again as JSON with {changes[0][0]!r} set to {json.dumps(changes[0][1])}.\n"
    )
    later = (
        f"\n\nWrite the last record again as JSON with {field!r} set to {json.dumps(value)}.\n"
        for field, value in changes[1:SESSION_TURNS]
    )
    return (first, *later)


SESSION_MAKERS: dict[str, Callable[[Function, Path], tuple[str, ...] | None]] = {
    "agent-edit": lambda function, path: agent_edit_session(function),
    "agent-records": agent_records_session,
}


def session_prompts(
    files: Sequence[Path], make: Callable[[Function, Path], tuple[str, ...] | None], count: int, used: set
) -> list[tuple[str, ...]]:
    """Up to `count` sessions, at most one per file, functions not taken by another task (as
    `function_prompts` picks them)."""
    sessions: list[tuple[str, ...]] = []
    for path in files:
        for function in functions_of(path):
            session = None if (path, function.name) in used else make(function, path)
            if session is not None:
                sessions.append(session)
                used.add((path, function.name))
                break
        if len(sessions) == count:
            break
    return sessions


def documents(files: Sequence[Path]) -> Iterator[tuple[Path, str]]:
    """Per file, its first docstring (module, class or function, in `ast.walk` order) within
    DOCUMENT_CHARS: the text a user asks to summarise or asks about."""
    low, high = DOCUMENT_CHARS
    for path in files:
        try:
            tree = ast.parse(read_text_file(path))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and low <= len(text) <= high and "\t" not in text:
                    yield path, text
                    break


def document_prompts(files: Sequence[Path], count: int) -> dict[str, list[str]]:
    """chat-summarise takes the first `count` documents, chat-qa the next `count`."""
    texts = [text for _, text in documents(files)]
    return {
        "chat-summarise": [f"Summarise this text in three sentences.\n\n{text}" for text in texts[:count]],
        "chat-qa": [
            f"{text}\n\nAccording to the text above, what does it describe, and what should a "
            "caller watch out for?"
            for text in texts[count : 2 * count]
        ],
    }


def chat_free_prompts(files: Sequence[Path], count: int) -> list[str]:
    """Questions about held-out modules, by the module's dotted name."""
    return [
        f"What is the Python module `{module_name(path)}` for? Give a short example of using it."
        for path in files[:count]
    ]


def module_name(path: Path) -> str:
    """The dotted name of a standard-library file (asyncio/threads.py -> asyncio.threads); a file
    elsewhere goes by its stem."""
    try:
        parts = path.with_suffix("").relative_to(stdlib_root()).parts
    except ValueError:
        parts = (path.stem,)
    return ".".join(part for part in parts if part != "__init__") or path.stem


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
    unknown = [name for name in names if name not in ALL_TASKS]
    if unknown:
        raise SpecdecodeError(f"unknown task {unknown[0]!r} (choose from {', '.join(ALL_TASKS)})")
    if per_task < 1:
        raise SpecdecodeError(f"prompts per task must be >= 1, not {per_task}")
    files = sorted(files if files is not None else heldout_files(), key=str)
    built, used = {}, set()
    texts = document_prompts(files, per_task)
    for name in ALL_TASKS:  # all, in one order: a task's prompts do not depend on the others asked
        sessions = []
        if name.startswith("free"):
            prompts = free_prompts(files, per_task)
        elif name in SESSION_MAKERS:
            sessions = session_prompts(files, SESSION_MAKERS[name], per_task, used)
            prompts = [session[0] for session in sessions]
        elif name in texts:
            prompts = texts[name]
        elif name == "chat-free":
            prompts = chat_free_prompts(files, per_task)
        else:
            prompts = function_prompts(files, PROMPT_MAKERS[name], per_task, used)
        if not prompts and name in names:
            raise SpecdecodeError(f"the held-out files give no prompt for the {name} task")
        follow_ups = tuple(session[1:] for session in sessions)
        built[name] = Task(name, tuple(prompts), TEMPERATURES.get(name, 0.0), follow_ups)
    return [built[name] for name in names]


def as_chats(tasks: Sequence[Task], render: Callable[[Sequence[str]], str]) -> list[Task]:
    """The tasks with each prompt the user's message of a chat (`bench --chat`), and a session's
    later turns further messages after the assistant's answers: `render` the conversation."""
    return [replace(task, conversation=render) for task in tasks]


def with_sampling(tasks: Sequence[Task], temperature: float | None, seed: int | None) -> list[Task]:
    """The tasks at one temperature (`bench --temp`: every task, free-t1 too; None: each its
    own) with seeds counted from `seed` (`--seed`; None: from 0, the prompt's index)."""
    if temperature is not None and temperature < 0:
        raise SpecdecodeError(f"--temp must be >= 0 (0: greedy), not {temperature}")
    changes: dict[str, float | int] = {} if temperature is None else {"temperature": temperature}
    changes |= {} if seed is None else {"seed": seed}
    return [replace(task, **changes) for task in tasks]


def custom_task(prompts: Sequence[str]) -> Task:
    """The user's own prompts (-p / -f), run as one task in place of the built-in ones."""
    if any(not prompt for prompt in prompts):
        raise SpecdecodeError("empty prompt")
    return Task("custom", tuple(prompts))
