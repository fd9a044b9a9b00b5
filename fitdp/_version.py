"""fitdp's version (its own module: anything may import it without importing fitdp)."""

# The package metadata reads it too (pyproject.toml: [tool.setuptools.dynamic]), so
# ``importlib.metadata.version("fitdp")`` and ``fitdp.__version__`` cannot disagree.
__version__ = "0.3.0"
