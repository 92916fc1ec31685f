"""GGUF files kvrt ships or writes: the demo model's location and generated test models."""
