"""Memory accounting: the VRAM ledger, memory estimates read from the model, the budget a daemon admits against."""
