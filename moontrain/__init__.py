"""moontrain: a trainer for Kimi-K3-like MoE models with expert parallelism at its core."""
