"""Performance models: cycle costs measured on this machine or predicted for a chip
(`costmodel`) and expected tokens per cycle and per second (`throughput`)."""
