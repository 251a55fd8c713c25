"""Dry-run planning: parameter counts from a meta-device model and a per-rank memory estimate."""
