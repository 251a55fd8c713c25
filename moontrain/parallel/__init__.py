"""Parallelism: the (dp_replicate, ep) device mesh, FSDP2 for dense params, expert DP, global-norm clipping."""
