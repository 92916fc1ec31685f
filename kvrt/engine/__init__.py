"""The engine: llama.cpp models and contexts, batches, sampling, chat templates, the one decode step and the
loop that generates one sequence (continuous batching is :mod:`kvrt.runtime`, above it)."""
