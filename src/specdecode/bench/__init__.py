"""Benchmarks: `specdecode bench` (every strategy against plain generation and Hugging Face's
`generate`, on Spec-Bench-style tasks) and `specdecode bench-draft` (the drafting time of the
model-free strategies at long histories)."""
