"""Builders for tests and benchmarks: tiny checkpoints, a locally trained tokenizer, random paged batches."""
