"""KV state off the context: host pools, snapshots and their stores, the snapshot prefix cache, context pools."""
