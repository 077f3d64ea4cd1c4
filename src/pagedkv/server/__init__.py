"""The OpenAI-compatible HTTP server (``pagedkv serve``)."""
