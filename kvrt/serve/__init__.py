"""Serving many agents: the VRAM ledger, the model registry, the scheduler, the daemon and its clients."""
