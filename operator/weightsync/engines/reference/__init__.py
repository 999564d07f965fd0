"""The reference engine: a small real Llama-shaped inference server for tests and demos."""
