"""Benchmarks of the engine itself: offline throughput and per-phase latency (`twostep bench`)."""
