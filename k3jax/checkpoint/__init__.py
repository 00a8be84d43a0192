"""Checkpoint I/O: Hugging Face safetensors names <-> the k3jax parameter tree."""
