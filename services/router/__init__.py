"""The router: OpenAI-compatible HTTP API, tokenization, SSE streaming (see docs/api.md)."""
