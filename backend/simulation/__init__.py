"""What both the planner and the benchmarks replay: the engine without its model, and the workloads it runs."""
