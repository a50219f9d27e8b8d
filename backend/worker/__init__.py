"""Runs a scheduled step on the device: input batch, attention backends, model runner, sampler."""
