"""The core runs with only the packages a bare GPU machine has (torch, transformers and its own
dependencies, safetensors, tokenizers, numpy): every other dependency is imported by the
feature that needs it, and a feature asked for without its package says what to install.

Each check runs in a fresh interpreter where the other packages cannot be imported, as if they
were not installed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from specdecode.defaults import bundled_eagle3, bundled_pair

# The project's other dependencies: its extras' and the dev tools the tests use.
BLOCKED = (
    *("rich", "matplotlib", "fastapi", "starlette", "uvicorn", "pydantic", "jinja2"),
    *("gguf", "accelerate", "llguidance", "llama_cpp", "jsonschema", "scipy", "httpx", "openai"),
)

# None in sys.modules is a package that is not installed, to `import` (ModuleNotFoundError) and
# to importlib.util.find_spec (None) alike: transformers probes its optional packages with the
# latter, and imports one only where it is found. (A meta-path finder that raises would break
# those probes, which a machine without the package passes.)
BLOCKER = f"""
import sys

BLOCKED = {BLOCKED!r}
sys.modules.update(dict.fromkeys(BLOCKED))


def loaded_blocked():
    return sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED and sys.modules[m] is not None)
"""


def run_without_extras(code: str) -> dict:
    """Run `code` where the blocked packages are missing; it prints one JSON object last."""
    script = BLOCKER + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def without_extras() -> dict:
    """One interpreter (the imports cost seconds) that generates with the bundled pair every way
    the core can, through the API and the command, then asks for features whose packages are
    missing; what it saw, as JSON."""
    if bundled_eagle3() is None:
        pytest.skip("needs the bundled pair and head")
    target, draft = bundled_pair()
    return run_without_extras(
        f"""
        import contextlib, io, json

        import specdecode, specdecode.api, specdecode.bench, specdecode.cli
        from specdecode import (
            ConstraintSpec, DraftModelConfig, GenerationConfig, LoadOptions, Pipeline, SamplingParams,
            SpecdecodeError,
        )

        def command(argv):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = specdecode.cli.main(argv)
            return status, out.getvalue(), err.getvalue()

        options = LoadOptions(threads=1, backend="native")
        pipe = Pipeline.load(
            {str(target)!r}, {str(draft)!r}, eagle3={str(bundled_eagle3())!r},
            target_options=options, draft_options=options,
        )
        greedy, config = SamplingParams(temperature=0), GenerationConfig(n_predict=8, ignore_eos=True)
        prompt = "def read_lines(path):\\n"
        cases = {{
            "plain": ([], DraftModelConfig()),
            "draft": (["draft"], DraftModelConfig()),
            "draft tree": (["draft"], DraftModelConfig(n_parallel=4)),
            "ngram": (["ngram-simple"], DraftModelConfig()),
            "eagle3": (["eagle3"], DraftModelConfig()),
            "eagle3 tree": (["eagle3"], DraftModelConfig(tree_tokens=8)),
        }}
        tokens = {{}}
        for name, (spec_types, drafting) in cases.items():
            run = Pipeline(
                pipe.target, pipe.draft, spec_types=spec_types, draft_config=drafting, eagle3=pipe.eagle3
            )
            tokens[name] = run.generate(prompt, greedy, config).tokens
        batch = Pipeline(pipe.target, pipe.draft, spec_types=["draft"]).generate_batch(
            [prompt, "import os"], greedy, config, load_rule=False
        )
        tokens["batch"] = batch[0].tokens
        # the command on transformers' forward (the API ran the native one)
        status, out, err = command(
            ["generate", "-p", prompt, "-n", "8", "--temp", "0", "-t", "1", "--backend", "hf",
             "--spec-policy", "classic", "--json"]
        )
        hf = json.loads(out)["tokens"] if status == 0 else err
        loaded = loaded_blocked()

        try:
            ConstraintSpec("regex", "[a-z]+").grammar()
            api_error = None
        except SpecdecodeError as exc:
            api_error = str(exc)
        errors = {{
            # an invalid port: were fastapi found, serve would stop there instead of serving
            argv[0]: command(argv)[::2]
            for argv in (["generate", "-p", "x", "-n", "2", "--regex", "[a-z]+"], ["serve", "--port", "-1"])
        }}
        print(json.dumps({{
            "tokens": tokens, "hf": hf, "loaded": loaded, "api_error": api_error, "errors": errors
        }}))
        """
    )


def test_the_core_imports_and_generates_without_the_optional_packages(without_extras):
    assert without_extras["loaded"] == []
    tokens = without_extras["tokens"]
    assert len(tokens["plain"]) == 8
    assert all(run == tokens["plain"] for run in tokens.values()), tokens
    assert isinstance(without_extras["hf"], list) and len(without_extras["hf"]) == 8, without_extras["hf"]


def test_a_feature_without_its_package_says_what_to_install(without_extras):
    grammar = (
        "constrained generation (a grammar, JSON schema or regex) needs the llguidance package: "
        "pip install 'specdecode[grammar]'"
    )
    assert without_extras["api_error"] == grammar
    assert without_extras["errors"]["generate"] == [2, f"error: {grammar}\n"]
    status, message = without_extras["errors"]["serve"]
    assert status == 2
    server = r"error: specdecode serve needs the \w+ package: pip install 'specdecode\[server\]'\n"
    assert re.fullmatch(server, message), message
