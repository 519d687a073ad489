"""The prefill worker: chunked, layer-wise prefill with KV streamed to decode workers."""
