"""`specdecode generate -cnv` with no prompt and a terminal on stdin: a conversation, as
llama-cli holds one.

Each turn renders the whole conversation through the chat template (the model's, or
--chat-template-file's; -sys first) and generates the answer, streamed as it comes. The target's
cache keeps what the previous turn left (its prompt and answer), so a turn evaluates only what
follows the prefix it shares with the previous one (`specdecode.generate.reusable_prompt_prefix`).

Keys and commands, as llama-cli's: `/exit`, Ctrl-D (end of input) or Ctrl-C at the prompt end the
conversation (exit status 0); Ctrl-C during an answer stops it at the next chunk, keeps the text
so far as the answer and returns to the prompt; a second Ctrl-C before it stopped ends the
program (status 130). `/regen` answers the last message again, `/clear` starts over (the system
message kept), `/read FILE` adds a text file to the next message. A line ending in a backslash
continues on the next line.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from specdecode.chat import ChatPrompt, encode_rendered
from specdecode.errors import SpecdecodeError, read_text_file

if TYPE_CHECKING:
    from specdecode.api import Pipeline
    from specdecode.constraints import ConstraintSpec
    from specdecode.generate import Chunk, Generation, GenerationConfig
    from specdecode.sampling import SamplingParams

PROMPT = "> "
MORE = ". "  # the marker of a continued line
COMMANDS = "/exit (or Ctrl-D) ends, Ctrl-C stops an answer, /regen, /clear, /read FILE"


def wants_conversation(args: argparse.Namespace, stdin: TextIO | None = None) -> bool:
    """-cnv with no prompt (-p, -f) and a terminal to type on: a conversation. Without a
    terminal, a missing prompt stays the mistake it was (a script waits for no one)."""
    stdin = sys.stdin if stdin is None else stdin
    if not args.chat or args.prompt is not None or args.file is not None:
        return False
    if not (stdin is not None and stdin.isatty()):
        return False
    if args.json:
        raise SpecdecodeError(
            "--json prints one answer, and a conversation has many: give the message with -p"
        )
    return True


def chat_prompt_ids(
    pipeline: Pipeline, chat: ChatPrompt, user: str | list[str], config: GenerationConfig
) -> list[int]:
    """A message or a conversation (`ChatPrompt.messages`) rendered and tokenized as the server
    does a chat, by the model's tokenizer; a rendering too long for the context is refused
    before it is tokenized (a template may write megabytes)."""
    tokenizer = pipeline.target.tokenizer
    text = chat.text(tokenizer, user, pipeline.target.name)
    pipeline.check_text(text, config)
    return encode_rendered(tokenizer, text)


def interrupted(run: Generation) -> None:
    """End a generation the user stopped: closed (idempotent), its stop reason saying why."""
    if run.stats.stop_reason in ("", "abandoned"):  # "abandoned": closed as Ctrl-C unwound it
        run.stats.stop_reason = "interrupted"
    run.close()


@dataclass
class CtrlC:
    """Ctrl-C while an answer is generated: the first press asks it to stop (`pressed`, read
    between chunks, so no pass is cut halfway and the cache stays whole for the next turn); a
    second one, before it stopped, is the KeyboardInterrupt that ends the program. Only the main
    thread can take signals; elsewhere Ctrl-C keeps Python's default."""

    pressed: bool = False
    _previous: object = None

    def __enter__(self) -> CtrlC:
        self.pressed = False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._press)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _press(self, signum: int, frame: FrameType | None) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True


def terminal_reader() -> Callable[[str], str]:
    """input(), with line editing and history where Python has readline (not on Windows)."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (imported for its effect on input())
    return input


def turn_line(run: Generation, cached: int) -> str:
    """One line after each answer, as llama-cli's timings line."""
    s = run.stats
    return (
        f"[ {s.n_generated} tokens, {s.tokens_per_second:.1f} tokens/s, {s.tokens_per_pass:.2f} tokens per "
        f"pass | prompt {s.n_prompt} tokens, {cached} cached | stopped: {s.stop_reason} ]"
    )


@dataclass
class Conversation:
    """The conversation so far and the settings every turn generates with."""

    pipeline: Pipeline
    chat: ChatPrompt
    sampling: SamplingParams
    config: GenerationConfig
    constraint: ConstraintSpec | None = None
    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)
    turns: list[str] = field(default_factory=list)  # the user's messages and the answers, alternating
    pending: str = ""  # text of /read files, for the next message

    def run(self, read: Callable[[str], str] | None = None) -> None:
        """Read messages and answer them until /exit, end of input or Ctrl-C at the prompt."""
        read = terminal_reader() if read is None else read
        self.chat.check(self.pipeline.target.tokenizer, self.pipeline.target.name)
        print(f"conversation: {COMMANDS}", file=self.err)
        while True:
            try:
                line = self.read_message(read)
            except (EOFError, KeyboardInterrupt):  # Ctrl-D, Ctrl-C at the prompt: llama-cli ends
                print(file=self.out, flush=True)
                return
            if line.strip() == "/exit" or line.startswith("/exit "):
                return
            self.command(line)

    def read_message(self, read: Callable[[str], str]) -> str:
        """One message: lines ending in a backslash continue on the next."""
        lines = [read(PROMPT)]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(read(MORE))
        return "\n".join(lines)

    def command(self, line: str) -> None:
        """Answer a message, or run the command it is; anything else starting with / is a message
        (as in llama-cli: a path is a fine first word)."""
        if line.strip() == "/regen":
            if not self.turns:
                print("error: no answer to regenerate yet", file=self.err)
                return
            self.turns.pop()
            self.answer()
        elif line.strip() == "/clear":
            self.turns.clear()
            self.pending = ""
            print("the conversation is cleared", file=self.err)
        elif line.startswith("/read "):
            name = line[len("/read ") :].strip()
            try:
                self.pending += f"--- File: {name} ---\n{read_text_file(name, 'file')}\n"
            except SpecdecodeError as exc:
                print(f"error: {exc}", file=self.err)
                return
            print(f"read {name}: it goes with your next message", file=self.err)
        elif line.strip() or self.pending:
            self.turns.append(self.pending + line)
            self.pending = ""
            self.answer()

    def answer(self) -> None:
        """Generate the answer to the last message, streamed, and keep it (the text so far, when
        Ctrl-C stopped it)."""
        from specdecode.generate import reusable_prompt_prefix

        try:
            with CtrlC() as ctrl_c:  # from the rendering on: a Ctrl-C then stops this answer only
                run = self.start()
                if run is None:
                    return
                cached = reusable_prompt_prefix(self.pipeline.target, run.prompt)
                Echo(self.out).show(run, lambda: ctrl_c.pressed)
        except KeyboardInterrupt:  # the second Ctrl-C: the program ends, on a line of its own
            print(file=self.out, flush=True)
            raise
        if ctrl_c.pressed:
            interrupted(run)
        self.turns.append(run.text)
        print(file=self.out, flush=True)
        if run.stats.stop_reason == "context":
            print(
                f"note: the context is full (-c {self.pipeline.target.n_ctx}): /clear starts over",
                file=self.err,
            )
        print(turn_line(run, cached), file=self.err, flush=True)

    def start(self) -> Generation | None:
        """The generation of the answer to the whole conversation; None for a conversation the
        turn cannot take (too long for the context, a template that fails on it): an error line,
        and the message is dropped so that the conversation goes on."""
        try:
            ids = chat_prompt_ids(self.pipeline, self.chat, self.turns, self.config)
            return self.pipeline.stream(ids, self.sampling, self.config, constraint=self.constraint)
        except SpecdecodeError as exc:
            self.turns.pop()
            print(f"error: {exc}", file=self.err)
            if "context" in str(exc):
                print("note: /clear starts the conversation over", file=self.err)
            return None


@dataclass
class Echo:
    """Generated text written to a terminal (or a pipe) as it comes."""

    out: TextIO
    shown: list[str] = field(default_factory=list)  # what was written

    def show(self, chunks: Iterable[Chunk], stop: Callable[[], bool] = lambda: False) -> None:
        """Write each chunk's text until the chunks end or `stop()`."""
        for chunk in chunks:
            self.out.write(chunk.text)
            self.out.flush()
            self.shown.append(chunk.text)
            if stop():
                break

    @property
    def written(self) -> str:
        return "".join(self.shown)
