"""The package version, in a module of its own so that modules needing it never import the package itself.

One source: ``version`` in pyproject.toml, which an install (``pip install``, ``pip install -e``) writes into the
package's metadata, read here with :mod:`importlib.metadata`. An editable install keeps the metadata of the last
``pip install -e .``: after a version change, install again. Read on first use (``dsckpt --version``, an export's
``dsckpt_version`` metadata), so that start-up does not pay for it.
"""

from __future__ import annotations

import functools

__all__ = ["package_version"]

#: What a source tree on ``sys.path`` with no install of dsckpt reports (a PEP 440 local version, never a release).
NOT_INSTALLED = "0+unknown"


@functools.cache
def package_version() -> str:
    """dsckpt's version as installed (the ``version`` of pyproject.toml), else :data:`NOT_INSTALLED`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dsckpt")
    except PackageNotFoundError:
        return NOT_INSTALLED
