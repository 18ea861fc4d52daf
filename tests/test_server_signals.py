"""`specdecode serve` stopped by SIGINT or SIGTERM: a real server process, which drains alike
for both signals and then ends by the signal (a shell shows 130 or 143)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import TargetSpec, cached_tokenizer, target_model

import specdecode
from specdecode.testing import save_model

LONG = TargetSpec(seed=5, max_positions=8192)  # room for a generation that outlasts the test's signals


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("signals") / "target", target_model(LONG), cached_tokenizer())


def start(target: Path, grace: float) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(Path(specdecode.__file__).parents[1])}
    command = [sys.executable, "-m", "specdecode.cli", "serve", "-m", str(target), "--port", "0", "-t", "1"]
    process = subprocess.Popen(
        [*command, "--shutdown-grace", str(grace), "--max-tokens-limit", "8000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = process.stdout.readline()
    assert line.startswith("specdecode serve: listening on"), process.stderr.read()
    return process, line.split()[4]


def long_request(base: str, replies: list[httpx.Response]) -> threading.Thread:
    """A /completion that runs for many seconds, answered into `replies`."""
    body = {"prompt": "def f(x):", "n_predict": 8000, "ignore_eos": True, "temperature": 0}

    def send() -> None:
        replies.append(httpx.post(f"{base}/completion", json=body, timeout=120))

    thread = threading.Thread(target=send)
    thread.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{base}/health").json()["slots_processing"] != 1:
        assert time.monotonic() < deadline, "the request did not start"
        time.sleep(0.02)
    return thread


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_either_signal_drains_for_the_grace_then_ends_the_process_by_it(saved_target, sig):
    process, base = start(saved_target, grace=1.0)
    replies: list[httpx.Response] = []
    thread = long_request(base, replies)
    sent = time.monotonic()
    process.send_signal(sig)
    status = process.wait(30)
    took = time.monotonic() - sent
    thread.join(30)
    assert status == -sig  # killed by the signal: the shell's 128 + signal
    assert 1.0 <= took < 20, took  # the grace, the cut step and the exit, on a busy machine
    assert replies[0].status_code == 503 and replies[0].json()["error"]["code"] == "shutting_down"
    assert "Traceback" not in process.stderr.read()


def test_a_second_signal_cuts_the_drain_at_once(saved_target):
    process, base = start(saved_target, grace=600)
    replies: list[httpx.Response] = []
    thread = long_request(base, replies)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    status = process.wait(30)
    took = time.monotonic() - sent
    thread.join(30)
    assert status == -signal.SIGTERM  # the first signal decides how the process ends
    assert took < 20, took  # not the 600 s grace
    assert replies[0].status_code == 503
    assert "Traceback" not in process.stderr.read()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_right_after_the_banner_stops_the_server_alike(saved_target, sig):
    """The banner says the server is up: a signal sent at once (before uvicorn's own handlers)
    is handled as later ones are, not as Python's KeyboardInterrupt."""
    process, _ = start(saved_target, grace=1.0)
    process.send_signal(sig)
    assert process.wait(30) == -sig
    assert "Traceback" not in process.stderr.read()
