"""Benchmarks of fitdp against hand-written PyTorch loops; ``python -m bench`` runs them all."""
