"""Token sources: a synthetic Markov chain, and packed documents from local files via HF datasets."""
