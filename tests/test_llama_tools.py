"""The side-by-side benchmark with llama.cpp's own programs (`specdecode.bench.llama_tools`).

- What it reads from the programs' output: llama.cpp's own line formats, the generated text.
- Without the programs (`make llama-tools`) it says how to build them; with them, a short run
  on the tests' GGUF files gives both sides' figures and our speculative output equals plain.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specdecode.bench import llama_tools
from specdecode.errors import SpecdecodeError

pytest.importorskip("llama_cpp")

SPECULATIVE_SIMPLE_TAIL = """\
0.00.516.174 I encoded   12 tokens in    0.016 seconds, speed:  751.974 t/s
0.00.516.195 I decoded   65 tokens in    0.371 seconds, speed:  174.976 t/s
0.00.516.205 I
0.00.516.215 I n_draft   = 16
0.00.516.224 I n_predict = 65
0.00.516.234 I n_drafted = 31
0.00.516.244 I n_accept  = 26
0.00.516.254 I accept    = 83.871%
"""
COMPLETION_TAIL = """\
0.00.371.162 I common_perf_print:    sampling time =       3.69 ms
0.00.371.173 I common_perf_print: prompt eval time =      15.60 ms /    12 tokens (    1.30 ms per token)
0.00.371.174 I common_perf_print:        eval time =     292.58 ms /   127 runs   (    2.30 ms per token)
"""


def test_it_reads_llama_cpps_lines():
    decoded = llama_tools.DECODED.search(SPECULATIVE_SIMPLE_TAIL)
    assert (decoded[1], decoded[2]) == ("65", "0.371")
    assert llama_tools.DRAFTED.search(SPECULATIVE_SIMPLE_TAIL)[1] == "31"
    assert llama_tools.ACCEPTED.search(SPECULATIVE_SIMPLE_TAIL)[1] == "26"
    evaluated = llama_tools.EVAL.search(COMPLETION_TAIL)  # not the prompt's line
    assert (evaluated[1], evaluated[2]) == ("292.58", "127")
    assert llama_tools.SAMPLING.search(COMPLETION_TAIL)[1] == "3.69"


def test_it_compares_texts_up_to_llama_cpps_extra_token():
    stdout = "\n\n<|bos|>def f(x):\n    return x + 1\n\n\n"
    theirs = llama_tools.generated_text(stdout, "def f(x):")
    assert theirs.startswith("\n    return x + 1")
    assert llama_tools.same_text("\n    return x", theirs)
    assert not llama_tools.same_text("\n    return y", theirs)
    assert llama_tools.generated_text(stdout, "absent") == ""


def test_without_the_programs_it_says_how_to_build_them(tmp_path):
    with pytest.raises(SpecdecodeError, match="make llama-tools"):
        llama_tools.run_tool(tmp_path, "llama-lookup", [], llama_tools.DECODED)


TOOLS = llama_tools.DEFAULT_TOOLS
needs_tools = pytest.mark.skipif(
    not (TOOLS / "llama-speculative-simple").exists(),
    reason="llama.cpp's programs not built (make llama-tools)",
)


@needs_tools
def test_a_short_side_by_side_run(gguf_files, tmp_path):
    folder = tmp_path / "pair"
    (folder / "llama.cpp").mkdir(parents=True)
    for role in ("target", "draft"):
        (folder / "llama.cpp" / f"{role}.gguf").symlink_to(Path(gguf_files[f"{role}-q8_0.gguf"]))
    systems = tuple(s for s in llama_tools.SYSTEMS if s.name in ("plain", "draft"))
    results, invariant = llama_tools.measure_pair(folder, ["def wrap(text):"], 16, 1, TOOLS, systems)
    assert invariant  # Q8_0
    for side in ("ours", "llama.cpp"):
        assert results.rate("draft", side) > 0 and results.rate("plain", side) > 0
    assert results.same_as_plain["draft"] == [True]
