"""The package version, in a module of its own so that modules needing it never import the package itself."""

__version__ = "0.1.0"
