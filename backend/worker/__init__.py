"""Runs a scheduled step on the model: input batch, step wire, model runner, samplers, CUDA graphs."""
