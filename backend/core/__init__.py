"""Paging core without torch: requests, the KV block pool, the scheduler and a step's bookkeeping."""
