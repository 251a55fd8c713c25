"""AdamW with parameter groups and the warmup + cosine / WSD learning-rate schedules."""
