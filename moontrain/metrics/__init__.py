"""Step metrics: expert balance (maxvio) and the console / jsonl progress log."""
