"""Dry-run planning: a per-rank memory estimate and step time (parameter counts: moontrain.model.params)."""
