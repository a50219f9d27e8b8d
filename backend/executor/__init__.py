"""Runs the model: in this process, or across a tensor-parallel group of worker processes."""
