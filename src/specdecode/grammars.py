"""A constraint's text: what it may cost, its checks, and its compilation against a tokenizer.

The grammar engine, llguidance, recurses in native code over some structures of a grammar,
and past a depth set by the thread's stack it ends the whole process with a segmentation
fault, which no exception handler sees. Measured with llguidance 1.9: a chain of rules each
naming the next (`r1 ::= "a" r2 | "b"`) crashes at 2,000 to 4,000 rules on an 8 MiB stack
and at 600 to 1,000 on a 2 MiB one; a chain of JSON schema `$ref`s at 500 to 1,000 on 8 MiB
(200 pass on 2 MiB). The engine itself refuses deeper nesting of parentheses in a regex and
of objects in a schema (about 128 levels). So a constraint's text is first held to limits
checked in time linear in its length (`check_cost`), under what passes on a 2 MiB stack:

- at most MAX_TEXT_CHARS characters;
- a grammar: at most MAX_RULES rules; any text: parentheses (a schema: objects and arrays)
  nested at most MAX_NESTING deep;
- a JSON schema: at most MAX_REFS `$ref`s.

A server checks a new constraint once in a child process (`check_isolated`), with a time
limit, on a thread with a 2 MiB stack, before its own threads compile it: a grammar that would
crash or hang the engine takes the child down, not the server, and is refused.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import weakref
from collections import OrderedDict
from copy import copy
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from specdecode.errors import SpecdecodeError, require

if TYPE_CHECKING:
    import llguidance

KINDS = ("grammar", "json_schema", "regex")
JSON_OPTIONS = {"whitespace_flexible": False}
FEATURE = "constrained generation (a grammar, JSON schema or regex)"
# The most alternatives one GBNF rule may have. The engine puts a rule's alternatives in one row
# of its parser, and fails at the first token whose row holds more items than its limit; rows
# are sized with room for the items around the largest rule.
MAX_ALTERNATIVES = 2000
ROW_ITEMS = 2 * MAX_ALTERNATIVES
PROBED_FIRST_TOKENS = 4096  # the most first tokens tried when a grammar is compiled
MAX_TEXT_CHARS = 1_000_000
MAX_RULES = 500
MAX_NESTING = 100
MAX_REFS = 200
CHECK_SECONDS = 20.0  # the most a child process may take over one constraint's first check
CHECK_STACK = 2 * 1024 * 1024  # the stack of the child's checking thread: no server thread has less
VERDICTS = 256  # first checks remembered (by the text's digest)
TokenizerKey = tuple[int, int, int | None]  # a tokenizer's number, the logits' size, the end token


def engine(module: str = "llguidance") -> ModuleType:
    """llguidance (or one of its modules), imported by the first constraint: generation without
    one never loads it, and runs where it is not installed."""
    return require(module, FEATURE)


def parser_limits() -> llguidance.LLParserLimits:
    """The engine's limits: its defaults, with rows for MAX_ALTERNATIVES and what surrounds them."""
    return engine().LLParserLimits(max_items_in_row=ROW_ITEMS)


def one_line(message: str) -> str:
    """An engine's multi-line message (with its caret drawings) as one line."""
    return " ".join(message.split())


# ---------------------------------------------------------------------- what a text may cost

LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?[0-9]+)?[ \t]*:", re.MULTILINE)


def check_cost(kind: str, text: str) -> None:
    """Refuse a constraint text past the limits above, in time linear in its length."""
    what = f"invalid {kind.replace('_', ' ')}"
    if len(text) > MAX_TEXT_CHARS:
        raise SpecdecodeError(f"{what}: it is {len(text)} characters long (at most {MAX_TEXT_CHARS:,})")
    if kind == "json_schema":
        return  # checked once parsed (`_check_schema_cost`)
    gbnf = kind == "grammar" and not engine("llguidance.gbnf_to_lark").is_lark_syntax(text)
    if kind == "grammar":
        rules = text.count("::=") if gbnf else len(LARK_RULE.findall(text))
        if rules > MAX_RULES:
            raise SpecdecodeError(f"{what}: it has {rules} rules (at most {MAX_RULES})")
    depth = _nesting(text, gbnf)
    if depth > MAX_NESTING:
        raise SpecdecodeError(f"{what}: parentheses nest {depth} deep (at most {MAX_NESTING})")


def _nesting(text: str, gbnf: bool) -> int:
    """How deep parentheses nest in a grammar or regex, those inside a GBNF grammar's literals,
    character classes and comments left out (elsewhere, an upper bound)."""
    depth = deepest = 0
    quote: str | None = None  # the end of the literal or class being read ('"' or "]")
    escaped = comment = False
    for char in text:
        if comment:
            comment = char != "\n"
        elif escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif quote is not None:
            quote = None if char == quote else quote
        elif gbnf and char in '"[#':
            quote, comment = {'"': '"', "[": "]"}.get(char), char == "#"
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(0, depth - 1)
    return deepest


def _check_schema_cost(schema: Any) -> None:
    """Refuse a parsed JSON schema nested deeper than MAX_NESTING or with more than MAX_REFS
    `$ref`s (walked without recursion)."""
    refs = 0
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_NESTING:
            raise SpecdecodeError(f"invalid json schema: it nests {depth} deep (at most {MAX_NESTING})")
        if isinstance(value, dict):
            refs += "$ref" in value
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
    if refs > MAX_REFS:
        raise SpecdecodeError(f"invalid json schema: it has {refs} $refs (at most {MAX_REFS})")


# ---------------------------------------------------------------------- GBNF


def _check_gbnf(gbnf: str) -> None:
    """Refuse what the engine accepts in a GBNF grammar and fails on only as it generates, in
    time linear in the grammar's size and without recursion:

    - a rule (or group) with more alternatives than MAX_ALTERNATIVES, which fails when a row
      of its parser first holds them all (rules of terminals alone are compiled into the
      lexer, where alternatives cost no row);
    - a rule that matches no text (`x ::= "a" x`): from the root, it runs the parser out of
      items; below it, it ends the output where it must go on."""
    converter = engine("llguidance.gbnf_to_lark")
    rules = converter.GrammarParser().parse(gbnf)
    if "root" not in rules:
        raise SpecdecodeError("invalid grammar: no 'root' rule")
    # Each node of each rule's tree is a gate that matches some text when its children do: a
    # sequence all of them, an alternative one, a reference its rule's tree.
    needed: list[int] = []  # per gate: children still to match (<= 0: it matches)
    parent: list[int] = []  # per gate: the gate above it in its rule's tree (-1: a rule's top)
    body: dict[str, int] = {}  # rule -> its top gate
    callers: dict[str, list[int]] = {name: [] for name in rules}  # rule -> the gates naming it
    named: dict[str, set[str]] = {name: set() for name in rules}  # rule -> the rules it names
    widest: dict[str, int] = {}  # rule -> its largest number of alternatives
    for name, rule in rules.items():
        stack = [(rule.alternatives, -1)]
        widest[name] = 0
        while stack:
            node, above = stack.pop()
            gate = len(needed)
            parent.append(above)
            if above < 0:
                body[name] = gate
            children = node.children()
            if isinstance(node, converter.RuleRefNode):
                if node.name not in rules:
                    raise SpecdecodeError(f"invalid grammar: rule {node.name!r} is not defined")
                callers[node.name].append(gate)
                named[name].add(node.name)
                needed.append(1)
            elif isinstance(node, converter.AlternativeNode):
                widest[name] = max(widest[name], len(node.alternatives))
                needed.append(1)
            elif isinstance(node, converter.RepetitionNode):
                needed.append(0 if node.min_times == 0 else 1)
            else:  # a sequence needs each child; a literal or a character class, nothing
                needed.append(len(children))
            stack.extend((child, gate) for child in children)
    terminal = _terminal_rules(named)
    for name, count in widest.items():
        if name not in terminal and count > MAX_ALTERNATIVES:
            raise SpecdecodeError(
                f"invalid grammar: rule {name!r} has {count} alternatives (at most {MAX_ALTERNATIVES})"
            )
    top_of = {gate: name for name, gate in body.items()}
    ready = [gate for gate, count in enumerate(needed) if count == 0]
    while ready:
        gate = ready.pop()
        above = [parent[gate]] if parent[gate] >= 0 else callers[top_of[gate]]
        for target in above:
            needed[target] -= 1
            if needed[target] == 0:
                ready.append(target)
    for name in rules:
        if needed[body[name]] > 0:
            raise SpecdecodeError(
                "invalid grammar: no text matches " + ("it" if name == "root" else f"rule {name!r}")
            )


def _terminal_rules(named: dict[str, set[str]]) -> set[str]:
    """The rules the GBNF converter makes terminals (compiled into the lexer): all but root
    whose named rules are all terminals, found from the leaves up (each rule visited once)."""
    users: dict[str, list[str]] = {name: [] for name in named}
    for name, targets in named.items():
        for target in targets:
            users[target].append(name)
    waiting = {name: len(targets) for name, targets in named.items()}
    found = [name for name, count in waiting.items() if count == 0 and name != "root"]
    terminal = set(found)
    while found:
        for user in users[found.pop()]:
            waiting[user] -= 1
            if waiting[user] == 0 and user != "root":
                terminal.add(user)
                found.append(user)
    return terminal


# ---------------------------------------------------------------------- specs and compiling


@dataclass(frozen=True)
class ConstraintSpec:
    """What the output must match: kind "grammar" (GBNF, or Lark with a `%llguidance` header),
    "json_schema" (a schema, as JSON text) or "regex"; text is the grammar, schema or pattern."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SpecdecodeError(f"unknown constraint kind {self.kind!r} (choose from {', '.join(KINDS)})")

    @classmethod
    def json_object(cls) -> ConstraintSpec:
        """Any JSON object (OpenAI's `json_object`)."""
        return cls("json_schema", json.dumps({"type": "object"}))

    def grammar(self) -> str:
        """The llguidance grammar; a SpecdecodeError for text that is not a grammar of its kind,
        or past the limits on its cost (checked fully against a tokenizer when compiled)."""
        check_cost(self.kind, self.text)
        matcher = engine().LLMatcher
        try:
            if self.kind == "regex":
                return matcher.grammar_from_regex(self.text)
            if self.kind == "json_schema":
                schema = json.loads(self.text)
                if not isinstance(schema, dict):
                    raise SpecdecodeError("a JSON schema must be a JSON object")
                _check_schema_cost(schema)
                # Compact JSON ("," and ":" between items, no other whitespace) unless the
                # schema's own "x-guidance" options say otherwise.
                return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            # GBNF's converter reports a bad grammar with any exception (a bare Exception included).
            converter = engine("llguidance.gbnf_to_lark")
            if not converter.is_lark_syntax(self.text):
                _check_gbnf(self.text)
            return matcher.grammar_from_lark(converter.any_to_lark(self.text))
        except SpecdecodeError:
            raise
        except Exception as exc:
            raise SpecdecodeError(f"invalid {self.kind.replace('_', ' ')}: {one_line(str(exc))}") from exc


# One llguidance tokenizer per Hugging Face tokenizer object: building one reads the whole
# vocabulary (about a second for a large one), and a server's slots share it.
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(hf_tokenizer, vocab_size: int, eos_id: int | None) -> llguidance.LLTokenizer:
    """The llguidance view of a fast Hugging Face tokenizer whose model has vocab_size logits."""
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(hf_tokenizer)
        if cached is None:
            try:
                cached = engine("llguidance.hf").from_tokenizer(
                    hf_tokenizer, n_vocab=vocab_size, eos_token=eos_id
                )
            except ValueError as exc:
                raise SpecdecodeError(f"constrained generation needs a fast tokenizer: {exc}") from exc
            _TOKENIZERS[hf_tokenizer] = cached
        return cached


def compile_constraint(spec: ConstraintSpec, tokenizer: llguidance.LLTokenizer) -> str:
    """The checked grammar of spec: a SpecdecodeError names what is wrong with it.

    Besides the engine's checks (which refuse unsatisfiable JSON schemas), the grammar must
    allow a first token: one whose language is empty (`root ::= root "a"`, a regex of an empty
    class) fails where its first mask is computed. One that matches the empty text allows
    end-of-generation there, and is kept."""
    what = f"invalid {spec.kind.replace('_', ' ')}"
    grammar = spec.grammar()
    llg = engine()
    error = llg.LLMatcher.validate_grammar(grammar, tokenizer, limits=parser_limits())
    if error and not error.startswith("WARNING"):
        raise SpecdecodeError(f"{what}: {one_line(error)}")
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    first = matcher.compute_bitmask()
    if matcher.is_error():
        error = matcher.get_error()
        # The engine's word for a start state from which no byte, and no end, can follow.
        empty = "NoExtensionBias" in error
        raise SpecdecodeError(f"{what}: {'no text matches it' if empty else one_line(error)}")
    error = _first_token_error(matcher, first)
    if error is not None:
        raise SpecdecodeError(
            f"{what}: the grammar engine's limits are exceeded at the first token ({error})"
        )
    return grammar


def _first_token_error(matcher: llguidance.LLMatcher, bitmask: bytes) -> str | None:
    """The engine's error on any allowed first token, tried one by one and rolled back: a rule
    with more alternatives than a parser row holds (a JSON schema's large anyOf, a Lark rule,
    which the GBNF check does not see) fails there, where generation would fail at its first
    step. Such a rule met later in the output is found only when reached."""
    allowed = np.flatnonzero(np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little"))
    for token in allowed[:PROBED_FIRST_TOKENS].tolist():
        consumed = matcher.try_consume_tokens([token])
        if matcher.is_error():
            return one_line(matcher.get_error().split("<state>")[0])
        if consumed:
            matcher.rollback(consumed)
    return None


# ---------------------------------------------------------------------- the isolated first check


class ChildCrashed(Exception):
    """The checking child died over a constraint; the message is the refusal to give."""


class _Checker:
    """The child process that runs first checks: started on first use, started again after it
    crashed or ran out of time. It keeps the tokenizers it was sent, by key. A fresh Python
    (not multiprocessing's spawn, which runs the parent's main module again) that imports
    this module alone: no torch, no copy of a threaded server's state."""

    def __init__(self, stack: int) -> None:
        """stack: the size of the stack of the child's checking thread."""
        ours, theirs = socket.socketpair()
        package = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(filter(None, [package, os.environ.get("PYTHONPATH")]))
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(theirs.fileno()), str(stack)],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": path},
            )
        self.conn = Connection(ours.detach())
        self.tokenizers: set[TokenizerKey] = set()  # those the child holds

    def check(self, kind: str, text: str, key: TokenizerKey, source: str) -> str | None:
        """The child's verdict (an error message, or None) over the tokenizer `source` (its
        JSON) stands for; ChildCrashed where the child died, a SpecdecodeError where it took
        longer than CHECK_SECONDS (it is then stopped)."""
        sent = None if key in self.tokenizers else source
        what = f"invalid {kind.replace('_', ' ')}: the grammar engine"
        try:
            self.conn.send((kind, text, key, sent))
            self.tokenizers.add(key)
            if not self.conn.poll(CHECK_SECONDS):
                self.stop()
                raise SpecdecodeError(f"{what} took over {CHECK_SECONDS:g} s to check it")
            return self.conn.recv()
        except (EOFError, OSError):
            self.stop()
            raise ChildCrashed(f"{what} crashed on it") from None

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and not self.conn.closed


CHILD = "import sys; from specdecode.grammars import serve_checks; serve_checks(*map(int, sys.argv[1:]))"


def serve_checks(fd: int, stack: int) -> None:
    """The child's loop, over the socket `fd`: compile each constraint it is sent on a thread
    with a stack of `stack` bytes, and answer its error message (None: it compiles)."""
    conn = Connection(fd)
    threading.stack_size(stack)
    tokenizers: dict[TokenizerKey, Any] = {}
    while True:
        try:
            kind, text, key, sent = conn.recv()
        except EOFError:
            return
        if sent is not None:
            _, vocab_size, eos_id = key
            tokenizers[key] = engine().LLTokenizer(sent, n_vocab=vocab_size, eos_token=eos_id)
        verdict: list[str | None] = [None]

        def run(kind: str = kind, text: str = text, key: TokenizerKey = key, verdict: list = verdict) -> None:
            try:
                compile_constraint(ConstraintSpec(kind, text), tokenizers[key])
            except SpecdecodeError as exc:
                verdict[0] = str(exc)
            except BaseException as exc:  # the engine's panics are BaseExceptions
                what = f"invalid {kind.replace('_', ' ')}"
                verdict[0] = f"{what}: the grammar engine failed on it ({exc!r:.200})"

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        conn.send(verdict[0])


_CHECKER: list[_Checker] = []  # the running child, if any
_CHECKER_LOCK = threading.Lock()  # one check at a time: the child runs one
_VERDICTS: OrderedDict[tuple[str, bytes, TokenizerKey], str | None] = OrderedDict()
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF tokenizer -> (number, its JSON)
_NUMBERS = itertools.count()


def check_isolated(spec: ConstraintSpec, hf_tokenizer, vocab_size: int, eos_id: int | None) -> None:
    """Check spec as `compile_constraint` does over this tokenizer, but in a child process
    (see the module's notes): a SpecdecodeError where it fails, crashes the engine or takes
    longer than CHECK_SECONDS. Verdicts are remembered, so a constraint seen before costs no
    child's time; the caller's own `compile_constraint` of an accepted one is then safe."""
    engine()  # the missing extra is named here
    check_cost(spec.kind, spec.text)
    if not getattr(hf_tokenizer, "is_fast", False):
        raise SpecdecodeError("constrained generation needs a fast tokenizer")
    with _CHECKER_LOCK:
        if hf_tokenizer not in _SOURCES:
            backend = copy(hf_tokenizer.backend_tokenizer)  # as llguidance.hf reads it
            backend.no_padding()
            backend.no_truncation()
            _SOURCES[hf_tokenizer] = (next(_NUMBERS), backend.to_str())
        number, source = _SOURCES[hf_tokenizer]
        key = (number, vocab_size, eos_id)
        digest = (spec.kind, hashlib.sha256(spec.text.encode("utf-8", "surrogatepass")).digest(), key)
        for attempt in range(2):  # a child found dead may have died of something else: twice
            if digest in _VERDICTS:
                break
            if not (_CHECKER and _CHECKER[0].alive):
                _CHECKER[:] = [_Checker(CHECK_STACK)]
            try:  # a time-out (a SpecdecodeError) may be the machine's load: not kept
                _VERDICTS[digest] = _CHECKER[0].check(spec.kind, spec.text, key, source)
            except ChildCrashed as exc:
                if attempt:
                    _VERDICTS[digest] = str(exc)
        _VERDICTS.move_to_end(digest)
        while len(_VERDICTS) > VERDICTS:
            _VERDICTS.popitem(last=False)
        verdict = _VERDICTS[digest]
    if verdict is not None:
        raise SpecdecodeError(verdict)
