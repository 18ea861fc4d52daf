"""Handing models over to the serving engines: vLLM, SGLang (`engines`) and llama.cpp (`gguf`)."""
