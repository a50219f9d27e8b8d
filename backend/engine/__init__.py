"""The engine: requests in, one scheduled iteration per step, outputs out; the loop thread that drives it."""
