"""KV state off the context: host pools, snapshots and their stores, the prefix cache, context pools."""
