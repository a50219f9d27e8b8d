"""Capacity planning: how many GPUs of which kind, with what max_model_len, for a model and its traffic.

Static answers come from KV block math (``kv_math``); dynamic ones from replaying
the workload through the engine's own Scheduler and KVCacheManager on the null
model (``replay``), with a roofline step-time model as the clock (``step_time``).
``pagedllm plan`` (``planning.cli``) puts them together.
"""
