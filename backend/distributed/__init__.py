"""The tensor-parallel process group and the sharding rules the model, the loader and the planner share."""
