"""The engine: llama.cpp models and contexts, batches, sampling, chat templates and the decode loops."""
