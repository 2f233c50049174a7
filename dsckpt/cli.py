"""The ``dsckpt`` command line: validate, call the library, render. Exit codes live here.

0 ok / clean · 1 findings (non-finite values; ``--dry-run`` has work) · 2 usage error ·
3 unreadable, unsupported, corrupt or unsafe checkpoint, or an output that cannot be written (disk
full, quota, read-only, permissions) · 129/143 stopped by SIGHUP/SIGTERM (130: Ctrl-C), temporary
outputs removed · 70 internal error (please report).

Importing this module must stay cheap: torch is imported only inside commands.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from ._version import package_version
from .errors import EXIT_BAD_CHECKPOINT, EXIT_INTERNAL, DsckptError, shorten_runs
from .interrupts import Terminated, signals_as_exceptions

__all__ = ["main"]

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader went away


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def one_line(message: str) -> str:
    """``message`` on one line: newlines become spaces, other control characters (a damaged name can
    hold a carriage return) are shown escaped."""
    return shorten_runs(_CONTROL.sub(lambda m: " " if m.group() == "\n" else repr(m.group())[1:-1], message))


def _fail(message: str, code: int) -> None:
    line = f"dsckpt: error: {one_line(message)}"
    if _saved_stderr is not None:  # a quiet --distributed rank: its error line still goes out
        os.write(_saved_stderr, (line + "\n").encode("utf-8", "replace"))
    else:
        click.echo(line, err=True)
    sys.exit(code)


class _StderrNotes(logging.Handler):
    """The library's warnings (e.g. leftovers of a killed run removed) as ``dsckpt: note:`` lines."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"dsckpt: note: {one_line(record.getMessage())}", err=True)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn library errors into one line on stderr and a documented exit code; never a traceback.

    SIGTERM and SIGHUP unwind like Ctrl-C (temporary outputs removed) and exit 143 / 129."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        notes = _StderrNotes(logging.WARNING)
        log = logging.getLogger("dsckpt")
        log.addHandler(notes)
        try:
            with signals_as_exceptions():
                return fn(*args, **kwargs)
        except DsckptError as e:
            _fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted; no output was left behind", 130)
        except Terminated as e:
            _fail(f"terminated by {e.signal_name}; no output was left behind", e.exit_code)
        except MemoryError:
            _fail("out of memory", EXIT_INTERNAL)
        except RecursionError:  # only a checkpoint nested deeper than max_depth allows gets here (the limit was raised)
            if os.environ.get("DSCKPT_DEBUG"):
                raise
            _fail("the checkpoint nests its data deeper than Python can follow (DSCKPT_LIMITS max_depth was raised "
                  "past what Python's recursion limit allows); the file is corrupt or hostile", EXIT_BAD_CHECKPOINT)
        except BrokenPipeError:
            # stdout's reader went away (`dsckpt ... | head`): not an error worth a message. Point stdout
            # at /dev/null so the interpreter's final flush does not fail again; exit as SIGPIPE would.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(EXIT_BROKEN_PIPE)
        except OSError as e:
            # The environment, not a bug: unreadable input, a folder where a file should be, I/O errors.
            if os.environ.get("DSCKPT_DEBUG"):
                raise
            where = f"'{e.filename}': " if e.filename else ""
            _fail(f"{where}{e.strerror or e} (OSError {errno.errorcode.get(e.errno or 0, e.errno)})",
                  EXIT_BAD_CHECKPOINT)
        except Exception as e:  # the CLI's last line of defence
            if os.environ.get("DSCKPT_DEBUG"):
                raise
            _fail(f"internal error ({type(e).__name__}: {e}). This is a dsckpt bug: please report it "
                  "with the command you ran; rerun with DSCKPT_DEBUG=1 for a traceback", EXIT_INTERNAL)
        finally:
            log.removeHandler(notes)

    return wrapper


@contextmanager
def _progress(total: int, label: str, enabled: bool) -> Iterator[Callable[[Any], None]]:
    if not enabled or not sys.stderr.isatty():
        yield lambda _spec: None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield lambda spec: bar.update(getattr(spec, "nbytes", 1))


def _run_folder(path: str, *, deepspeed_only: bool = False) -> tuple[str, dict[str, Any] | None]:
    """``path``, or the checkpoint it means when it is a run folder (a Trainer ``output_dir``, a Lightning
    ``dirpath``: :func:`dsckpt.layout.resolve_run_folder`), said on stderr; the choice as JSON, or None.
    ``deepspeed_only``: resolve only what ``detect_target`` takes for a DeepSpeed checkpoint (scan, diff:
    a folder of safetensors shards is scanned as such)."""
    from .layout import resolve_run_folder

    if deepspeed_only:
        from .state_dict_files import TargetKind, detect_target

        if detect_target(path) is not TargetKind.DEEPSPEED:
            return path, None
    choice = resolve_run_folder(path)
    if choice is None:
        return path, None
    click.echo(f"dsckpt: {choice.describe()}", err=True)
    return str(choice.checkpoint), choice.to_dict()


def _open_any(path: str, tag: str | None) -> tuple[Any, Any, dict[str, Any] | None]:
    """``(logical, cache, run folder choice)`` of a DeepSpeed checkpoint (or run folder), a torch state-dict file,
    a safetensors file or folder, or a DCP folder."""
    from .state_dict_files import TargetKind, detect_target

    if os.path.exists(path) and detect_target(path) is not TargetKind.DEEPSPEED:
        from .errors import UsageError
        from .state_dict_files import open_state_dict

        if tag is not None:
            raise UsageError(f"--tag is for DeepSpeed checkpoints; '{path}' is a {detect_target(path).value} input")
        return (*open_state_dict(path), None)
    from .checkpoint import open_checkpoint

    path, run = _run_folder(path)
    c = open_checkpoint(path, tag=tag)
    return c.logical, c.cache, run


distributed_option = click.option(
    "--distributed", is_flag=True,
    help="Spread the work over the processes torchrun started, on one host or many: torchrun --nnodes N "
         "--nproc-per-node P --no-python dsckpt ... --distributed. Rank 0 prints; output identical to one process.")

_saved_stderr: int | None = None  # a non-root rank's real stderr, for its one error line


def _start_distributed(enabled: bool) -> Any:
    """Join torchrun's process group for ``--distributed`` (None without it). Every rank but 0 goes quiet:
    its stdout and stderr point at /dev/null, except for the one error line :func:`_fail` prints."""
    global _saved_stderr
    if not enabled:
        return None
    import atexit

    from .distributed import init

    group = init()
    atexit.register(_close_quietly, group)
    if not group.is_root and _saved_stderr is None:
        sys.stdout.flush()
        sys.stderr.flush()
        _saved_stderr = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
    return group


def _close_quietly(group: Any) -> None:
    if _saved_stderr is not None:  # a crash in teardown must not go unseen (the exit code alone says nothing)
        os.dup2(_saved_stderr, 2)
    try:
        group.close()
    except Exception:  # noqa: BLE001 - a peer already gone; the exit code is set
        pass


tag_option = click.option("--tag", default=None, help="Tag folder to read (default: the one named in 'latest').")


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    # click's own version_option reads the version when the CLI is built, i.e. on every run; this reads it only
    # for --version (same output: "dsckpt, version X")
    if value and not ctx.resilient_parsing:
        click.echo(f"dsckpt, version {package_version()}")
        ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Show the version and exit.")
def main() -> None:
    """Get DeepSpeed checkpoints out of trouble: inspect, consolidate to fp32, compare, scan, repair, reshard.

    CKPT is a DeepSpeed save dir (holding 'latest'), a tag folder such as 'global_step100', or a run
    folder: a Trainer output_dir (the newest checkpoint-N is used) or a Lightning dirpath (last.ckpt, else
    the only *.ckpt); the checkpoint used is said on stderr.
    Exit codes: 0 ok, 1 findings or differences, 2 usage error (also: another dsckpt is writing OUT),
    3 unreadable/unsupported/corrupt/unsafe checkpoint or OUT not writable (disk full, read-only),
    129/130/143 stopped by SIGHUP/SIGINT/SIGTERM (nothing left behind), 70 internal error.
    """


@main.command()
@click.argument("ckpt", type=click.Path(path_type=str))
@tag_option
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--tensors", "show_tensors", is_flag=True, help="List every tensor.")
@handle_errors
def info(ckpt: str, tag: str | None, as_json: bool, show_tensors: bool) -> None:
    """Describe a checkpoint: stage, dtype, world sizes, params, files, health.

    CKPT may also be a torch state-dict file, a .safetensors file or folder, or a PyTorch distributed
    checkpoint (DCP) folder."""
    from .info import summarize

    logical, cache, run = _open_any(ckpt, tag)
    s = summarize(logical, cache)
    s["run_folder"] = run
    if as_json:
        click.echo(json.dumps(s, indent=2))
    else:
        click.echo(_render_info(s, show_tensors))
    if not s["health"]["ok"]:
        sys.exit(3)


def _training_lines(t: dict[str, Any] | None) -> list[str]:
    """``info``'s training-state lines: an fp16 run's loss scaler, skipped steps where there are any, findings."""
    if t is None or not t["worth_showing"]:
        return []
    return [f"training     {t['describe']}", *(f"             finding: {m}" for m in t["findings"])]


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{nbytes} B"


_STATE_DICT_LAYOUTS = {"dcp": "PyTorch distributed checkpoint (dcp)", "safetensors": "safetensors file",
                       "safetensors-sharded": "safetensors shards (index or folder)", "torch": "torch file"}


def _render_info(s: dict[str, Any], show_tensors: bool) -> str:
    p = s["params"]
    def known(v: Any) -> Any:
        return "unknown" if v is None else v

    # a state-dict file or folder has no tag, ZeRO stage or world sizes of its own: none is made up for it
    other = _STATE_DICT_LAYOUTS.get(s["layout"])
    lines = [f"checkpoint   {s['path']}"]
    if s["tag"]:
        lines.append(f"tag          {s['tag']}" + (f"   (available: {', '.join(s['tags'])})" if len(s["tags"]) > 1
                                                   else ""))
    lines += [
        (f"layout       {other}, {s['precision']}, " if other else
         f"layout       ZeRO stage {s['zero_stage']} ({s['layout']}), {s['precision']}, ")
        + f"optimizer wrapper {s['optimizer_wrapper']}",
        *([] if other else
          [f"parallelism  data {s['dp_world_size']}, pipeline {s['pp_world_size']}, tensor {s['tp_world_size']}"]),
        f"deepspeed    {s['deepspeed_version'] or 'unknown'}",
        f"progress     global step {known(s['global_steps'])}, samples {known(s['global_samples'])}, "
        f"optimizer step {known(s['optimizer_step'])}",
        *_training_lines(s.get("training")),
        f"params       {p['count']} tensors, {p['numel_total']:,} elements "
        f"({p['numel_trainable']:,} trainable, {p['numel_frozen']:,} frozen"
        + (f", {p['numel_undetermined']:,} undetermined" if p["numel_undetermined"] else "") + ")",
    ]
    for amb in s["ambiguities"]:
        lines.append(f"binding      AMBIGUOUS for {', '.join(amb['names'])}: {amb['describe']}; "
                     + ("exported values agree either way, but trainable/frozen flags and optimizer moments do not"
                        if amb["values_agree"] else "exported values, trainable/frozen flags and optimizer moments "
                        "all depend on it")
                     + " — commands that depend on it refuse (exit 3)")
    moe = s.get("moe")
    for layer in (moe or {}).get("layers", []):
        lines.append(f"experts      {layer['prefix']}{{0..{layer['num_experts'] - 1}}}: {layer['num_experts']} experts "
                     f"(global ids), expert-parallel size {layer['ep_size']} ({layer['local_experts']} per rank), "
                     f"expert-data-parallel size {layer['expert_dp_size']}")
    ae = s.get("autoep")
    if ae is not None:
        first = ae["layers"][0]
        lines.append(f"autoep       preset {ae['preset'] or 'auto-detected'}, {len(ae['layers'])} MoE layers x "
                     f"{first['num_experts']} experts, expert-parallel size {ae['ep_size']} "
                     f"({first['local_experts']} per rank), expert-data-parallel size {ae['expert_dp_size']}, "
                     f"data-parallel size {ae['dp_size']}")
        lines.append(f"experts      {first['module']}.experts: "
                     + ", ".join(p.rsplit(".", 1)[1] for p in first["params"])
                     + f" stacked over {first['num_experts']} experts (cut over the expert index)"
                     + (f"; likewise in {len(ae['layers']) - 1} more layer{'s' if len(ae['layers']) > 2 else ''}"
                        if len(ae["layers"]) > 1 else ""))
    tp = s.get("tensor_parallel")
    if tp is not None:
        lines.append(f"tensor par.  size {tp['tp_size']} ({'AutoTP' if tp['record'] == 'autotp' else 'Megatron-style'} "
                     "record): " + ", ".join(f"{n} {k}" for k, n in tp["split_kinds"].items()))
    if s["tied"]:
        lines.append("tied         " + "; ".join(" = ".join(g) for g in s["tied"]))
    if s["buffers"]:
        lines.append("buffers      " + ", ".join(f"{b['name']} ({b['dtype']})" for b in s["buffers"]))
    opt = s.get("optimizer")
    if opt is not None and opt["model_only"]:
        lines.append("optimizer    none: model only (no optimizer state)")
    elif opt is not None:
        lines.append(f"optimizer    {opt['type'] or 'unknown class'}, {len(opt['groups'])} param group"
                     + ("s" if len(opt["groups"]) != 1 else ""))
        for g in opt["groups"]:
            lines.append(f"  group {g['index']}    {len(g['params'])} params; " + ", ".join(
                f"{k} {tuple(v) if isinstance(v, list) else v}" for k, v in g["hyperparams"].items()))
    lines += [f"note         {msg}" for msg in (opt or {}).get("notes", [])]
    hf = s.get("hf_trainer")
    if hf is not None:
        files = hf["files"]
        lines.append("hf trainer   " + "; ".join(
            f"{role}: {', '.join(files[role])}" for role in ("model-side", "weights", "trainer-state", "optimizer",
                                                             "rng", "other") if files.get(role))
                     + (f"; trainer_state.json global_step {hf['trainer_global_step']}"
                        if hf["trainer_global_step"] is not None else ""))
    peft = s.get("peft")
    if peft is not None:
        lines.append("peft         " + (f"{peft['describe']}; {peft['adapter_tensors']} adapter tensors"
                                        if peft["adapter"] is not None else peft["note"]))
        for alias, source in (peft.get("excluded_ties") or []):
            lines.append(f"             tied {alias} -> {source}: the save left the source out; {alias} is exported "
                         "as saved, and --merge takes the base's tensor")
    lines.append(f"files        {len(s['files'])} files, {_human(s['total_nbytes'])}")
    for f in s["files"]:
        lines.append(f"               {f['name']}  {_human(f['nbytes'])}")
    health = s["health"]
    lines.append("health       ok: complete set of rank files, shapes consistent" if health["ok"]
                 else f"health       {len(health['problems'])} problem(s):")
    lines += [f"               {msg}" for msg in health["problems"]]
    lines += [f"note         {msg}" for msg in health.get("notes", [])]
    if show_tensors:
        lines.append("tensors")
        for t in s["tensors"]:
            flags = [t["kind"] if t["kind"] != "param" else
                     ("ambiguous" if t["trainable"] is None else "trainable" if t["trainable"] else "frozen")]
            if t["tied_to"]:
                flags.append(f"tied to {t['tied_to']}")
            if t.get("tp_split"):
                flags.append(f"tp {t['tp_split']}")
            lines.append(f"  {t['name']:40s} {t['dtype']:9s} {t['shape']!s:16s} {', '.join(flags)}")
    return "\n".join(lines)


@main.command("to-fp32")
@click.argument("ckpt", type=click.Path(file_okay=False, path_type=str))
@click.argument("out", type=click.Path(path_type=str))
@tag_option
@click.option("--dtype", default=None, type=click.Choice(["fp32", "bf16", "fp16"]),
              help="dtype of floating tensors in the output (integer buffers keep theirs). Default fp32; with "
                   "--merge, each tensor's dtype in the base.")
@click.option("--max-shard-size", default=None,
              help="Write Hugging Face-style shards of at most this size (e.g. 5GB) into OUT (a folder). "
                   "A folder OUT without this option gets 5GB shards.")
@click.option("--exclude-frozen", is_flag=True, help="Leave out parameters that were not trained.")
@click.option("--no-hf-files", is_flag=True,
              help="For a Hugging Face Trainer folder: write only the weights (every name, tied aliases included); "
                   "do not copy config.json, tokenizer and other model-side files into OUT.")
@click.option("--no-client-state", is_flag=True,
              help="For OUT.ckpt: write state_dict alone, without the trainer's client state (hyper-parameters, "
                   "loops, callbacks, schedulers...).")
@click.option("--merge", is_flag=True,
              help="For a PEFT run (LoRA, rsLoRA, DoRA): merge the adapter into the base model and write a full "
                   "Hugging Face model folder to OUT (streamed: memory stays at a few tensors).")
@click.option("--base", "base_dir", default=None, type=click.Path(path_type=str),
              help="With --merge: the folder of the base model that was fine-tuned (safetensors or "
                   "pytorch_model*.bin). Not needed when the checkpoint holds the frozen base itself.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--strict", is_flag=True, help="Fail (exit 1, nothing written) if any tensor holds inf/NaN.")
@click.option("--dry-run", is_flag=True, help="Print what would be written and exit.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or warnings.")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(0, 64),
              help="Reader threads running ahead of the writer (0: read and write in one thread).")
@distributed_option
@handle_errors
def to_fp32(ckpt: str, out: str, tag: str | None, dtype: str | None, max_shard_size: str | None,
            exclude_frozen: bool, no_hf_files: bool, no_client_state: bool, merge: bool, base_dir: str | None,
            force: bool, strict: bool, dry_run: bool, quiet: bool, workers: int, distributed: bool) -> None:
    """Consolidate CKPT into one fp32 state dict.

    OUT ending in .safetensors: one file. A folder: model-0000X-of-0000N.safetensors shards plus
    model.safetensors.index.json (one shard: model.safetensors). .bin/.pt/.pth: a torch state dict.
    .ckpt: a Lightning checkpoint as Lightning's converter writes it (state_dict plus the client state of
    rank 0's model-states file), for LightningModule.load_from_checkpoint. Other suffixes: exit 2.

    CKPT a Hugging Face Trainer folder (checkpoint-N/, or its global_stepN/) and OUT a folder: the
    model-side files (config.json with dtype set to --dtype, generation config, tokenizer, chat
    template) are copied next to the weights and tied aliases are left out as save_pretrained does,
    so that from_pretrained(OUT) works. Trainer state, optimizer and RNG files are never copied.

    CKPT a PEFT run (adapter_config.json beside the DeepSpeed folder) and OUT a folder: OUT is a PEFT adapter
    folder (adapter_model.safetensors with PEFT's keys, fp32 masters; adapter_config.json) that
    PeftModel.from_pretrained(base, OUT) loads. --merge [--base BASE_DIR]: the adapter merged into the base,
    a model folder for AutoModelForCausalLM.from_pretrained(OUT). The raw state dict (PEFT's in-memory names):
    OUT ending in .safetensors, or --no-hf-files.
    """
    from .convert import parse_dtype, plan_to_fp32, run_to_fp32, run_to_fp32_distributed
    from .errors import UsageError

    if base_dir is not None and not merge:
        raise UsageError("--base is the base model to merge into; add --merge")
    group = _start_distributed(distributed)
    c = _open_for_export(ckpt, tag)
    if merge:
        if distributed or exclude_frozen or no_client_state or strict:
            raise UsageError("--merge does not combine with --distributed, --exclude-frozen, --no-client-state or "
                             "--strict")
        _merge(c, out, base_dir, None if dtype is None else parse_dtype(dtype), max_shard_size,
               hf_files=not no_hf_files, force=force, dry_run=dry_run, quiet=quiet)
        return
    dtype = dtype or "fp32"
    plan = plan_to_fp32(c.logical, out, dtype=parse_dtype(dtype), exclude_frozen=exclude_frozen,
                        max_shard_size=max_shard_size, hf_files=not no_hf_files,
                        client_state=not no_client_state, cache=c.cache)
    if dry_run:
        click.echo(f"would write {len(plan.specs)} tensors, {_human(plan.total_nbytes)}, as "
                   f"{plan.format.value} to {plan.output}")
        if plan.shards is not None:
            for name, shard in zip(plan.shards.filenames, plan.shards.shards):
                click.echo(f"  {name}: {len(shard)} tensors, {_human(sum(s.nbytes for s in shard))}")
        click.echo("\n".join(_hf_lines(plan.hf_files, plan.tied_left_out)))
        if plan.client_state is not None:
            click.echo("\n".join(plan.client_state.describe()))
        sys.exit(1 if plan.specs else 0)
    with _progress(plan.total_nbytes, "to-fp32", not quiet) as tick:
        if group is not None:
            result = run_to_fp32_distributed(plan, c.cache, group, force=force, strict=strict, on_tensor=tick,
                                             workers=workers)
        else:
            result = run_to_fp32(plan, c.cache, force=force, strict=strict, on_tensor=tick, workers=workers)
    for bad in result.nonfinite:
        if not quiet:
            click.echo(f"dsckpt: warning: non-finite values in {bad.describe()}; see 'dsckpt scan' and "
                       "'dsckpt repair'", err=True)
    click.echo(f"wrote {len(plan.specs)} tensors ({_human(plan.total_nbytes)}) to "
               + ", ".join(str(f) for f in result.files))
    if not quiet:
        for alias, source in c.logical.excluded_ties:
            click.echo(f"dsckpt: note: tied param '{alias}' points to '{source}', which the save left out "
                       f"(exclude_frozen_parameters); '{alias}' is written as saved"
                       + ("" if any(e.name == alias for e in c.logical.entries) else " (no value: left out)")
                       + ("" if plan.adapter is None else " in the raw state dict only, not in the adapter"), err=True)
    if plan.adapter is not None:
        click.echo(f"PEFT adapter ({plan.adapter.describe()}): {len(plan.specs)} tensors with PEFT's keys, from the "
                   f"fp32 masters; load with PeftModel.from_pretrained(base, '{plan.output}')")
        if plan.adapter.left_out:
            click.echo(f"left out {len(plan.adapter.left_out)} tensor(s) that are not part of the adapter (frozen base "
                       "params in the checkpoint; --merge uses them)")
    if plan.client_state is not None:
        click.echo("\n".join(plan.client_state.describe()))
    if plan.hf_files is not None:
        click.echo(f"copied {len(plan.hf_files.copies)} Hugging Face file(s) from {plan.hf_files.folder}"
                   + (f"; tied {', '.join(plan.tied_left_out)} left out (from_pretrained re-ties it)"
                      if plan.tied_left_out else ""))
        if not quiet:
            for o in plan.hf_files.left_out:
                if o.source is None:
                    click.echo(f"dsckpt: warning: {o.reason}", err=True)


@main.command("to-dcp")
@click.argument("ckpt", type=click.Path(file_okay=False, path_type=str))
@click.argument("out", type=click.Path(path_type=str))
@tag_option
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16", "fp16"]),
              help="dtype of the trained params in the model state (from the fp32 masters). Frozen params, buffers "
                   "and the optimizer state keep their stored dtype.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--dry-run", is_flag=True, help="Print what would be written and exit.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--workers", default=4, show_default=True, type=click.IntRange(1, 64),
              help="DCP files written at once (one writer thread each, its tensors' bytes copied from CKPT through a "
                   "few small buffers).")
@click.option("--plain", is_flag=True,
              help="For a Trainer or Accelerate folder too, write one DCP folder {model, optim} instead of the "
                   "folder the Trainer / Accelerate resumes from under FSDP2.")
@distributed_option
@handle_errors
def to_dcp(ckpt: str, out: str, tag: str | None, dtype: str, force: bool, dry_run: bool, quiet: bool,
           workers: int, plain: bool, distributed: bool) -> None:
    """Write the whole training state of CKPT as a PyTorch distributed checkpoint (DCP) folder OUT.

    OUT holds {"model": M, "optim": O} as get_model_state_dict / get_optimizer_state_dict give them (FQN keys;
    fp32 masters; Adam moments and step; DeepSpeed's param groups in order), so an FSDP2 (fully_shard) job on any
    number of ranks, or a plain process, resumes with dcp.load + set_state_dict. Nothing is loaded whole: memory
    stays at a few tensors.

    CKPT a Trainer checkpoint-N/ or an Accelerate save_state folder: OUT is the folder that client resumes from
    under FSDP2 (pytorch_model_fsdp_0/, optimizer_0/, scheduler and RNG files, trainer_state.json, the model-side
    files), unless --plain.
    """
    from .checkpoint import open_checkpoint
    from .convert import parse_dtype
    from .dcp_writer import plan_to_dcp, run_to_dcp, run_to_dcp_distributed
    from .run_folder_dcp import run_folder_client

    group = _start_distributed(distributed)
    ckpt, _ = _run_folder(ckpt)
    c = open_checkpoint(ckpt, tag=tag, check_master_copies=True)
    client = None if plain else run_folder_client(c.logical.root)
    if client is not None:
        if group is not None:
            from .errors import UsageError

            raise UsageError(f"--distributed writes one DCP folder; '{c.logical.root}' is a {client.value} folder, "
                             "whose FSDP2 folder is written by one process (or pass --plain)")
        _to_dcp_run_folder(c, out, client, parse_dtype(dtype), force=force, dry_run=dry_run, quiet=quiet,
                           workers=workers)
        return
    plan = plan_to_dcp(c.logical, out, dtype=parse_dtype(dtype))
    n_state = len(plan.state_tensors)
    what = (f"{len(plan.model_tensors)} model tensors, {n_state} optimizer state tensors ({plan.optimizer_class}, "
            f"{len(plan.groups)} param group{'s' if len(plan.groups) != 1 else ''})")
    if dry_run:
        click.echo(f"would write {what}, {_human(plan.total_nbytes)}, as a DCP folder to {plan.output}")
        for g in plan.groups:
            click.echo(f"  param group {g.index}: {len(g.params)} params, "
                       + ", ".join(f"{k} {v!r}" for k, v in g.hyperparams))
        sys.exit(1 if plan.tensors else 0)
    with _progress(plan.total_nbytes, "to-dcp", not quiet) as tick:
        if group is not None:
            result = run_to_dcp_distributed(plan, c.cache, group, force=force, on_tensor=tick, workers=workers)
        else:
            result = run_to_dcp(plan, c.cache, force=force, on_tensor=tick, workers=workers)
    click.echo(f"wrote {what}, {_human(plan.total_nbytes)}, to {plan.output} ({len(result.files)} files)")
    if plan.defaults_added and not quiet:
        click.echo(f"dsckpt: note: the saved param groups lack {', '.join(plan.defaults_added)}; written with "
                   f"torch.optim.{plan.optimizer_class}'s defaults", err=True)


def _to_dcp_run_folder(c: Any, out: str, client: Any, dtype: Any, *, force: bool, dry_run: bool, quiet: bool,
                       workers: int) -> None:
    from .run_folder_dcp import RunFolderClient, plan_run_folder_dcp, run_run_folder_dcp, trainer_param_groups

    target = None
    if client is RunFolderClient.TRAINER:
        trained = frozenset(f for t in c.logical.optimizer_groups for f in t.param_names)
        target = trainer_param_groups(c.logical.root, trained)
    plan = plan_run_folder_dcp(c.logical, c.cache, out, client=client, dtype=dtype, target_groups=target)
    what = (f"{len(plan.model.tensors)} model tensors, {len(plan.optim.state_tensors)} optimizer state tensors "
            f"({plan.optim.optimizer_class}, {len(plan.optim.groups)} param group"
            f"{'s' if len(plan.optim.groups) != 1 else ''}"
            + (f", the Trainer's, from DeepSpeed's {len(c.logical.optimizer_groups)}" if plan.regrouped else "") + ")")
    if dry_run:
        article = "an" if client.value[0] in "AEIOU" else "a"
        click.echo(f"would write {what}, {_human(plan.total_nbytes)}, as {article} {client.value} FSDP2 folder to "
                   f"{plan.output}")
        click.echo("\n".join(plan.describe()))
        sys.exit(1)
    with _progress(plan.total_nbytes, "to-dcp", not quiet) as tick:
        written = run_run_folder_dcp(plan, c.cache, force=force, on_tensor=tick, workers=workers)
    click.echo(f"wrote {what}, {_human(plan.total_nbytes)}, to {plan.output} ({client.value} FSDP2 folder: "
               f"{', '.join(p.name for p in written)})")
    if plan.optim.defaults_added and not quiet:
        click.echo(f"dsckpt: note: the saved param groups lack {', '.join(plan.optim.defaults_added)}; written with "
                   f"torch.optim.{plan.optim.optimizer_class}'s defaults", err=True)


def _open_for_export(ckpt: str, tag: str | None) -> Any:
    """The checkpoint ``to-fp32`` exports: a DeepSpeed checkpoint or run folder, or a DCP folder."""
    from .checkpoint import Checkpoint, open_checkpoint
    from .dcp_reader import is_dcp_folder

    if is_dcp_folder(ckpt):
        from .dcp_reader import read_dcp
        from .errors import UsageError

        if tag is not None:
            raise UsageError(f"--tag is for DeepSpeed checkpoints; '{ckpt}' is a DCP folder")
        return Checkpoint(*read_dcp(ckpt))
    ckpt, _ = _run_folder(ckpt)
    return open_checkpoint(ckpt, tag=tag, check_master_copies=True)


def _merge(c: Any, out: str, base_dir: str | None, dtype: str | None, max_shard_size: str | None, *,
           hf_files: bool, force: bool, dry_run: bool, quiet: bool) -> None:
    from .errors import UsageError
    from .peft import plan_adapter_export, read_adapter_config
    from .peft_merge import plan_merge, run_merge

    cfg = read_adapter_config(c.logical.root)
    if cfg is None:
        raise UsageError(f"--merge is for PEFT runs: '{c.logical.root}' has no adapter_config.json")
    export = plan_adapter_export(c.logical, cfg)
    plan = plan_merge(c.logical, c.cache, cfg, out, base_dir=base_dir, dtype=dtype, max_shard_size=max_shard_size,
                      hf_files=hf_files, base_in_checkpoint=export.base_in_checkpoint)
    if dry_run:
        click.echo(f"would merge the {cfg.variant} adapter into {plan.base}: {len(plan.specs)} tensors, "
                   f"{_human(plan.total_nbytes)}, to {plan.output}")
        for a in plan.actions.values():
            if a.lora is not None:
                lo = a.lora
                click.echo(f"  merge {a.name}: r {lo.r}, alpha {lo.alpha:g}, scaling {lo.scaling:g}"
                           + (", fan_in_fan_out" if lo.fan_in_fan_out else "") + (", DoRA" if lo.magnitude else ""))
            elif a.replace_with is not None:
                click.echo(f"  replace {a.name} with {a.replace_with} (modules_to_save)")
        click.echo("\n".join(_hf_lines(plan.hf_files)))
        sys.exit(1)
    with _progress(plan.total_nbytes, "merge", not quiet) as tick:
        result = run_merge(plan, c.cache, force=force, on_tensor=tick)
    click.echo(f"merged the {cfg.variant} adapter into {plan.base}: wrote {len(plan.specs)} tensors "
               f"({_human(plan.total_nbytes)}) to " + ", ".join(str(f) for f in result.files))
    click.echo("; ".join(plan.notes) + (f"; tied {', '.join(plan.tied_left_out)} left out (from_pretrained re-ties it)"
                                        if plan.tied_left_out else ""))
    if plan.hf_files is not None and not quiet:
        for o in plan.hf_files.left_out:
            if o.source is None:
                click.echo(f"dsckpt: warning: {o.reason}", err=True)


def _hf_lines(hf: Any, tied_left_out: tuple[str, ...] = ()) -> list[str]:
    if hf is None:
        return []
    lines = [f"Hugging Face files from {hf.folder}:", *hf.describe()]
    lines += [f"  leave out tensor {n}: tied alias, re-tied by from_pretrained" for n in tied_left_out]
    return lines


_CHECK_NAMES = {"nonfinite": "inf/NaN", "fp16_overflow": "fp16 overflow", "mismatch": "master/16-bit mismatch"}


@main.command()
@click.argument("target", type=click.Path(exists=True, path_type=str))
@tag_option
@click.option("--nonfinite", "nonfinite_only", is_flag=True, help="Only look for inf/NaN values.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--workers", default=None, type=click.IntRange(0, 64),
              help="Workers reading and checking chunks in parallel (default: one per core, at most 8; "
                   "0: everything in one thread); processes from 4 workers and 1 GiB read, else threads.")
@click.option("--all", "whole_run", is_flag=True,
              help="TARGET is a run (a save dir, a Trainer output_dir, a Lightning dirpath): scan every checkpoint "
                   "in step order, then name the last clean one and the first with findings.")
@distributed_option
@handle_errors
def scan(target: str, tag: str | None, nonfinite_only: bool, as_json: bool, quiet: bool,
         workers: int | None, whole_run: bool, distributed: bool) -> None:
    """Find inf/NaN values in every stored tensor of TARGET.

    TARGET: a DeepSpeed checkpoint, a .safetensors file, a folder of safetensors shards, or a torch
    state-dict file. Also flags fp32 masters beyond fp16's range in fp16-trained checkpoints and
    16-bit weights that disagree with their fp32 master (not with --nonfinite). Exit 1 on findings.
    Non-finite values in client state (a trainer's callbacks, loops, schedulers) are listed as notes
    naming their key path and do not change the exit code. fp16 runs: a loss scale at its floor is a
    finding; so is a trained param whose optimizer state is all zeros where its module's others are not.
    """
    from types import SimpleNamespace

    if whole_run:
        if tag is not None or distributed:
            from .errors import UsageError

            raise UsageError("--all scans every checkpoint of TARGET: it takes neither --tag nor --distributed")
        _scan_run(target, nonfinite_only=nonfinite_only, as_json=as_json, quiet=quiet, workers=workers)
        return

    from .scan import prepare_scan, run_scan, run_scan_distributed

    group = _start_distributed(distributed)
    target, run = _run_folder(target, deepspeed_only=True)
    plan, cache = prepare_scan(target, tag=tag, nonfinite_only=nonfinite_only)
    with _progress(plan.nbytes, "scan", not quiet and not as_json) as tick:
        if group is not None:
            report = run_scan_distributed(plan, cache, group, on_progress=lambda n: tick(SimpleNamespace(nbytes=n)),
                                          workers=workers)
        else:
            report = run_scan(plan, cache, on_progress=lambda n: tick(SimpleNamespace(nbytes=n)), workers=workers)
    if as_json:
        click.echo(json.dumps({**report.to_dict(), "run_folder": run}, indent=2))
    else:
        checks = ", ".join(_CHECK_NAMES[c.value] for c in report.checks)
        head = (f"scanned {report.target} ({report.target_kind.value}): {report.stored_tensors} stored tensors, "
                f"{report.numel_scanned:,} values, {_human(report.nbytes_read)}; checks: {checks}")
        click.echo(head)
        if report.training is not None and report.training.worth_showing:
            click.echo(f"training: {report.training.describe()}")
        if report.clean:
            click.echo("clean: nothing found" if not report.client_state else
                       "clean: nothing found in model or optimizer data")
        for f in report.findings:
            click.echo(f"  {f.check.value:13s} {f.describe()}")
        for h in report.health:
            click.echo(f"  {h.check.value:13s} {h.describe()}")
        for f in report.client_state:
            click.echo(f"  note          {f.describe()}")
        if not report.clean:
            n = len(report.findings) + len(report.health)
            click.echo(f"{n} finding(s)" + ("; see 'dsckpt repair' to patch inf/NaN values" if report.findings
                                            else ""))
    sys.exit(0 if report.clean else 1)


def _scan_run(target: str, *, nonfinite_only: bool, as_json: bool, quiet: bool, workers: int | None) -> None:
    from .scan_run import scan_run

    show = not quiet and not as_json and sys.stderr.isatty()

    def started(c: Any) -> None:
        if show:
            click.echo(f"scanning {c.path} ...", err=True)

    report = scan_run(target, nonfinite_only=nonfinite_only, workers=workers, on_checkpoint=started)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        sys.exit(0 if report.clean else 1)
    entries = report.checkpoints
    click.echo(f"scanned run {report.run}: {len(entries)} checkpoint(s)"
               + (", inf/NaN only" if nonfinite_only else ""))
    fp16 = any(e.loss_scale is not None for e in entries)
    width = max(len(str(e.path)) for e in entries)
    click.echo(f"  {'step':>6}  " + (f"{'loss scale':>10}  " if fp16 else "") + f"{'skipped':>7}  "
               + f"{'checkpoint':{width}s}  result")
    for e in entries:
        step = "?" if e.step is None else str(e.step)
        scale = "-" if e.loss_scale is None else f"{e.loss_scale:g}"
        skipped = "-" if e.skipped_steps is None else str(e.skipped_steps)
        result = e.summary + (" (scan record reused)" if e.reused_record else "")
        result += "".join(f"; note: {n}" for n in e.notes)
        click.echo(f"  {step:>6}  " + (f"{scale:>10}  " if fp16 else "") + f"{skipped:>7}  "
                   + f"{str(e.path):{width}s}  {one_line(result)}")
    lc, ff = report.last_clean, report.first_with_findings
    click.echo(f"last clean:          {lc.path} (step {lc.step})" if lc is not None else "last clean:          none")
    click.echo(f"first with findings: {ff.path} (step {ff.step})" if ff is not None
               else "first with findings: none")
    sys.exit(0 if report.clean else 1)


@main.command()
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--exit-on-finding", is_flag=True,
              help="Exit 1 as soon as a checkpoint has findings, naming it (the rest of the run is not watched).")
@click.option("--interval", default=5.0, show_default=True, type=click.FloatRange(min=0.01),
              help="Seconds between looks at RUN for new checkpoints.")
@click.option("--timeout", "timeout_s", default=None, type=click.FloatRange(min=0.0),
              help="Stop watching after this many seconds (default: until Ctrl-C).")
@click.option("--once", is_flag=True,
              help="Check the newest complete checkpoint now, then exit (use 'scan RUN --all' for every one).")
@click.option("--nonfinite", "nonfinite_only", is_flag=True, help="Only look for inf/NaN values.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line, per checkpoint.")
@handle_errors
def watch(run: str, exit_on_finding: bool, interval: float, timeout_s: float | None, once: bool,
          nonfinite_only: bool, as_json: bool) -> None:
    """Scan each checkpoint of RUN as soon as it is completely written, for runs whose code you cannot change.

    RUN: a DeepSpeed save dir, a Trainer output_dir or a Lightning dirpath, as training writes it. Each
    checkpoint is scanned once every rank file is written, in one background process at low priority, one at a
    time; when several newer checkpoints complete during a scan, only the newest is scanned next (the others are
    listed as skipped). The result is recorded beside each checkpoint (dsckpt-scan.json), which 'scan RUN --all'
    reuses while its files are unchanged. Exit 1 if a checkpoint had findings or could not be read, else 0.
    """
    from .watch import Status, watch_run

    seen_bad = False
    click.echo(f"dsckpt: watching {run} (every {interval:g} s"
               + (f", for {timeout_s:g} s" if timeout_s is not None else "") + ")", err=True)
    for outcome in watch_run(run, interval_s=interval, timeout_s=timeout_s, once=once,
                             nonfinite_only=nonfinite_only):
        if as_json:
            click.echo(json.dumps(outcome.to_dict()))
        else:
            click.echo(outcome.describe())
            for line in outcome.findings:
                click.echo(f"  {line}")
        sys.stdout.flush()
        if outcome.status in (Status.FINDINGS, Status.UNREADABLE):
            seen_bad = True
        if exit_on_finding and outcome.status is Status.FINDINGS:
            click.echo(f"dsckpt: findings in {outcome.path}; stopped watching (--exit-on-finding)", err=True)
            sys.exit(1)
    sys.exit(1 if seen_bad else 0)


@main.command()
@click.argument("a", type=click.Path(exists=True, path_type=str))
@click.argument("b", type=click.Path(exists=True, path_type=str))
@click.option("--atol", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Absolute tolerance: values pass when |a-b| <= atol + rtol*|b|.")
@click.option("--rtol", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Relative tolerance (B is the reference).")
@click.option("--role", default="value", show_default=True,
              type=click.Choice(["value", "master", "module", "exp_avg", "exp_avg_sq", "all"]),
              help="Which copy to compare: value (what to-fp32 exports: the fp32 master, else the stored copy), "
                   "one stored copy of a DeepSpeed checkpoint, or all copies both DeepSpeed checkpoints have.")
@click.option("--strict-dtype", is_flag=True, help="A dtype difference alone makes a tensor different.")
@click.option("--exclude-frozen", is_flag=True, help="Leave out params that are frozen on either side.")
@click.option("--tag", default=None, help="Tag folder to read in every DeepSpeed input (default: 'latest').")
@click.option("--tag-a", default=None, help="Tag folder for A (overrides --tag).")
@click.option("--tag-b", default=None, help="Tag folder for B (overrides --tag).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (every tensor).")
@click.option("--verbose", "-v", is_flag=True, help="Also list tensors that are within tolerance but not bitwise "
                                                    "equal (another dtype, or differences within tolerance).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@distributed_option
@handle_errors
def diff(a: str, b: str, atol: float, rtol: float, role: str, strict_dtype: bool, exclude_frozen: bool,
         tag: str | None, tag_a: str | None, tag_b: str | None, as_json: bool, verbose: bool, quiet: bool,
         distributed: bool) -> None:
    """Compare A and B tensor by tensor, by name. Exit 0 equal (within tolerance), 1 different.

    A and B: each a DeepSpeed checkpoint, a .safetensors file, a folder of safetensors shards, or a
    torch state-dict file. Reports names only in A or only in B, shape and dtype differences, and per
    tensor: bitwise equality, how many values differ, max abs and rel difference. Values compare in
    float64 (NaN equals NaN at the same place); integer tensors compare exactly. A dtype difference
    alone is not a difference unless --strict-dtype. Streams in bounded memory.
    """
    from types import SimpleNamespace

    from .diff import Status, prepare_diff, run_diff, run_diff_distributed
    from .state_dict_files import TargetKind, detect_target

    group = _start_distributed(distributed)

    def side_tag(path: str, own: str | None) -> str | None:
        if own is not None:
            return own
        return tag if tag is not None and detect_target(path) is TargetKind.DEEPSPEED else None

    a, run_a = _run_folder(a, deepspeed_only=True)
    b, run_b = _run_folder(b, deepspeed_only=True)
    plan, cache_a, cache_b = prepare_diff(a, b, tag_a=side_tag(a, tag_a), tag_b=side_tag(b, tag_b), role=role,
                                          atol=atol, rtol=rtol, strict_dtype=strict_dtype,
                                          exclude_frozen=exclude_frozen)
    with _progress(plan.nbytes, "diff", not quiet and not as_json) as tick:
        if group is not None:
            report = run_diff_distributed(plan, cache_a, cache_b, group,
                                          on_progress=lambda n: tick(SimpleNamespace(nbytes=n)))
        else:
            report = run_diff(plan, cache_a, cache_b, on_progress=lambda n: tick(SimpleNamespace(nbytes=n)))
    if as_json:
        click.echo(json.dumps({**report.to_dict(), "run_folder_a": run_a, "run_folder_b": run_b}, indent=2))
    else:
        what = ("values as to-fp32 exports them (fp32 master, else the stored copy)" if role == "value"
                else "every stored copy both have" if role == "all" else f"the {role} copies")
        click.echo(f"A {report.a.describe()}")
        click.echo(f"B {report.b.describe()}")
        click.echo(f"comparing {what}; tolerance |a-b| <= atol + rtol*|b| with atol={atol:g}, rtol={rtol:g}")
        labels = {Status.CLOSE: "close", Status.DIFFERENT: "different", Status.ONLY_IN_A: "only in A",
                  Status.ONLY_IN_B: "only in B", Status.SHAPE_MISMATCH: "shape", Status.SKIPPED: "skipped"}
        for t in report.tensors:
            if t.status is not Status.EQUAL and (verbose or t.status is not Status.CLOSE):
                click.echo(f"  {labels[t.status]:10s} {t.describe()}")
        click.echo(("equal: " if report.equal else "different: ") + report.summary())
    sys.exit(0 if report.equal else 1)


@main.command()
@click.argument("ckpt", type=click.Path(exists=True, path_type=str))
@tag_option
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--workers", default=None, type=click.IntRange(0, 64),
              help="Workers reading and checking chunks in parallel (default: one per core, at most 8; "
                   "0: everything in one thread); processes from 4 workers and 1 GiB read, else threads.")
@distributed_option
@handle_errors
def verify(ckpt: str, tag: str | None, as_json: bool, workers: int | None, distributed: bool) -> None:
    """Audit CKPT without converting it, in one streaming pass over its data.

    Checks that every rank file is present and from the same save (tag, world sizes, step, config,
    loss scaler, optimizer settings and step counts agree), every zip record's CRC32, partition sizes
    and padding, that every optimizer tensor's owner is proven, and that every 16-bit copy equals its
    fp32 master rounded (no inf/NaN). Exit 0 ok, 1 problems found, 3 unreadable.
    """
    from .verify import verify as run_verify

    group = _start_distributed(distributed)
    ckpt, run = _run_folder(ckpt, deepspeed_only=True)
    report = run_verify(ckpt, tag=tag, workers=workers, group=group)
    if as_json:
        click.echo(json.dumps({**report.to_dict(), "run_folder": run}, indent=2))
    else:
        click.echo(f"verified {report.target} (tag {report.tag}): {len(report.files)} files, "
                   f"{report.records_checked} records CRC-checked, {report.stored_tensors} stored tensors, "
                   f"{_human(report.nbytes_read)} read")
        for note in report.notes:
            click.echo(f"  note: {note}")
        for f in report.client_state:
            click.echo(f"  note: {f.describe()}")
        if report.ok:
            records = "records intact" if report.records_checked else "no records with CRCs to check"
            click.echo(f"ok: files from one save, {records}, partitions consistent, bindings proven, "
                       "16-bit copies equal their masters, all values finite")
        for p in report.problems:
            click.echo(f"  {p.area.value:10s} {p.describe()}")
        if not report.ok:
            click.echo(f"{len(report.problems)} problem(s) found")
    sys.exit(0 if report.ok else 1)


@main.command()
@click.argument("ckpt", type=click.Path(exists=True, path_type=str))
@click.argument("out", type=click.Path(path_type=str))
@click.option("--from", "source", default=None,
              help="Source of the values: a .safetensors file, a sharded folder, a torch state-dict file, 'master' "
                   "(the checkpoint's own fp32 master weights, for 16-bit param copies), or another DeepSpeed "
                   "checkpoint of the same run (e.g. RUN/global_step100: masters, 16-bit copies, buffers and "
                   "optimizer moments).")
@tag_option
@click.option("--policy", type=click.Choice(["refuse", "reset-bn-stats"]), default="refuse", show_default=True,
              help="Tensors with no source value: refuse, or reset BatchNorm running stats (mean 0, var 1).")
@click.option("--loss-scale", "loss_scale", type=float, default=None, metavar="S",
              help="fp16 runs: write the dynamic loss scaler of every rank file at scale S, its counters reset as "
                   "DeepSpeed starts a scaler (cur_iter 0, last_overflow_iter -1, hysteresis refilled); for a run "
                   "stopped at its loss-scale floor. S must be positive and at least the scaler's floor.")
@click.option("--whole-tensor", is_flag=True, help="Replace whole tensors, not only the non-finite values.")
@click.option("--dry-run", is_flag=True, help="Print the plan and exit (1 if there is work).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@distributed_option
@handle_errors
def repair(ckpt: str, out: str, source: str | None, tag: str | None, policy: str, loss_scale: float | None,
           whole_tensor: bool, dry_run: bool, force: bool, as_json: bool, quiet: bool, distributed: bool) -> None:
    """Write a copy of CKPT to OUT with every inf/NaN value patched from a source, and/or (--loss-scale) the
    fp16 loss scaler reset.

    CKPT: a DeepSpeed checkpoint folder (OUT: the same layout, untouched files copied byte for byte)
    or a .safetensors file (OUT: a .safetensors file). CKPT is never modified.
    """
    from .errors import UsageError
    from .repair import Policy, check_loss_scale_value, prepare_repair, run_repair, run_repair_distributed

    if loss_scale is not None:
        check_loss_scale_value(loss_scale)
    if source is None and policy != "reset-bn-stats" and loss_scale is None:
        raise UsageError("give a source with --from SOURCE (or --policy reset-bn-stats, or --loss-scale S)")
    group = _start_distributed(distributed)
    ckpt, run = _run_folder(ckpt)
    plan, _ = prepare_repair(ckpt, source, tag=tag, whole_tensor=whole_tensor, policy=Policy(policy),
                             loss_scale=loss_scale)
    lines = [p.describe() for p in plan.patches]
    if plan.loss_scale is not None:
        lines.append(plan.loss_scale.describe())
    if not plan.has_work:
        if as_json:
            click.echo(json.dumps({"plan": plan.to_dict(), "written": None, "run_folder": run}, indent=2))
        else:
            click.echo(f"nothing to repair: {ckpt} holds no inf/NaN values; nothing written")
        sys.exit(0)
    if dry_run:
        if as_json:
            click.echo(json.dumps({"plan": plan.to_dict(), "written": None, "run_folder": run}, indent=2))
        else:
            click.echo(f"would patch {len(plan.patches)} tensor(s)"
                       + (" and reset the loss scaler" if plan.loss_scale is not None else "")
                       + f", rewriting {len(plan.files)} file(s):")
            click.echo("\n".join(lines))
        sys.exit(1)
    result = (run_repair(plan, out, force=force) if group is None
              else run_repair_distributed(plan, out, group, force=force))
    if as_json:
        click.echo(json.dumps({"plan": plan.to_dict(), "written": str(result.output), "run_folder": run,
                               "rewritten": [str(f) for f in result.rewritten],
                               "rescan": result.rescan.to_dict()}, indent=2))
        return
    click.echo(f"patched {len(plan.patches)} tensor(s)"
               + (" and reset the loss scaler" if plan.loss_scale is not None else "") + ":")
    click.echo("\n".join(lines))
    for p in plan.promotions:
        click.echo(f"dsckpt: warning: '{p.name}' is now stored as {p.promote_to}; DeepSpeed loads it, but an engine "
                   "with data_types.buffer_dtype fp16 casts it back to inf: resume without buffer_dtype", err=True)
    click.echo(f"wrote {result.output} (rewrote {len(result.rewritten)} file(s), copied the rest unchanged); "
               f"re-scan: clean ({result.rescan.stored_tensors} stored tensors)")



def _parse_tied_keys(items: tuple[str, ...]) -> dict[int, str]:
    """``--tied-key LAYER=KEY`` items as layer index -> key."""
    from .errors import UsageError

    out: dict[int, str] = {}
    for item in items:
        layer, sep, key = item.partition("=")
        if not sep or not layer.strip().isdigit() or not key.strip() or "." in key:
            raise UsageError(f"--tied-key '{item}' is not LAYER=KEY (a layer index and a TiedLayerSpec key without "
                             "dots, e.g. 0=embed)")
        out[int(layer)] = key.strip()
    return out

@main.command()
@click.argument("ckpt", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.argument("out", type=click.Path(path_type=str))
@click.option("--world-size", "-n", "world_size", type=click.IntRange(min=1), default=None,
              help="Number of ranks the checkpoint will be resumed on (required unless --universal); with tensor "
                   "or pipeline parallelism, TP size x pipeline stages x data-parallel size.")
@click.option("--tp-size", "tp_size", type=click.IntRange(min=1), default=None,
              help="Tensor-parallel size of the resumed run (default: the input's).")
@click.option("--make-vocab-size-divisible-by", "vocab_divisor", type=click.IntRange(min=1), default=None,
              metavar="D", help="With --tp-size, for a Megatron-style TP checkpoint with a vocabulary: Megatron's "
                                "make_vocab_size_divisible_by, which pads the vocabulary to a multiple of D x TP "
                                "(default: the value its saved args record).")
@click.option("--ep-size", "ep_size", type=click.IntRange(min=1), default=None,
              help="Expert-parallel size (autoep_size) of the resumed run, for DeepSpeed AutoEP checkpoints "
                   "(default: the input's).")
@click.option("--pp-size", "pp_size", type=click.IntRange(min=1), default=None,
              help="Pipeline stages (PipelineModule num_stages) of the resumed run (default: the input's).")
@click.option("--partition-method", "partition_method", default=None, metavar="METHOD",
              help="PipelineModule partition_method the resumed run uses: parameters (DeepSpeed's default), "
                   "uniform or type:REGEX. Gives the new stage boundaries; the input's are checked against it.")
@click.option("--num-layers", "num_layers", type=click.IntRange(min=1), default=None,
              help="Entries in the PipelineModule's layer list, where layers past the last layer_XX file "
                   "(functions, tied uses with a forward_fn) have no file (default: up to the last layer file).")
@click.option("--layer-types", "layer_types", default=None, metavar="NAME,...",
              help="The PipelineModule layers' class names in order, for --partition-method type:REGEX.")
@click.option("--tied-key", "tied_keys", multiple=True, metavar="LAYER=KEY",
              help="For DeepSpeed's own fp32 pipeline save without ZeRO: the TiedLayerSpec key of the tied module "
                   "saved in layer_LAYER-model_states.pt, which no file states (e.g. 0=embed). Repeatable.")
@tag_option
@click.option("--dry-run", is_flag=True, help="Print the plan (which source ranges go to which rank) and exit "
                                             "(1 if there is work).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--verify", "verify", type=click.Choice(["quick", "full", "none"]), default="quick", show_default=True,
              help="Before moving OUT into place, re-open it and compare every stored tensor with the input: "
                   "names, shapes, dtypes and values around every fragment boundary plus samples (quick), "
                   "every value (full: reads input and output once more), or nothing (none).")
@click.option("--no-verify", is_flag=True, help="Same as --verify none.")
@click.option("--no-hf-files", is_flag=True,
              help="For a Hugging Face Trainer or Accelerate save_state folder: write only the DeepSpeed part.")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@click.option("--workers", default=None, type=click.IntRange(1, 64),
              help="Target files written at once (default: half the cores, at most 8).")
@click.option("--zero-stage", "zero_stage", type=click.IntRange(0, 3), default=None,
              help="Write the checkpoint for this ZeRO stage (0 = no ZeRO, 1, 2 or 3; default: the input's).")
@click.option("--sub-group-size", "sub_group_size", type=click.IntRange(min=1), default=None,
              help="ZeRO-3 target: zero_optimization.sub_group_size of the new run (default: the input's "
                   "at stage 3, else DeepSpeed's default 1e9).")
@click.option("--dtype", "dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default=None,
              help="Write the checkpoint for this precision (default: the input's): fp32 masters and optimizer "
                   "state kept exactly, 16-bit copies cast from the masters, the loss scaler DeepSpeed starts for "
                   "it, the bf16_ file prefix as DeepSpeed names the files. The plan says which ds_config "
                   "precision block to resume with.")
@click.option("--loss-scale", "loss_scale", type=float, default=None, metavar="S",
              help="With --dtype fp16 from a bf16 or fp32 run: the new dynamic loss scaler's initial scale "
                   "(default: DeepSpeed's 2**16).")
@click.option("--universal", is_flag=True,
              help="Write DeepSpeed's universal checkpoint folder instead (what ds_to_universal writes: "
                   "OUT/latest_universal and OUT/<tag>_universal/), which DeepSpeed loads on any rank count with "
                   '"checkpoint": {"load_universal": true}. No --world-size.')
@click.option("--no-fsync", is_flag=True,
              help="Do not wait for OUT to reach the disk before renaming it into place. OUT still appears "
                   "complete or not at all, but a power loss or system crash soon after may leave it "
                   "incomplete (the kernel writes it later, as after cp). Faster; the default is durable.")
@distributed_option
@handle_errors
def reshard(ckpt: str, out: str, world_size: int | None, tag: str | None, dry_run: bool, force: bool, verify: str,
            no_verify: bool, no_hf_files: bool, quiet: bool, workers: int | None, zero_stage: int | None,
            sub_group_size: int | None, universal: bool, no_fsync: bool, tp_size: int | None,
            ep_size: int | None, pp_size: int | None, partition_method: str | None, num_layers: int | None,
            layer_types: str | None, tied_keys: tuple[str, ...], vocab_divisor: int | None,
            distributed: bool, dtype: str | None, loss_scale: float | None) -> None:
    """Re-partition a ZeRO checkpoint so that plain engine.load_checkpoint(OUT) works on N ranks
    (and, with --zero-stage, under another ZeRO stage: 0, 1, 2 and 3 from any of them).

    Writes OUT as a new save dir ('latest' + the same tag) with fp32 master weights, Adam moments, step
    counts, loss scaler, scheduler and client state carried over exactly. CKPT is never modified.

    CKPT a Hugging Face Trainer folder (checkpoint-N/): the Trainer's files (trainer_state.json,
    training_args.bin, scheduler/scaler, config, tokenizer, model.safetensors) are copied byte for byte,
    so that Trainer.train(resume_from_checkpoint=OUT) works on N processes. RNG states: rank r keeps old
    rank r's rng_state_r.pth; on 1 process old rank 0's becomes rng_state.pth; new ranks get none (the
    Trainer then keeps its seeded RNG, as it does whenever the file is missing).

    CKPT an Accelerate save_state folder (tag pytorch_model): scheduler*.bin, sampler*.bin and
    custom_checkpoint_*.pkl are copied byte for byte; rank r keeps old rank r's random_states_r.pkl,
    so that accelerator.load_state(OUT) works on N processes.
    """
    from .errors import UsageError
    from .readers import FileCache, read_checkpoint
    from .reshard import (
        describe_plan,
        describe_target_config,
        plan_reshard,
        read_source_facts,
        run_reshard,
        run_reshard_distributed,
    )

    group = _start_distributed(distributed)
    ckpt, _ = _run_folder(ckpt)
    if universal and (dtype is not None or loss_scale is not None):
        raise UsageError("--universal writes fp32 values only (masters and optimizer state), which DeepSpeed loads "
                         "in whatever precision the loading ds_config enables; drop --dtype and --loss-scale")
    if universal:
        if world_size is not None or zero_stage is not None or sub_group_size is not None or tp_size is not None \
                or ep_size is not None or pp_size is not None or partition_method is not None \
                or num_layers is not None or layer_types is not None or vocab_divisor is not None:
            raise UsageError("--universal writes a folder DeepSpeed loads on any rank count, under the input's ZeRO "
                             "stage family; drop --world-size, --zero-stage, --sub-group-size, --tp-size, "
                             "--ep-size, --pp-size, --partition-method, --num-layers, --layer-types and "
                             "--make-vocab-size-divisible-by")
        _reshard_universal(ckpt, out, tag, dry_run=dry_run, force=force, verify="none" if no_verify else verify,
                           quiet=quiet, workers=workers, fsync=not no_fsync, group=group,
                           tied_keys=_parse_tied_keys(tied_keys))
        return
    if world_size is None:
        raise UsageError("missing option '--world-size' / '-n' (or write a universal checkpoint with --universal)")
    cache = FileCache()
    logical = read_checkpoint(ckpt, tag=tag, cache=cache, check_master_copies=True,
                              tied_keys=_parse_tied_keys(tied_keys))
    plan = plan_reshard(logical, world_size, zero_stage=zero_stage, sub_group_size=sub_group_size,
                        facts=read_source_facts(logical, cache), hf_files=not no_hf_files, tp_size=tp_size,
                        ep_size=ep_size, pp_size=pp_size, partition_method=partition_method, num_layers=num_layers,
                        layer_types=layer_types.split(",") if layer_types else None,
                        make_vocab_size_divisible_by=vocab_divisor, dtype=dtype, loss_scale=loss_scale)
    if dry_run:
        click.echo("\n".join(describe_plan(plan)))
        sys.exit(1 if plan.has_work else 0)
    if not plan.has_work and not quiet:
        click.echo(f"dsckpt: note: '{ckpt}' already has data-parallel size {world_size}; writing a copy", err=True)

    def tick(path: Any) -> None:
        if not quiet:
            click.echo(f"  wrote {path.name}", err=True)

    mode = "none" if no_verify else verify
    if group is not None:
        result = run_reshard_distributed(plan, out, group, cache=cache, force=force, verify=mode, on_file=tick,
                                         workers=workers, fsync=not no_fsync)
    else:
        result = run_reshard(plan, out, cache=cache, force=force, verify=mode, on_file=tick, workers=workers,
                             fsync=not no_fsync)
    verified = ("" if mode == "none" else
                f", verified {result.verified_tensors} tensors against the input ({mode})")
    stages = f", ZeRO stage {plan.from_stage} -> {plan.zero_stage}" if plan.changes_layout else ""
    if plan.changes_layout and plan.from_stage == plan.zero_stage:  # the wrapper only (--dtype: BF16_Optimizer)
        stages = f", {plan.from_wrapper} -> {plan.optimizer_wrapper}"
    if plan.precision_change is not None:
        stages += f", {plan.precision.value} -> {plan.written_precision.value}"
    if plan.parallel.stages is not None:
        tp = ((f"TP {plan.source_tp_size} x ", f"TP {plan.tp_size} x ") if max(plan.source_tp_size, plan.tp_size) > 1
              else ("", ""))
        stages = (f" (PP {plan.source_pp_size} x {tp[0]}DP {plan.source_world_size} -> PP {plan.pp_size} x {tp[1]}DP "
                  f"{plan.world_size})") + stages
    elif plan.tp_size > 1 or plan.source_tp_size > 1:
        stages = (f" (TP {plan.source_tp_size} x DP {plan.source_world_size} -> TP {plan.tp_size} x DP "
                  f"{plan.world_size})") + stages
    if plan.parallel.ep_size is not None and logical.autoep is not None:
        stages = f" (expert-parallel size {logical.autoep.ep_size} -> {plan.parallel.ep_size})" + stages
    elif plan.parallel.ep_size is not None and logical.moe is not None:
        stages = (f" (expert-parallel size {', '.join(map(str, logical.moe.ep_sizes))} -> {plan.parallel.ep_size})"
                  + stages)
    click.echo(f"resharded {plan.source_tag_dir} from {plan.source_total_world_size} to {world_size} ranks{stages}: "
               f"wrote {len(result.files)} files to {result.output}/{result.tag}{verified}{_not_synced(no_fsync)}")
    if plan.changes_layout or plan.precision_change is not None:
        click.echo("resume with: " + describe_target_config(plan))
    from .ds_writers import STAGE0_BF16_PIPELINE_NOTE

    if STAGE0_BF16_PIPELINE_NOTE in plan.notes:
        click.echo('resume with: "zero_optimization": {"stage": 1} and "data_types": {"grad_accum_dtype": "fp32"} '
                   "(BF16_Optimizer, as the stage-0 run used; DeepSpeed 0.19.8 cannot resume a stage-0 bf16 pipeline "
                   "save)")
    if plan.parallel.stages is not None and plan.parallel.stages.target is not None:
        layout = (f"topology=PipeModelDataParallelTopology(num_pp={plan.pp_size}, num_mp={plan.tp_size}, "
                  f"num_dp={plan.world_size})" if plan.tp_size > 1 else f"num_stages={plan.pp_size}")
        click.echo(f"resume with: PipelineModule(..., {layout}, partition_method="
                   f"'{plan.parallel.stages.target.method}') on {plan.total_world_size} ranks")
    if plan.hf_files is not None:
        click.echo(f"copied {len(result.hf_files)} {plan.hf_files.client} file(s) from {plan.hf_files.folder}: "
                   + ", ".join(p.name for p in result.hf_files))
        if not quiet:
            for o in plan.hf_files.left_out:
                if o.source is None and o.role.value != "rng":
                    click.echo(f"dsckpt: warning: {o.reason}", err=True)


def _not_synced(no_fsync: bool) -> str:
    return "; not fsync'd (--no-fsync): run sync before relying on it after a crash" if no_fsync else ""


def _reshard_universal(ckpt: str, out: str, tag: str | None, *, dry_run: bool, force: bool, verify: str, quiet: bool,
                       workers: int | None, fsync: bool = True, group: Any = None,
                       tied_keys: dict[int, str] | None = None) -> None:
    from .readers import FileCache, read_checkpoint
    from .reshard import (
        plan_universal_reshard,
        read_source_facts,
        run_universal,
        run_universal_distributed,
    )

    cache = FileCache()
    logical = read_checkpoint(ckpt, tag=tag, cache=cache, check_master_copies=True, tied_keys=tied_keys)
    plan = plan_universal_reshard(logical, read_source_facts(logical, cache))
    if dry_run:
        click.echo("\n".join(plan.describe()))
        sys.exit(1)

    def tick(path: Any) -> None:
        if not quiet:
            click.echo(f"  wrote {path.parent.name}/{path.name}" if path.parent.name != plan.out_tag else
                       f"  wrote {path.name}", err=True)

    if group is not None:
        result = run_universal_distributed(plan, out, group, cache=cache, force=force, verify=verify, on_file=tick,
                                           workers=workers, fsync=fsync)
    else:
        result = run_universal(plan, out, cache=cache, force=force, verify=verify, on_file=tick, workers=workers,
                               fsync=fsync)
    verified = "" if verify == "none" else f", verified {result.verified_tensors} tensors against the input ({verify})"
    click.echo(f"wrote universal checkpoint of {plan.source_tag_dir} ({plan.source_world_size} ranks, ZeRO stage "
               f"{plan.source_stage}): {len(result.files)} files to {result.output}/{plan.out_tag}, latest_universal"
               f"{verified}{_not_synced(not fsync)}")
    click.echo(f'load with: "checkpoint": {{"load_universal": true}} and ZeRO stage '
               f"{'3' if plan.zero3 else '1 or 2'}, any data-parallel size; engine.load_checkpoint('{result.output}')")
    click.echo("note: DeepSpeed's universal loader does not restore buffers (BatchNorm statistics) or frozen params; "
               "they are in the folder (to-fp32 reads them) but the new engine keeps its own")


if __name__ == "__main__":  # pragma: no cover
    main()
