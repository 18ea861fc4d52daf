"""Heads and drafts for the serving engines: vLLM, SGLang, llama.cpp's llama-server.

vLLM reads an EAGLE-3 head in the `speculators` layout (`vllm serve HEAD_DIR` starts the
verifier named in it and the head together) or through `--speculative-config`; SGLang reads
the original layout with launch flags; llama-server reads GGUF files (see `export.gguf`). A
draft model is a Hugging Face directory already: every engine takes it as it is, so only its
command lines are written. The layer ids written are inputs of target layers, the reading of
vLLM and llama.cpp; SGLang reads them the same way unless the first id is 1, which training
here refuses (see `strategies.eagle3_layouts`). A DFlash drafter goes to both engines in z-lab's
layout (`strategies.dflash_checkpoint`, ids as outputs of layers), which vLLM
(`"method": "dflash"`) and SGLang (`--speculative-algorithm DFLASH`) read as z-lab publishes it.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from specdecode.strategies.eagle3_checkpoint import WEIGHTS, head_tensors, save_head
from specdecode.strategies.eagle3_head import Eagle3Head
from specdecode.strategies.eagle3_layouts import speculators_tensors

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config classes validate this layout


def transformer_layer_config(head: Eagle3Head) -> dict:
    """The decoder layer's Llama config as speculators nests it (its vocab_size is the target's)."""
    c = head.config
    layer = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.dim,
        hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=False,
    )
    return layer.to_diff_dict()


def speculators_config(head: Eagle3Head, verifier: str, architectures: list[str], tokens: int) -> dict:
    """config.json of the speculators layout, for a head over `verifier` proposing `tokens` tokens."""
    c = head.config
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": architectures},
        },
        "transformer_layer_config": transformer_layer_config(head),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.target_layer_ids),
        "norm_before_residual": False,
        "torch_dtype": "bfloat16",
    }


def write_speculators(
    head: Eagle3Head, directory: Path, verifier: str, architectures: list[str], tokens: int
) -> Path:
    """The head as vLLM's speculators directory (bfloat16 weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = speculators_tensors(head_tensors(head, torch.bfloat16))
    save_file(tensors, directory / WEIGHTS, metadata={"format": "pt"})
    config = speculators_config(head, verifier, architectures, tokens)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def write_sglang(head: Eagle3Head, directory: Path) -> Path:
    """The head in the original layout SGLang (and SpecForge, TensorRT-LLM) read."""
    return save_head(head, directory)


@dataclass(frozen=True)
class Served:
    """The command line that serves a target with a drafter in one engine."""

    engine: str
    drafter: str  # "eagle3", "dflash" or "draft"
    command: list[str]

    def line(self) -> str:
        return shlex.join(self.command)


def vllm_speculative_config(method: str, model: Path, tokens: int) -> dict:
    return {"method": method, "model": str(model), "num_speculative_tokens": tokens}


def vllm_commands(target: Path, drafter: str, model: Path, tokens: int, out: Path) -> list[Served]:
    """`vllm serve` lines: with --speculative-config (written beside them), and for a
    speculators directory the one-argument form that reads the verifier from it."""
    method = drafter if drafter in ("eagle3", "dflash") else "draft_model"
    spec = vllm_speculative_config(method, model, tokens)
    path = out / f"speculative-config-{drafter}.json"
    path.write_text(json.dumps(spec, indent=2) + "\n")
    served = [
        Served("vllm", drafter, ["vllm", "serve", str(target), "--speculative-config", json.dumps(spec)])
    ]
    if drafter == "eagle3":
        served.append(Served("vllm", drafter, ["vllm", "serve", str(model)]))
    return served


def sglang_command(target: Path, drafter: str, model: Path, tokens: int) -> Served:
    """A DFlash block is the last token and the drafted ones: SGLang verifies tokens + 1 rows."""
    if drafter == "dflash":
        command = [
            *("python", "-m", "sglang.launch_server", "--model-path", str(target)),
            *("--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(model)),
            *("--speculative-num-draft-tokens", str(tokens + 1)),
        ]
        return Served("sglang", drafter, command)
    algorithm = "EAGLE3" if drafter == "eagle3" else "STANDALONE"
    command = [
        *("python", "-m", "sglang.launch_server", "--model-path", str(target)),
        *("--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(model)),
        *("--speculative-num-steps", str(tokens), "--speculative-eagle-topk", "1"),
        *("--speculative-num-draft-tokens", str(tokens + 1)),
    ]
    return Served("sglang", drafter, command)


def llama_server_command(target_gguf: Path, drafter: str, drafter_gguf: Path, tokens: int) -> Served:
    spec_type = {"eagle3": "draft-eagle3", "dflash": "draft-dflash"}.get(drafter, "draft-simple")
    command = [
        *("llama-server", "-m", str(target_gguf), "-md", str(drafter_gguf)),
        *("--spec-type", spec_type, "--spec-draft-n-max", str(tokens)),
    ]
    return Served("llama.cpp", drafter, command)
