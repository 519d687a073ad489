"""The colocated worker: chunked prefill and decode in the same steps on one engine."""
