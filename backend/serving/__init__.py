"""Running pagedllm: the tritonserver launcher and backend installer, the Triton adapter (``triton/``), the OpenAI door (``openai/``)."""
