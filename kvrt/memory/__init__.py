"""Elastic KV memory: CUDA VMM pages mapped as tokens arrive, and contexts that grow on demand."""
