"""``pdserve bench``: a load generator for OpenAI-compatible endpoints (see :mod:`.serve`)."""
