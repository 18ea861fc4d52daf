"""The servers `specdecode bench-serve --http` compares, and its HTTP client: each system's
command line, a server child process on a free port (ready, its CPU time, stopped however the
run ends), llama-server's `POST /completion` as both servers answer it, and the closed loop of
clients. Apart from the measurement and its report (`compare.against_llama`)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specdecode.api import BESIDE_A_DRAFT
from specdecode.errors import SpecdecodeError

READY_SECONDS = 600.0  # a large file loads, repacks and warms up before /health answers 200


@dataclass(frozen=True)
class System:
    """One server: its name, whose it is, and the command that starts it on a port."""

    name: str
    side: str  # "ours" or "llama"
    speculative: bool
    command: tuple[str, ...]  # "{port}" stands for the port

    def argv(self, port: int) -> list[str]:
        return [part.replace("{port}", str(port)) for part in self.command]


def build_systems(
    target: Path, draft: Path | None, llama_server: Path, threads: int, slots: int, ctx: int
) -> list[System]:
    """Ours plain and speculative, llama-server plain and (with a draft) drafting: the same
    files, threads, slots and context per slot."""
    ours = [
        sys.executable, "-m", "specdecode.cli", "serve", "-m", str(target), "--port", "{port}",
        "--threads", str(threads), "-np", str(slots), "-c", str(ctx),
    ]  # fmt: skip
    spec = ["-md", str(draft)] if draft is not None else ["--spec-type", ",".join(BESIDE_A_DRAFT)]
    llama = [
        str(llama_server), "-m", str(target), "--port", "{port}", "-t", str(threads),
        "-np", str(slots), "-c", str(ctx * slots), "-cb", "--no-webui",
    ]  # fmt: skip
    systems = [
        System("ours", "ours", False, tuple(ours)),
        System("ours-spec", "ours", True, (*ours, *spec)),
        System("llama", "llama", False, tuple(llama)),
    ]
    if draft is not None:
        drafting = ("-md", str(draft), "--spec-type", "draft-simple", "-td", str(threads))
        systems.append(System("llama-draft", "llama", True, (*llama, *drafting)))
    return systems


def chosen(systems: list[System], names: str | None) -> list[System]:
    """The systems named (all without a list: each runs a server, and memory may not hold all)."""
    if names is None:
        return systems
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    known = [s.name for s in systems]
    for name in wanted:
        if name not in known:
            raise SpecdecodeError(f"unknown system {name!r} for --http (here: {', '.join(known)})")
    return [s for s in systems if s.name in wanted]


def counterpart(system: System, systems: list[System]) -> System | None:
    """The other server's system of the same kind: plain against plain, draft against draft."""
    for other in systems:
        if other.side != system.side and other.speculative == system.speculative:
            return other
    return None


def process_cpu_seconds(pid: int) -> float:
    """User + system seconds of a process and of its waited-for children, all threads, from
    /proc/PID/stat (fields 14-17, after the command name, which may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError as exc:
        raise SpecdecodeError(f"cannot read the CPU time of process {pid}: {exc}") from None
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server child process on a free port, its output in a log file; stopped on exit."""

    def __init__(self, system: System, log: Path) -> None:
        self.system = system
        self.port = free_port()
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                system.argv(self.port), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, seconds: float = READY_SECONDS) -> None:
        """Until /health answers 200 (llama-server answers 503 while it loads)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SpecdecodeError(
                    f"{self.system.name} exited with status {self.process.returncode} before it was ready:\n"
                    + self.tail()
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, _ = request(self.port, "GET", "/health", None, 5.0)
                if status == 200:
                    return
            time.sleep(0.2)
        raise SpecdecodeError(f"{self.system.name} was not ready after {seconds:.0f} s:\n" + self.tail())

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def running(systems: list[System], logs: Path) -> Iterator[list[Server]]:
    """Every system's server, started together and ready; all stopped however the block ends."""
    logs.mkdir(parents=True, exist_ok=True)
    servers: list[Server] = []
    try:
        for system in systems:
            servers.append(Server(system, logs / f"{system.name}.log"))
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


def request(port: int, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body)
        connection.request(method, path, payload, {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, {"error": data[:200].decode(errors="replace")}
    finally:
        connection.close()


def completion_body(prompt: str | list[int], n_predict: int, stream: bool = False) -> dict:
    """The same /completion request for both servers: greedy, fixed length, no prompt cache."""
    return {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": stream,
    }


@dataclass
class Answer:
    prompt: int  # index into the prompts
    tokens: list[int]
    seconds: float
    error: str | None = None


def complete(port: int, prompt_index: int, prompt: str, n_predict: int, timeout: float) -> Answer:
    began = time.perf_counter()
    try:
        status, data = request(port, "POST", "/completion", completion_body(prompt, n_predict), timeout)
    except (OSError, http.client.HTTPException) as exc:
        return Answer(prompt_index, [], time.perf_counter() - began, f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - began
    if status != 200:
        return Answer(prompt_index, [], seconds, f"HTTP {status}: {str(data.get('error'))[:120]}")
    return Answer(prompt_index, list(data.get("tokens") or []), seconds)


def closed_loop(
    port: int, prompts: list[str], order: list[int], concurrency: int, n_predict: int
) -> list[Answer]:
    """C clients, each sending the next prompt of `order` as soon as its last is answered."""
    todo: queue.Queue[int] = queue.Queue()
    for index in order:
        todo.put(index)
    answers: list[Answer] = []
    lock = threading.Lock()
    timeout = 60.0 + 10.0 * n_predict * len(order)  # a stalled server is an error, not a hang

    def client() -> None:
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            answer = complete(port, index, prompts[index], n_predict, timeout)
            with lock:
                answers.append(answer)

    workers = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return answers
