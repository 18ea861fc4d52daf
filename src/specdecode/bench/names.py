"""The benchmarks' task and system names: what `bench --tasks` and `bench-constrained --systems`
offer and default to. Light (no torch), so that the flags (`bench.flags`) and the benchmarks
(`bench.tasks`, `bench.command`) both read them from here."""

from __future__ import annotations

TASK_NAMES = ("completion", "editing", "extraction", "free", "free-t1")
# Run only when asked (--tasks): sessions of several turns, and user messages for --chat.
AGENT_TASKS = ("agent-edit", "agent-records")
CHAT_TASKS = ("chat-edit", "chat-complete", "chat-summarise", "chat-qa", "chat-free")
ALL_TASKS = TASK_NAMES + AGENT_TASKS + CHAT_TASKS
CONSTRAINED_SYSTEMS = ("plain", "forced", "ngram-simple,ngram-mod", "draft", "ngram-simple,ngram-mod,draft")
