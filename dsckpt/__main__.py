"""``python -m dsckpt``: the same CLI as the ``dsckpt`` command (for ``torchrun ... -m dsckpt``)."""

from .cli import main

main(prog_name="dsckpt")
