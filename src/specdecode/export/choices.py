"""The engines `specdecode export` writes for and the dtypes `specdecode convert` writes: the
choices the flags offer and the commands check, apart from both so that the flags (which build
the command line) import nothing heavy and no command."""

ENGINES = ("vllm", "sglang", "llama.cpp")
CONVERT_DTYPES = ("float32", "bfloat16", "float16")  # the first is the default
