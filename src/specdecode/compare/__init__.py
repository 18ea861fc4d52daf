"""Measurements of specdecode beside other programs: llama.cpp's own tools and server, its C API
loop, and the GPU check with its baselines. It sits above `bench` and may use its tasks and
machine block; `bench` (what a user runs) imports nothing from here."""
