"""Token sources (an in-memory synthetic source here; datasets and checkpoints come with issue 6)."""
