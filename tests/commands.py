"""Every dsckpt command, as the reliability, input-unchanged and fuzz tests run it.

Adding a command (``verify``, ``diff`` ...) to those tests is one line in :data:`COMMANDS`.
``argv(fixture_dir, ckpt, out)``: ``fixture_dir`` is a copy of ``tests/fixtures/<name>`` (so
``source_fp32.safetensors`` is at hand), ``ckpt`` the checkpoint (or file) under test, ``out`` an
empty folder for outputs. ``output(out)`` is the path the command writes (None: read-only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Command:
    name: str
    argv: Callable[[Path, Path, Path], list[str]]
    output: Callable[[Path], Path] | None = None
    #: what it accepts as CKPT: "deepspeed" folders, "safetensors" files/folders, or both
    accepts: tuple[str, ...] = ("deepspeed",)

    @property
    def writes(self) -> bool:
        return self.output is not None


def _source(fx_dir: Path) -> str:
    src = fx_dir / "source_fp32.safetensors"
    return str(src) if src.exists() else "master"


COMMANDS: tuple[Command, ...] = (
    Command("info", lambda fx, c, o: ["info", str(c)]),
    Command("info-json", lambda fx, c, o: ["info", "--json", "--tensors", str(c)]),
    Command("to-fp32", lambda fx, c, o: ["to-fp32", "-q", str(c), str(o / "model.safetensors")],
            lambda o: o / "model.safetensors"),
    Command("to-fp32-sharded", lambda fx, c, o: ["to-fp32", "-q", "--max-shard-size", "500B", str(c), str(o / "shards")],
            lambda o: o / "shards"),
    Command("to-fp32-torch", lambda fx, c, o: ["to-fp32", "-q", str(c), str(o / "model.pt")], lambda o: o / "model.pt"),
    Command("to-fp32-lightning", lambda fx, c, o: ["to-fp32", "-q", str(c), str(o / "model.ckpt")],
            lambda o: o / "model.ckpt"),
    Command("scan", lambda fx, c, o: ["scan", "-q", str(c)], accepts=("deepspeed", "safetensors")),
    Command("repair", lambda fx, c, o: ["repair", "-q", str(c), str(o / "fixed"), "--from", _source(fx),
                                        "--policy", "reset-bn-stats"],
            lambda o: o / "fixed"),
    Command("repair-safetensors", lambda fx, c, o: ["repair", "-q", str(c), str(o / "fixed.safetensors"),
                                                    "--from", _source(fx), "--policy", "reset-bn-stats"],
            lambda o: o / "fixed.safetensors", accepts=("safetensors",)),
    Command("reshard", lambda fx, c, o: ["reshard", "-q", str(c), str(o / "resharded"), "-n", "3"],
            lambda o: o / "resharded"),
    Command("verify", lambda fx, c, o: ["verify", "--json", str(c)]),
    Command("diff", lambda fx, c, o: ["diff", "--json", str(c), str(c)], accepts=("deepspeed", "safetensors")),
)

WRITING = tuple(c for c in COMMANDS if c.writes)


def by_name(name: str) -> Command:
    return next(c for c in COMMANDS if c.name == name)
