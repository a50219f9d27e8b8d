"""Benchmarks behind `pagedllm bench ...`."""
