"""fitdp's version (its own module: anything may import it without importing fitdp)."""

__version__ = "0.2.0"
