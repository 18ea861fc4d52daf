"""The GPU check runs end to end on a CPU (tiny shapes, --quick) where the packages a bare GPU
machine lacks cannot be imported: every section is written, without an error, to the JSON and
the Markdown. It runs once on a GPU, with no second try, so this is its rehearsal."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from specdecode.compare.gpu_report import Report
from specdecode.compare.gpu_setup import ORACLE_SYSTEM, SECTIONS

# What a GPU machine's system packages lack: the project's optional dependencies and dev tools
# (torch, transformers with its own dependencies, safetensors, tokenizers and numpy are there).
NOT_THERE = (
    "accelerate",
    "fastapi",
    "gguf",
    "httpx",
    "jinja2",
    "jsonschema",
    "llama_cpp",
    "llguidance",
    "matplotlib",
    "openai",
    "pydantic",
    "rich",
    "scipy",
    "starlette",
    "uvicorn",
)

# A None in sys.modules makes a package look absent: its import fails, and find_spec (which
# transformers asks about optional packages) answers None.
RUN = """
import sys

sys.modules.update(dict.fromkeys({not_there!r}))

from specdecode.compare.gpu_check import main

sys.exit(main({argv!r}))
"""


@pytest.mark.slow
def test_a_quick_cpu_run_writes_every_section(tmp_path):
    argv = ["--out", str(tmp_path), "--device", "cpu", "--quick"]
    script = textwrap.dedent(RUN.format(not_there=NOT_THERE, argv=argv))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert (tmp_path / "gpu_check.json").exists(), done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = data["sections"]
    errors = [error["error"] for section in sections.values() for error in section["errors"]]
    assert done.returncode == 0 and not errors, (errors, done.stdout[-3000:], done.stderr[-3000:])
    assert set(SECTIONS) <= set(sections)
    for name in SECTIONS:
        assert sections[name]["rows"], name
        assert sections[name]["seconds"] >= 0
    # On a CPU every pass is row-invariant: every output equals plain generation's.
    exactness = sections["exactness"]
    assert {row["verdict"] for row in exactness["rows"]} == {"exact"}, exactness["rows"]
    assert all(
        value == 0.0 for row in exactness["rounding"] for value in row.values() if isinstance(value, float)
    )
    drafted = {row["case"]: 0 for row in exactness["rows"]}
    for row in exactness["rows"]:
        drafted[row["case"]] += row["drafted"]
    assert set(drafted) == {"draft chain", "draft tree", "n-gram", "batch plain", "batch draft chain"}
    assert all(count > 0 for case, count in drafted.items() if case != "batch plain"), drafted
    systems = {row["system"] for row in sections["speed"]["rows"]}
    assert {"transformers generate", "ours plain", ORACLE_SYSTEM, "ours batch of 4"} <= systems
    oracle = next(row for row in sections["speed"]["rows"] if row["system"] == ORACLE_SYSTEM)
    assert oracle["accepted"] == 1.0 and oracle["vs plain's output"] == "identical"
    assert {row["status"] for row in sections["goals"]["rows"]} <= {"met", "MISSED", "not measured"}
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| torch |" in markdown and "## goals" in markdown
    assert "[gpu-check" in done.stdout  # progress lines


def test_a_failing_part_is_recorded_and_a_spent_budget_skips_the_rest(tmp_path):
    report = Report(tmp_path, {"gpu": "none"}, {})

    def fail() -> None:
        raise RuntimeError("out of memory")

    with report.section("passes", budget=0.0):
        assert report.attempt("passes", "too late", int, "1") is None
    with report.section("speed"):
        assert report.attempt("speed", "a failure", fail) is None
        assert report.attempt("speed", "the next part", int, "1") == 1
        raise ValueError("the rest of the entry")
    assert report.data["sections"]["passes"]["skipped"] == ["too late"]
    errors = [error["error"] for error in report.data["sections"]["speed"]["errors"]]
    assert errors == ["a failure: RuntimeError: out of memory", "speed: ValueError: the rest of the entry"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "skipped (time budget): too late" in markdown and "- ERROR a failure" in markdown
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report.data
