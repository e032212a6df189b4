"""Benchmarks of the loragate engine: seeded workloads and throughput comparisons."""
