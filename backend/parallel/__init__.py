"""Tensor parallelism: the sharding rules, the process group, and the worker ranks that join it."""
