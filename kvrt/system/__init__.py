"""What the machine can do: the CPU kernels llama.cpp may safely use and the GPUs it sees."""
