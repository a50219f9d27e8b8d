"""OpenAI-compatible HTTP front door (FastAPI + uvicorn) that forwards every request to tritonserver over gRPC.

``protocol`` (request bodies), ``triton_bridge`` (the gRPC streaming client),
``responses`` (response and chunk bodies), ``served_models`` (names, tokenizers, chat
templates), ``app`` (the routes) and ``http_server`` (uvicorn on a thread, for ``pagedllm serve``).
Needs the ``openai`` extra: ``pip install pagedllm[openai]``.
"""
