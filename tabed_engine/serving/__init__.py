"""Serving: the command line, the OpenAI-compatible HTTP server and its protocol, metrics,
and incremental detokenization."""
