"""The GPU check runs end to end on a CPU (tiny shapes, --quick) where the packages a bare GPU
machine lacks cannot be imported: every section is written, without an error, to the JSON and
the Markdown. It runs once on a GPU, with no second try, so this is its rehearsal."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from specdecode.compare.gpu_baselines import (
    ASSISTED,
    COMPILED_LOOP,
    DYNAMIC_GENERATE,
    STATIC_GENERATE,
    CompiledLoop,
    strongest_baseline,
)
from specdecode.compare.gpu_check import goals
from specdecode.compare.gpu_models import Run, random_model
from specdecode.compare.gpu_report import Report
from specdecode.compare.gpu_roofline import bytes_per_token, datasheet_bandwidth, mean_context
from specdecode.compare.gpu_setup import ORACLE_SYSTEM, PLAIN_SYSTEM, QUICK, SECTIONS, SHAPES, VS_PLAIN

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
    # Rows reduced where the pass ran sample as the whole rows do, under every setting.
    assert len(exactness["reduction"]) == 4
    assert all(row["identical"] == row["rows"] > 0 for row in exactness["reduction"]), exactness["reduction"]
    drafted = {row["case"]: 0 for row in exactness["rows"]}
    for row in exactness["rows"]:
        drafted[row["case"]] += row["drafted"]
    assert set(drafted) == {"draft chain", "draft tree", "n-gram", "batch plain", "batch draft chain"}
    assert all(count > 0 for case, count in drafted.items() if case != "batch plain"), drafted
    speed = sections["speed"]
    rows = {row["system"]: row for row in speed["rows"]}
    baselines = (COMPILED_LOOP, STATIC_GENERATE, DYNAMIC_GENERATE)
    assert {PLAIN_SYSTEM, ORACLE_SYSTEM, ASSISTED, *baselines} <= set(rows)
    assert rows["ours batch of 4"]["tokens/s"] > 0 and "x strongest baseline" not in rows["ours batch of 4"]
    assert speed["bandwidth"][0]["MBU against"] == "measured copy"  # a CPU is in no datasheet table
    # Every plain figure: three repeats' median and range, TTFT apart, against the roofline.
    for system in (PLAIN_SYSTEM, *baselines):
        row = rows[system]
        assert row["repeats"] == 3 and re.fullmatch(r"\d+\.\d–\d+\.\d", row["decode tokens/s range"]), row
        for column in ("decode tokens/s", "TTFT ms", "ms/token", "GB/token", "roofline tokens/s", "MBU"):
            assert row[column] > 0, (system, column)
        assert row["x strongest baseline"] > 0
        assert system == PLAIN_SYSTEM or row[VS_PLAIN].startswith(("identical", "differs"))
    assert rows[COMPILED_LOOP]["note"] == "not compiled (cpu)"
    assert rows[COMPILED_LOOP]["compile + warm-up s"] >= 0
    oracle = rows[ORACLE_SYSTEM]
    assert oracle["accepted"] == 1.0 and oracle[VS_PLAIN] == "identical"
    assert oracle["ceiling x our plain"] > 1 and "x strongest baseline" not in oracle
    # The long prompt's first token: ours and the compiled loop's prompt pass, the same token.
    prefill = {row["system"]: row for row in sections["prefill"]["rows"]}
    assert set(prefill) == {PLAIN_SYSTEM, COMPILED_LOOP}
    for row in prefill.values():
        assert row["prompt tokens"] == QUICK.ttft_prompt and row["runs"] == 3 and row["TTFT ms"] > 0, row
    assert prefill[COMPILED_LOOP][VS_PLAIN] == "identical"
    statuses = {row["goal"]: row["status"] for row in sections["goals"]["rows"]}
    assert statuses["plain >= 1.1x the strongest baseline"] in ("met", "MISSED")
    assert statuses["a 17-row verify pass <= 1.1x a one-row pass"] in ("met", "MISSED")
    assert statuses["oracle ceiling >= 6x our plain"] in ("met", "MISSED")
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
    with report.section("exactness", budget=100.0):
        assert report.attempt("exactness", "past its share", int, "1", within=0.0) is None
        assert report.attempt("exactness", "within its share", int, "1", within=100.0) == 1
    with report.section("speed"):
        assert report.attempt("speed", "a failure", fail) is None
        assert report.attempt("speed", "the next part", int, "1") == 1
        raise ValueError("the rest of the entry")
    assert report.data["sections"]["passes"]["skipped"] == ["too late"]
    assert report.data["sections"]["exactness"]["skipped"] == ["past its share"]
    errors = [error["error"] for error in report.data["sections"]["speed"]["errors"]]
    assert errors == ["a failure: RuntimeError: out of memory", "speed: ValueError: the rest of the entry"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "skipped (time budget): too late" in markdown and "- ERROR a failure" in markdown
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report.data


def test_bytes_per_token_match_the_roofline_arithmetic():
    """128-token prompt and output, bfloat16: the weights once (a tied embedding read as the LM
    head), an embedding row and the KV cache at the mean context."""
    context = mean_context(128, 128)
    assert context == 192
    assert bytes_per_token(SHAPES["1b"], context) == pytest.approx(2.48e9, rel=0.01)
    assert bytes_per_token(SHAPES["8b"], context) == pytest.approx(15.04e9, rel=0.01)


@pytest.mark.parametrize(
    ("name", "terabytes"),
    [
        ("NVIDIA H200", 4.8),
        ("NVIDIA H100 80GB HBM3", 3.35),
        ("NVIDIA H100 PCIe", 2.0),
        ("NVIDIA A100-SXM4-80GB", 2.039),
        ("NVIDIA A100 80GB PCIe", 1.935),
        ("NVIDIA A100-PCIE-40GB", 1.555),
        ("NVIDIA L40S", 0.864),
        ("NVIDIA GeForce RTX 4090", 1.008),
        ("NVIDIA GH200 480GB", None),  # not an H200: the measured copy stands in
        ("none (cpu: x86_64)", None),
    ],
)
def test_the_datasheet_bandwidth_is_looked_up_by_the_device_name(name, terabytes):
    expected = None if terabytes is None else pytest.approx(terabytes * 1e12)
    assert datasheet_bandwidth(name) == expected


def speed_row(shape: str, system: str, rate: float, mode: str = "-", **extra) -> dict:
    return {"shape": shape, "mode": mode, "system": system, "decode tokens/s": rate, **extra}


def test_the_strongest_baseline_and_the_goals_read_against_it(tmp_path):
    big, small = SHAPES["8b"].label, SHAPES["1b"].label
    rows = [
        speed_row(big, DYNAMIC_GENERATE, 15.0),
        speed_row(big, STATIC_GENERATE, 150.0),
        speed_row(big, COMPILED_LOOP, 200.0),
        speed_row(big, PLAIN_SYSTEM, 230.0, "fixed", MBU=0.72, **{"roofline tokens/s": 319.0}),
        speed_row(big, ORACLE_SYSTEM, 1000.0, "fixed"),
        speed_row(small, DYNAMIC_GENERATE, 16.0),
        speed_row(small, PLAIN_SYSTEM, 400.0, "fixed", MBU=0.2, **{"roofline tokens/s": 1937.0}),
    ]
    report = Report(tmp_path, {"gpu": "none"}, {})
    report.data["sections"]["speed"] = {"seconds": 0.0, "errors": [], "skipped": [], "rows": rows}
    assert strongest_baseline(report.data, big)["system"] == COMPILED_LOOP
    assert "fallback" not in strongest_baseline(report.data, big)
    fallback = strongest_baseline(report.data, small)
    assert fallback["system"] == DYNAMIC_GENERATE and fallback["fallback"]
    assert strongest_baseline(report.data, "tiny") is None
    shapes = [SHAPES["8b"], SHAPES["1b"]]
    run = Run(report, torch.device("cpu"), QUICK, [], [], ["fixed"], shapes)
    with report.section("goals"):
        goals(run)
    found = {(row["shape"], row["goal"]): row for row in report.data["sections"]["goals"]["rows"]}
    plain_big = found[big, "plain >= 1.1x the strongest baseline"]
    assert plain_big["status"] == "met" and COMPILED_LOOP in plain_big["numbers"]
    assert found[big, "plain MBU >= 65% of the roofline"]["status"] == "met"
    assert found[big, "oracle ceiling >= 6x our plain"]["status"] == "MISSED"
    assert found[small, "plain MBU >= 40% of the roofline"]["status"] == "MISSED"
    assert "fallback" in found[small, "plain >= 1.1x the strongest baseline"]["numbers"]
    assert found[small, "oracle ceiling >= 6x our plain"]["status"] == "not measured"


def pass_row(shape: str, mode: str, rows: int, ms: float, call: str = "evaluate") -> dict:
    return {"shape": shape, "mode": mode, "call": call, "sequences": 1, "rows each": rows, "ms": ms}


def prefill_row(shape: str, mode: str, system: str, prompt: int, ms: float) -> dict:
    return {"shape": shape, "mode": mode, "system": system, "prompt tokens": prompt, "TTFT ms": ms, "runs": 3}


def test_the_verify_pass_batch_and_first_token_goals(tmp_path):
    """Met, missed and not measured, from hand-made tables: a 17-row pass against a one-row
    pass (one sequence's evaluate, not several sequences' passes), batch 32 against batch 8 on
    the 8B shape, and the 8B shape's time to the first token of a 4000-token prompt (a
    shorter prompt measures nothing)."""
    big, small = SHAPES["8b"].label, SHAPES["1b"].label
    passes = [
        pass_row(big, "fixed", 1, 8.69),
        pass_row(big, "fixed", 17, 9.3),
        pass_row(big, "fixed", 1, 0.5, call="evaluate_groups"),  # not a one-row verify pass
        pass_row(big, "bucketed", 1, 7.24),
        pass_row(big, "bucketed", 17, 9.82),
        pass_row(small, "fixed", 1, 2.84),
    ]
    batches = (("fixed", 8, 458.0), ("fixed", 32, 1000.0), ("bucketed", 8, 458.0), ("bucketed", 32, 359.0))
    batches += (("invariant", 8, 100.0),)  # no batch of 32
    speed = [
        {"shape": big, "mode": mode, "system": f"ours batch of {count}", "tokens/s": rate}
        for mode, count, rate in batches
    ]
    prefill = [
        prefill_row(big, "fixed", PLAIN_SYSTEM, 4000, 180.0),
        prefill_row(big, "bucketed", PLAIN_SYSTEM, 4000, 300.0),
        prefill_row(big, "invariant", PLAIN_SYSTEM, 256, 20.0),
        prefill_row(big, "-", COMPILED_LOOP, 4000, 150.0),
        prefill_row(small, "fixed", PLAIN_SYSTEM, 4000, 60.0),
    ]
    report = Report(tmp_path, {"gpu": "none"}, {})
    for name, rows in (("passes", passes), ("speed", speed), ("prefill", prefill)):
        report.data["sections"][name] = {"seconds": 0.0, "errors": [], "skipped": [], "rows": rows}
    run = Run(report, torch.device("cpu"), QUICK, [], [], ["fixed", "bucketed", "invariant"], [SHAPES["8b"]])
    with report.section("goals"):
        goals(run)
    found = {
        (row["shape"], row["mode"], row["goal"]): row for row in report.data["sections"]["goals"]["rows"]
    }
    verify = "a 17-row verify pass <= 1.1x a one-row pass"
    assert found[big, "fixed", verify]["status"] == "met"
    assert found[big, "fixed", verify]["numbers"] == "1.07x (9.30 vs 8.69 ms)"
    assert found[big, "bucketed", verify]["status"] == "MISSED"
    assert found[small, "fixed", verify]["status"] == "not measured"
    batch = "batch 32 >= 2x the tokens/s of batch 8"
    assert found[big, "fixed", batch]["status"] == "met"
    assert found[big, "fixed", batch]["numbers"] == "2.18x (1000.0 vs 458.0 tokens/s)"
    assert found[big, "bucketed", batch]["status"] == "MISSED"
    assert found[big, "invariant", batch]["status"] == "not measured"
    ttft = "time to the first token of a 4000-token prompt <= 0.25 s"
    assert found[big, "fixed", ttft]["status"] == "met"
    assert (
        found[big, "fixed", ttft]["numbers"]
        == "0.180 s (median of 3); compiled loop (gpt-fast style): 0.150 s"
    )
    assert found[big, "bucketed", ttft]["status"] == "MISSED"
    assert found[big, "invariant", ttft]["status"] == "not measured"
    assert found[big, "invariant", ttft]["numbers"] == "a 256-token prompt only"
    assert not [key for key in found if key[0] == small and key[2] in (batch, ttft)]  # goals of the 8B shape


def test_without_their_sections_the_new_goals_are_not_measured(tmp_path):
    report = Report(tmp_path, {"gpu": "none"}, {})
    run = Run(report, torch.device("cpu"), QUICK, [], [], ["fixed"], [SHAPES["8b"]])
    with report.section("goals"):
        goals(run)
    rows = report.data["sections"]["goals"]["rows"]
    new = [row for row in rows if row["goal"].startswith(("a 17-row", "batch 32", "time to the first"))]
    assert len(new) == 3 and {row["status"] for row in new} == {"not measured"}, new


def test_the_compiled_loop_decodes_as_transformers_generate():
    """Its static cache, positions and one-token step, uncompiled as on a CPU: the same greedy
    tokens as transformers' own generate on the same model."""

    class OnCpu:
        device = torch.device("cpu")

        def sync(self) -> None:
            """Nothing to wait for."""

    model = random_model(SHAPES["tiny"], torch.device("cpu"))
    prompt = list(range(2, 18))
    timing = CompiledLoop(model, len(prompt) + 16, None).generate(OnCpu(), prompt, 16)
    ids = torch.tensor([prompt])
    expected = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=1)
    assert timing.tokens == expected[0, len(prompt) :].tolist()
    assert timing.decode_rate > 0 and 0 < timing.first < timing.seconds
