"""Running pagedllm inside a real tritonserver: launcher, backend installer, request codec, metrics."""
