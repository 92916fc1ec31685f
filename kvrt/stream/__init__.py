"""Layer streaming: weights staged from a pinned host pool into two device slots, overlapped with compute."""
