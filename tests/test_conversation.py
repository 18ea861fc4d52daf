"""`specdecode generate -cnv` with no prompt on a terminal holds a conversation, as llama-cli does:
each turn renders the whole history through the chat template and answers it (the target's cache
reused for the prefix the turns share, and the answer still plain generation's); /exit, end of
input and Ctrl-C at the prompt end it; Ctrl-C during an answer ends that answer only. A plain
generate interrupted by Ctrl-C prints the text so far and the statistics, then exits 130."""

from __future__ import annotations

import copy
import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

import specdecode
from specdecode.api import Pipeline
from specdecode.chat import ChatPrompt, encode_rendered
from specdecode.cli import main
from specdecode.cli.conversation import Conversation, wants_conversation
from specdecode.errors import SpecdecodeError
from specdecode.generate import Generation, GenerationConfig
from specdecode.sampling import SamplingParams
from specdecode.testing import make_llama, make_tokenizer, save_model

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SYSTEM = "Answer in code."
GREEDY = SamplingParams()
CONFIG = GenerationConfig(n_predict=12, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A float64 chat model, and the same model without a template."""
    root = tmp_path_factory.mktemp("conversation-models")
    base_tokenizer = make_tokenizer(320)
    chat_tokenizer = copy.deepcopy(base_tokenizer)
    chat_tokenizer.chat_template = TEMPLATE
    target = make_llama(len(base_tokenizer), init_std=0.5, seed=3, max_positions=4096)
    return {
        "chat": save_model(root / "chat", target, chat_tokenizer),
        "base": save_model(root / "base", target, base_tokenizer),
    }


def lines(*typed: str | BaseException) -> Callable[[str], str]:
    """A terminal's reader: each call returns the next line typed, or raises it (EOFError for
    Ctrl-D, KeyboardInterrupt for Ctrl-C); end of input after the last."""
    queue = list(typed)

    def read(prompt: str) -> str:
        if not queue:
            raise EOFError
        line = queue.pop(0)
        if isinstance(line, BaseException):
            raise line
        return line

    read.queue = queue
    return read


class Recorder:
    """Pipeline.stream, recording each turn's prompt ids and run, and sending `signals` SIGINTs
    to this process after the `after`-th chunk of the turns listed in `interrupt`."""

    def __init__(self, pipeline: Pipeline, interrupt: tuple[int, ...] = (), after: int = 2, signals: int = 1):
        self.pipeline, self.stream = pipeline, pipeline.stream
        self.prompts: list[list[int]] = []
        self.runs: list[Generation] = []
        self.interrupt, self.after, self.signals = interrupt, after, signals
        pipeline.stream = self

    def __call__(self, prompt, *args, **kwargs):
        run = self.stream(prompt, *args, **kwargs)
        self.prompts.append(list(prompt))
        self.runs.append(run)
        if len(self.runs) - 1 in self.interrupt:
            return Interrupting(run, self.after, self.signals)
        return run


class Interrupting:
    """A generation whose iteration presses Ctrl-C (a real SIGINT) after some chunks."""

    def __init__(self, run: Generation, after: int, signals: int) -> None:
        self.run, self.after, self.signals = run, after, signals

    def __getattr__(self, name: str):
        return getattr(self.run, name)

    def __iter__(self) -> Iterator:
        for count, chunk in enumerate(self.run, 1):
            yield chunk
            if count == self.after:
                for _ in range(self.signals):
                    os.kill(os.getpid(), signal.SIGINT)


def conversation(model: Path, **settings) -> tuple[Conversation, Recorder]:
    pipeline = Pipeline.load(model)
    talk = Conversation(pipeline, ChatPrompt(SYSTEM), GREEDY, CONFIG, out=io.StringIO(), err=io.StringIO())
    return talk, Recorder(pipeline, **settings)


def plain_answer(model: Path, turns: list[str]) -> tuple[list[int], str]:
    """The rendered conversation's ids, and a fresh pipeline's plain greedy answer to them."""
    pipeline = Pipeline.load(model)  # plain generation: no draft, no strategies
    tokenizer = pipeline.target.tokenizer
    ids = encode_rendered(tokenizer, ChatPrompt(SYSTEM).text(tokenizer, turns, "test"))
    return ids, pipeline.generate(ids, GREEDY, CONFIG).text


def test_two_turns_keep_the_history_and_answer_as_plain_generation(models):
    talk, recorder = conversation(models["chat"])
    talk.run(lines("def fib(n):", "now in C"))
    first, second = (run.text for run in recorder.runs)
    assert talk.turns == ["def fib(n):", first, "now in C", second]
    for turn, (run, prompt) in enumerate(zip(recorder.runs, recorder.prompts, strict=True)):
        ids, expected = plain_answer(models["chat"], talk.turns[: 2 * turn + 1])
        assert prompt == ids  # the whole history, through the template
        assert run.text == expected  # the cache the first turn left changes no bit
    assert first in talk.pipeline.target.tokenizer.decode(recorder.prompts[1])
    out = talk.out.getvalue()
    assert out.index(first) < out.index(second)
    cached = [int(n) for n in re.findall(r"(\d+) cached", talk.err.getvalue())]
    assert cached[0] == 0 and cached[1] > len(recorder.prompts[0]) // 2  # the first turn's prefix kept


@pytest.mark.parametrize(
    "typed",
    [
        ("/exit", "never read"),
        (EOFError(), "never read"),
        (KeyboardInterrupt(), "never read"),
        ("/exit now",),
    ],
    ids=["/exit", "ctrl-d", "ctrl-c-at-the-prompt", "/exit-words"],
)
def test_exit_end_of_input_and_ctrl_c_at_the_prompt_end_it(models, typed):
    talk, recorder = conversation(models["chat"])
    read = lines(*typed)
    talk.run(read)  # returns: exit status 0, as llama-cli's
    assert recorder.runs == [] and read.queue in ([], ["never read"])


def test_ctrl_c_during_an_answer_ends_that_answer_and_the_conversation_goes_on(models):
    talk, recorder = conversation(models["chat"], interrupt=(0,), after=2)
    before = signal.getsignal(signal.SIGINT)
    talk.run(lines("def fib(n):", "go on"))
    assert signal.getsignal(signal.SIGINT) is before
    stopped, answered = recorder.runs
    assert stopped.stats.stop_reason == "interrupted" and answered.stats.stop_reason == "n_predict"
    assert 0 < len(stopped.tokens) < CONFIG.n_predict
    assert talk.turns == ["def fib(n):", stopped.text, "go on", answered.text]  # the text so far kept
    assert answered.text == plain_answer(models["chat"], talk.turns[:3])[1]
    assert "stopped: interrupted" in talk.err.getvalue()


def test_a_second_ctrl_c_before_the_answer_stops_ends_the_program(models):
    talk, recorder = conversation(models["chat"], interrupt=(0,), after=1, signals=2)
    before = signal.getsignal(signal.SIGINT)
    read = lines("def fib(n):", "never read")
    with pytest.raises(KeyboardInterrupt):  # main's exit status 130, as llama-cli's
        talk.run(read)
    assert signal.getsignal(signal.SIGINT) is before and read.queue == ["never read"]
    assert len(recorder.runs) == 1 and talk.turns == ["def fib(n):"]


def test_commands_regen_clear_read_and_continued_lines(models, tmp_path):
    talk, recorder = conversation(models["chat"])
    (tmp_path / "notes.txt").write_text("x = 1\n")
    typed = ["def f(x):", "/regen", "/clear", f"/read {tmp_path / 'notes.txt'}", "two \\", "lines", "/regen"]
    talk.run(lines(*typed, f"/read {tmp_path / 'missing.txt'}"))
    assert [run.text for run in recorder.runs[:2]] == [recorder.runs[0].text] * 2  # greedy: the same again
    tokenizer = talk.pipeline.target.tokenizer
    third = tokenizer.decode(recorder.prompts[2])
    assert (
        "def f(x):" not in third and "--- File: " in third and "x = 1\n" in third and "two \nlines" in third
    )
    assert recorder.prompts[3] == recorder.prompts[2]
    err = talk.err.getvalue()
    assert "conversation is cleared" in err and "cannot read" in err


def test_a_turn_the_context_cannot_hold_is_an_error_and_the_conversation_goes_on(models):
    talk, recorder = conversation(models["chat"])
    talk.config = GenerationConfig(n_predict=5000, ignore_eos=True)
    talk.run(lines("x", "short"))
    assert recorder.runs == [] and talk.turns == []
    err = talk.err.getvalue()
    assert err.count("error: ") == 2 and "/clear starts the conversation over" in err


def test_a_model_without_a_template_is_refused_before_the_first_message(models):
    talk, _ = conversation(models["base"])
    with pytest.raises(SpecdecodeError, match="has no chat template"):
        talk.run(lines("never read"))


class Terminal(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("chat", "prompt", "tty", "wanted"),
    [
        (True, None, True, True),
        (True, None, False, False),
        (True, "x", True, False),
        (False, None, True, False),
    ],
)
def test_a_conversation_is_minus_cnv_with_no_prompt_on_a_terminal(chat, prompt, tty, wanted):
    args = SimpleNamespace(chat=chat, prompt=prompt, file=None, json=False)
    assert wants_conversation(args, Terminal(tty)) is wanted


def test_json_has_no_conversation(models):
    args = SimpleNamespace(chat=True, prompt=None, file=None, json=True)
    with pytest.raises(SpecdecodeError, match="--json prints one answer"):
        wants_conversation(args, Terminal(True))


# ---------------------------------------------------------------- Ctrl-C in a plain generate


@pytest.mark.parametrize("output", ["text", "--stream", "--json"])
def test_ctrl_c_in_generate_prints_the_text_so_far_and_the_stats(models, monkeypatch, capsys, output):
    """The KeyboardInterrupt comes from within a step, as Ctrl-C during a pass brings it."""
    step, calls = Generation.step, []

    def interrupted_step(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Generation, "step", interrupted_step)
    argv = [
        "generate",
        "-m",
        str(models["chat"]),
        "-p",
        "def f(x):",
        "-n",
        "24",
        "--temp",
        "0",
        "--ignore-eos",
    ]
    flags = [] if output == "text" else [output]
    assert main([*argv, "--spec-type", "none", *flags]) == 130
    run = calls[0]
    assert 0 < len(run.tokens) < 24 and run.stats.stop_reason == "interrupted"
    captured = capsys.readouterr()
    if output == "--json":
        result = json.loads(captured.out)
        assert result["text"] == run.text and result["stats"]["stop_reason"] == "interrupted"
    else:
        assert captured.out == run.text + "\n"
        assert "stopped: interrupted" in captured.err and f"seed {run.stats.seed}" in captured.err


# ---------------------------------------------------------------- a real terminal


class Child:
    """`specdecode generate` in a subprocess whose stdin and stdout are a pseudo-terminal."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = pty.openpty()
        env = {**os.environ, "PYTHONPATH": str(Path(specdecode.__file__).parents[1])}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specdecode.cli", *argv],
            stdin=slave,
            stdout=slave,
            stderr=subprocess.PIPE,
            env=env,
        )
        os.close(slave)
        self.out, self.err = bytearray(), bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        streams = {self.master: self.out, self.process.stderr.fileno(): self.err}
        while streams:
            for fd in select.select(list(streams), [], [], 0.1)[0]:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # the pty's other end closed
                    data = b""
                if data:
                    streams[fd].extend(data)
                else:
                    del streams[fd]

    def wait_for(self, pattern: str, stream: str = "err", after: int = 0, timeout: float = 120) -> int:
        """Where `pattern` (a regex) shows in stdout or stderr past `after`, once it does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = bytes(self.out if stream == "out" else self.err).decode(errors="replace")
            found = re.compile(pattern).search(text, after)
            if found:
                return found.end()
            assert self.process.poll() is None, f"exited {self.process.returncode}: {text}"
            time.sleep(0.02)
        raise AssertionError(f"no {pattern!r} in {stream}: {bytes(self.out)!r} {bytes(self.err)!r}")

    def type(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\r")

    def close(self) -> int:
        code = self.process.wait(timeout=60)
        self.reader.join(timeout=5)
        os.close(self.master)
        return code


def test_a_conversation_on_a_real_terminal(models):
    """Typed lines, a streamed answer stopped by Ctrl-C, another answer, /exit: status 0."""
    child = Child(
        ["generate", "-m", str(models["chat"]), "-cnv", "-sys", SYSTEM, "--temp", "0", "--ignore-eos"]
    )
    try:
        child.wait_for(r"conversation: /exit")
        at = child.wait_for(r"> ", "out")
        child.type("def fib(n):")  # -n -1 in a conversation: no end but Ctrl-C (or the context)
        child.wait_for(r"[\s\S]{20}", "out", child.wait_for(r"fib\(n\):", "out", at))  # streaming
        child.process.send_signal(signal.SIGINT)
        first = child.wait_for(r"stopped: interrupted \]")
        at = child.wait_for(r"> ", "out", child.wait_for(r"fib\(n\):", "out", at))
        child.type("/regen")
        child.wait_for(r"[\s\S]{20}", "out", child.wait_for(r"/regen", "out", at))
        child.process.send_signal(signal.SIGINT)
        child.wait_for(r"stopped: interrupted \]", after=first)
        child.wait_for(r"> ", "out", child.wait_for(r"/regen", "out", at))
        child.type("/exit")
        assert child.close() == 0
    finally:
        if child.process.poll() is None:
            child.process.kill()
            child.close()
