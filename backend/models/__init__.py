"""Native model implementations and checkpoint loading."""
