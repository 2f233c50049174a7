"""The ``dsckpt`` command line: validate, call the library, render. Exit codes live here.

0 ok / clean · 1 findings (non-finite values; ``--dry-run`` has work) · 2 usage error ·
3 unreadable, unsupported, corrupt or unsafe checkpoint · 70 internal error (please report).

Importing this module must stay cheap: torch is imported only inside commands.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from . import __version__
from .errors import EXIT_INTERNAL, DsckptError

__all__ = ["main"]


def _fail(message: str, code: int) -> None:
    click.echo(f"dsckpt: error: {message}", err=True)
    sys.exit(code)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn library errors into one line on stderr and a documented exit code; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DsckptError as e:
            _fail(str(e).replace("\n", " "), e.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted; no output was left behind", 130)
        except MemoryError:
            _fail("out of memory", EXIT_INTERNAL)
        except Exception as e:  # noqa: BLE001 - the CLI's last line of defence
            if os.environ.get("DSCKPT_DEBUG"):
                raise
            _fail(f"internal error ({type(e).__name__}: {e}). This is a dsckpt bug: please report it "
                  "with the command you ran; rerun with DSCKPT_DEBUG=1 for a traceback", EXIT_INTERNAL)

    return wrapper


@contextmanager
def _progress(total: int, label: str, enabled: bool) -> Iterator[Callable[[Any], None]]:
    if not enabled or not sys.stderr.isatty():
        yield lambda _spec: None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield lambda spec: bar.update(getattr(spec, "nbytes", 1))


tag_option = click.option("--tag", default=None, help="Tag folder to read (default: the one named in 'latest').")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dsckpt")
def main() -> None:
    """Get DeepSpeed checkpoints out of trouble: inspect, consolidate to fp32, scan, repair, reshard.

    CKPT is a DeepSpeed save dir (holding 'latest') or a tag folder such as 'global_step100'.
    Exit codes: 0 ok, 1 findings, 2 usage error, 3 unreadable/unsupported/corrupt/unsafe checkpoint,
    70 internal error.
    """


@main.command()
@click.argument("ckpt", type=click.Path(file_okay=False, path_type=str))
@tag_option
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--tensors", "show_tensors", is_flag=True, help="List every tensor.")
@handle_errors
def info(ckpt: str, tag: str | None, as_json: bool, show_tensors: bool) -> None:
    """Describe a checkpoint: stage, dtype, world sizes, params, files, health."""
    from .checkpoint import open_checkpoint
    from .info import summarize

    c = open_checkpoint(ckpt, tag=tag)
    s = summarize(c.logical, c.cache)
    if as_json:
        click.echo(json.dumps(s, indent=2))
    else:
        click.echo(_render_info(s, show_tensors))
    if not s["health"]["ok"]:
        sys.exit(3)


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{nbytes} B"


def _render_info(s: dict[str, Any], show_tensors: bool) -> str:
    p = s["params"]
    lines = [
        f"checkpoint   {s['path']}",
        f"tag          {s['tag']}" + (f"   (available: {', '.join(s['tags'])})" if len(s["tags"]) > 1 else ""),
        f"layout       ZeRO stage {s['zero_stage']} ({s['layout']}), {s['precision']}, optimizer wrapper {s['optimizer_wrapper']}",
        f"parallelism  data {s['dp_world_size']}, pipeline {s['pp_world_size']}, tensor {s['tp_world_size']}",
        f"deepspeed    {s['deepspeed_version'] or 'unknown'}",
        f"progress     global step {s['global_steps']}, samples {s['global_samples']}, optimizer step {s['optimizer_step']}",
        f"params       {p['count']} tensors, {p['numel_total']:,} elements "
        f"({p['numel_trainable']:,} trainable, {p['numel_frozen']:,} frozen)",
    ]
    if s["tied"]:
        lines.append("tied         " + "; ".join(" = ".join(g) for g in s["tied"]))
    if s["buffers"]:
        lines.append("buffers      " + ", ".join(f"{b['name']} ({b['dtype']})" for b in s["buffers"]))
    lines.append(f"files        {len(s['files'])} files, {_human(s['total_nbytes'])}")
    for f in s["files"]:
        lines.append(f"               {f['name']}  {_human(f['nbytes'])}")
    health = s["health"]
    lines.append("health       ok: complete set of rank files, shapes consistent" if health["ok"]
                 else f"health       {len(health['problems'])} problem(s):")
    lines += [f"               {msg}" for msg in health["problems"]]
    if show_tensors:
        lines.append("tensors")
        for t in s["tensors"]:
            flags = [t["kind"] if t["kind"] != "param" else ("trainable" if t["trainable"] else "frozen")]
            if t["tied_to"]:
                flags.append(f"tied to {t['tied_to']}")
            lines.append(f"  {t['name']:40s} {t['dtype']:9s} {str(t['shape']):16s} {', '.join(flags)}")
    return "\n".join(lines)


@main.command("to-fp32")
@click.argument("ckpt", type=click.Path(file_okay=False, path_type=str))
@click.argument("out", type=click.Path(path_type=str))
@tag_option
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16", "fp16"]),
              help="dtype of floating tensors in the output (integer buffers keep theirs).")
@click.option("--max-shard-size", default=None,
              help="Write Hugging Face-style shards of at most this size (e.g. 5GB) into OUT (a folder). "
                   "A folder OUT without this option gets 5GB shards.")
@click.option("--exclude-frozen", is_flag=True, help="Leave out parameters that were not trained.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--strict", is_flag=True, help="Fail (exit 1, nothing written) if any tensor holds inf/NaN.")
@click.option("--dry-run", is_flag=True, help="Print what would be written and exit.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or warnings.")
@handle_errors
def to_fp32(ckpt: str, out: str, tag: str | None, dtype: str, max_shard_size: str | None,
            exclude_frozen: bool, force: bool, strict: bool, dry_run: bool, quiet: bool) -> None:
    """Consolidate CKPT into one fp32 state dict.

    OUT ending in .safetensors: one file. A folder: model-0000X-of-0000N.safetensors shards plus
    model.safetensors.index.json (one shard: model.safetensors). .bin/.pt: a torch file.
    """
    from .checkpoint import open_checkpoint
    from .convert import parse_dtype, plan_to_fp32, run_to_fp32

    c = open_checkpoint(ckpt, tag=tag)
    plan = plan_to_fp32(c.logical, out, dtype=parse_dtype(dtype), exclude_frozen=exclude_frozen,
                        max_shard_size=max_shard_size)
    if dry_run:
        click.echo(f"would write {len(plan.specs)} tensors, {_human(plan.total_nbytes)}, as "
                   f"{plan.format.value} to {plan.output}")
        if plan.shards is not None:
            for name, shard in zip(plan.shards.filenames, plan.shards.shards):
                click.echo(f"  {name}: {len(shard)} tensors, {_human(sum(s.nbytes for s in shard))}")
        sys.exit(1 if plan.specs else 0)
    with _progress(plan.total_nbytes, "to-fp32", not quiet) as tick:
        result = run_to_fp32(plan, c.cache, force=force, strict=strict, on_tensor=tick)
    for bad in result.nonfinite:
        if not quiet:
            click.echo(f"dsckpt: warning: non-finite values in {bad.describe()}; see 'dsckpt scan' and "
                       "'dsckpt repair'", err=True)
    click.echo(f"wrote {len(plan.specs)} tensors ({_human(plan.total_nbytes)}) to "
               + ", ".join(str(f) for f in result.files))


if __name__ == "__main__":  # pragma: no cover
    main()
