"""Small data files shipped with pdserve (held-out text for perplexity checks)."""
