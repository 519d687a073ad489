"""The decode worker: continuous batching over KV received from prefill workers."""
