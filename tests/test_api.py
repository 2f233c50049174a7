"""The Python API keeps its word (issue 43 item 4): what docs/api.md shows works, and what it ever showed still does.

* **What the page shows now**, found by parsing docs/api.md (so a name added to or removed from the page later is
  covered without touching this file): every ``::: dsckpt.X`` reference, every ``import`` and every call of a
  dsckpt function or method in its Python blocks (the arguments shown bind to the signature; a variable holding a
  documented function's result has that function's return type, so ``ckpt.tensor(..., state=...)`` is checked
  against ``Checkpoint.tensor``), and every name in its prose: a dotted or called name (``dsckpt.scan.run_scan()``,
  ``TensorEntry.state_piece(key)``, ``plan_to_fp32(..., hf_files=True)``) or a class name must resolve, with the
  keywords shown accepted; a bare lower-case word must be a dsckpt name, an attribute of a class named in the same
  paragraph, or one of the values in ``VALUES``. (test_docs.py runs the page's Python example and compares its output.)
* **What the pages rendered** (``:::`` targets: functions, and classes with their members) is recorded in
  tests/api_surface.json, the union of every version published since 0.1.0 (recorded from the git history when this
  test was written). A recorded name, parameter or enum member must still be accepted, positional parameters keep
  their order (constructors of the records aside: readers build them), and no new required parameter appears;
  a name now served by a deprecated alias must be in ``DEPRECATED``. A name the page renders that the record lacks
  fails too, until ``python tests/test_api.py --record`` adds it, so the record grows with the API.
* **Every deprecated name** (found by its ``@deprecated`` marker anywhere in dsckpt) has a case in ``DEPRECATED``:
  using it warns with a ``DeprecationWarning`` naming its replacement, gives what the replacement gives on a real
  DeepSpeed 0.19.8 fixture, and its removal version is still ahead of the package version.
"""

from __future__ import annotations

import ast
import builtins
import enum
import importlib
import inspect
import json
import pkgutil
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import dsckpt

REPO = Path(__file__).resolve().parent.parent
API_PAGE = REPO / "docs" / "api.md"
RECORD = Path(__file__).with_name("api_surface.json")
FIXTURES = Path(__file__).with_name("fixtures")

#: Bare lower-case words in docs/api.md's prose that are values, not names of the API (optimizer state keys).
VALUES = {"exp_avg", "exp_avg_sq", "momentum_buffer"}


# ------------------------------------------------------------------------------------------------------------------
# Finding dsckpt's names


def _modules() -> dict[str, Any]:
    """Every module of the package by dotted name (``__main__`` aside: importing it runs the CLI)."""
    found = {"dsckpt": dsckpt}
    for info in pkgutil.walk_packages(dsckpt.__path__, "dsckpt."):
        if not info.name.endswith("__main__"):
            found[info.name] = importlib.import_module(info.name)
    return found


MODULES = _modules()


def _definitions() -> dict[str, list[Any]]:
    """Public classes and functions by bare name, each from the module that defines it."""
    defs: dict[str, list[Any]] = {}
    for name, mod in MODULES.items():
        for attr, obj in vars(mod).items():
            if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)) \
                    and getattr(obj, "__module__", None) == name:
                defs.setdefault(attr, []).append(obj)
    return defs


DEFINITIONS = _definitions()


def _walk(obj: Any, parts: list[str]) -> Any:
    for p in parts:
        obj = getattr(obj, p)
    return obj


def resolve(dotted: str, context: tuple[str, ...] = ()) -> Any:
    """The object ``dotted`` names as the page would be read: an absolute ``dsckpt.x.y``; a name of a module the
    same paragraph names (``context``: ``dsckpt.scan.prepare_scan() + run_scan()``, ``scan(path)``); a name of
    ``dsckpt``; a module of the package by its short name (``parsed_tree.finish_checks``); a class or function
    defined in exactly one module. Raises LookupError (AttributeError for a missing attribute of what resolved);
    a deprecated name raises its DeprecationWarning."""
    parts = dotted.split(".")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the page must not show a deprecated name
        if parts[0] == "dsckpt":
            for i in range(len(parts), 0, -1):
                if ".".join(parts[:i]) in MODULES:
                    return _walk(MODULES[".".join(parts[:i])], parts[i:])
        for mod in (*context, "dsckpt"):
            found = getattr(MODULES[mod], parts[0], None)
            if found is not None and not inspect.ismodule(found):
                return _walk(found, parts[1:])
        short = [m for m in MODULES if m.rsplit(".", 1)[-1] == parts[0]]
        if len(short) == 1:
            return _walk(MODULES[short[0]], parts[1:])
        if len(DEFINITIONS.get(parts[0], ())) == 1:
            return _walk(DEFINITIONS[parts[0]][0], parts[1:])
        if hasattr(builtins, parts[0]):  # DeprecationWarning, KeyError: Python's own
            return _walk(getattr(builtins, parts[0]), parts[1:])
    raise LookupError(f"{dotted!r} names nothing in dsckpt")


# ------------------------------------------------------------------------------------------------------------------
# Reading docs/api.md


@dataclass(frozen=True)
class Mention:
    """A name the page shows: where, the text, and for a call its arguments (``None`` for a bare reference)."""

    line: int
    text: str
    name: str
    call: ast.Call | None
    context: tuple[str, ...]  # dsckpt modules the same paragraph names
    classes: tuple[str, ...]  # class names the same paragraph mentions


_FENCE = re.compile(r"^\s*(```+|~~~+)\s*(\w*)")
_SPAN = re.compile(r"`([^`\n]+)`")
_NAME = re.compile(r"^[A-Za-z_][\w.]*$")


def _paragraphs(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str, str]]]:
    """The prose paragraphs ``(first line, text)`` and code blocks ``(first line, language, source)`` of a page."""
    prose: list[tuple[int, str]] = []
    blocks: list[tuple[int, str, str]] = []
    lines = text.split("\n")
    i, para, start = 0, [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m:
            if para:
                prose.append((start, "\n".join(para)))
                para = []
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith(m.group(1)):
                j += 1
            blocks.append((i + 2, m.group(2), "\n".join(lines[i + 1:j])))
            i = j + 1
            continue
        if lines[i].strip():
            if not para:
                start = i + 1
            para.append(lines[i])
        elif para:
            prose.append((start, "\n".join(para)))
            para = []
        i += 1
    if para:
        prose.append((start, "\n".join(para)))
    return prose, blocks


def prose_mentions(text: str) -> list[Mention]:
    """Every inline code span of the page's prose that names something (see the module docstring)."""
    found: list[Mention] = []
    for line, para in _paragraphs(text)[0]:
        if para.startswith("::: "):
            target = para[4:].strip()
            found.append(Mention(line, para, target, None, (), ()))
            continue
        spans = _SPAN.findall(para)
        context = tuple(dict.fromkeys(m for s in spans for m in MODULES
                                      if m != "dsckpt" and re.search(rf"\b{re.escape(m)}\b", s)))
        classes = tuple(s.split(".")[0].split("(")[0] for s in spans if s[:1].isupper())
        for span in spans:
            head, paren, _ = span.partition("(")
            if not _NAME.match(head) or (paren and not span.endswith(")")):
                continue  # a command line, a path, a tuple of words, an option
            call = None
            if paren and span != f"{head}()":
                call = ast.parse(span.replace("...", "_ellipsis_"), mode="eval").body
                assert isinstance(call, ast.Call), span
            found.append(Mention(line, span, head, call, context, classes))
    return found


def _return_class(fn: Any) -> type | None:
    """The dsckpt class ``fn`` is annotated to return (annotations are strings here: ``from __future__``)."""
    ann = inspect.signature(fn).return_annotation
    if isinstance(ann, str):
        ann = getattr(fn, "__globals__", {}).get(ann) or (DEFINITIONS.get(ann) or [None])[0]
    return ann if inspect.isclass(ann) and ann.__module__.startswith("dsckpt") else None


def code_mentions(text: str) -> list[Mention]:
    """Every dsckpt import of the page's Python blocks, and every call through an imported name or through a
    variable holding a documented function's result (its return annotation gives the class)."""
    found: list[Mention] = []
    imported: dict[str, str] = {}  # local name -> dotted dsckpt name
    for line, lang, source in _paragraphs(text)[1]:
        if lang not in ("python", "py"):
            continue
        tree = ast.parse(source)
        variables: dict[str, str] = {}  # variable -> dotted name of its class
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dsckpt":
                for a in node.names:
                    imported[a.asname or a.name] = f"{node.module}.{a.name}"
                    found.append(Mention(line + node.lineno - 1, ast.unparse(node), f"{node.module}.{a.name}",
                                         None, (), ()))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name) and isinstance(node.value.func, ast.Name) \
                    and node.value.func.id in imported:
                returns = _return_class(resolve(imported[node.value.func.id]))
                if returns is not None:
                    variables[node.targets[0].id] = f"{returns.__module__}.{returns.__qualname__}"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id in imported:
                name = imported[f.id]
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in variables:
                name = f"{variables[f.value.id]}.{f.attr}"
            else:
                continue
            found.append(Mention(line + node.lineno - 1, ast.unparse(node), name, node, (), ()))
    return found


def _unbound_method(owner: Any, obj: Any, attr: str) -> bool:
    return inspect.isclass(owner) and inspect.isfunction(obj) \
        and not isinstance(inspect.getattr_static(owner, attr), staticmethod)


def check_call(obj: Any, call: ast.Call, owner: Any = None, attr: str = "") -> str | None:
    """Why the arguments of ``call`` would not bind to ``obj``'s signature (None: they bind). ``...`` among the
    positional arguments stands for any others (``plan_to_fp32(..., hf_files=True)``)."""
    if inspect.ismodule(obj):
        return "is a module, not something to call"
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    positional = [a for a in call.args if not (isinstance(a, ast.Name) and a.id == "_ellipsis_")]
    open_ended = len(positional) != len(call.args) or any(isinstance(a, ast.Starred) for a in call.args)
    keywords = [k.arg for k in call.keywords if k.arg is not None]
    params = sig.parameters
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in keywords if (k not in params or params[k].kind is inspect.Parameter.POSITIONAL_ONLY)
               and not has_var_kw]
    if unknown:
        return f"takes no keyword {', '.join(unknown)} (signature {sig})"
    if open_ended:
        return None
    self_ = [None] if _unbound_method(owner, obj, attr) else []
    try:
        sig.bind(*self_, *[None] * len(positional), **dict.fromkeys(keywords))
    except TypeError as e:
        return f"does not take the arguments shown: {e} (signature {sig})"
    return None


def _has_attribute(cls: Any, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: a class attribute, a dataclass field, or set in ``__init__``."""
    if not inspect.isclass(cls):
        return False
    if hasattr(cls, name) or (is_dataclass(cls) and name in {f.name for f in fields(cls)}):
        return True
    try:
        return re.search(rf"\bself\.{re.escape(name)}\s*[:=]", inspect.getsource(cls.__init__)) is not None
    except (TypeError, OSError):
        return False


def _owner_and_attr(m: Mention) -> tuple[Any, str]:
    if "." not in m.name:
        return None, ""
    head, attr = m.name.rsplit(".", 1)
    try:
        return resolve(head, m.context), attr
    except (LookupError, AttributeError):
        return None, ""


def test_every_name_the_api_page_shows_resolves_and_takes_the_arguments_shown() -> None:
    text = API_PAGE.read_text(encoding="utf-8")
    mentions = prose_mentions(text) + code_mentions(text)
    problems = []
    checked = 0
    for m in mentions:
        where = f"docs/api.md:{m.line}: `{m.text}`"
        bare = "." not in m.name and m.call is None and not m.name[:1].isupper()
        try:
            obj = resolve(m.name, m.context)
        except (LookupError, AttributeError) as e:
            if bare and (m.name in VALUES or any(_has_attribute(c, m.name) for k in m.classes
                                                 for c in DEFINITIONS.get(k, [])[:1])):
                continue
            if bare and m.name not in VALUES:
                problems.append(f"{where}: neither a dsckpt name, an attribute of a class named beside it "
                                f"({', '.join(m.classes) or 'none'}), nor one of test_api.VALUES ({e})")
            else:
                problems.append(f"{where}: {e}")
            continue
        except DeprecationWarning as w:
            problems.append(f"{where}: a deprecated name ({w})")
            continue
        checked += 1
        if m.call is not None:
            owner, attr = _owner_and_attr(m)
            why = check_call(obj, m.call, owner, attr)
            if why:
                problems.append(f"{where}: {m.name} {why}")
    assert not problems, "docs/api.md shows names the code does not keep:\n" + "\n".join(problems)
    # the parser found the page's names (a parser that finds nothing would pass anything)
    assert checked >= 40, checked
    names = {m.name for m in mentions}
    assert {"dsckpt.open_checkpoint", "dsckpt.model.Role", "dsckpt.checkpoint.Checkpoint.tensor",
            "parsed_tree.finish_checks", "plan_to_fp32"} <= names, names


def test_the_page_parser_catches_a_renamed_name_and_a_dropped_keyword() -> None:
    """A control: the checks above fail on the breaks they exist for."""
    page = ("Use `dsckpt.scan.prepare_scanner()`, `TensorEntry.state_pieces_of(key)` and\n"
            "`plan_to_fp32(..., hf_file=True)`; `Checkpoint` has `logicals`.\n\n"
            "```python\nfrom dsckpt import open_checkpoint\nckpt = open_checkpoint('x')\n"
            "ckpt.tensor('a', stat='exp_avg')\n```\n")
    failures = []
    for m in prose_mentions(page) + code_mentions(page):
        try:
            obj = resolve(m.name, m.context)
        except (LookupError, AttributeError):
            failures.append(m.name)
            continue
        if m.call is not None and check_call(obj, m.call, *_owner_and_attr(m)):
            failures.append(m.name)
    assert failures == ["dsckpt.scan.prepare_scanner", "TensorEntry.state_pieces_of", "plan_to_fp32", "logicals",
                        "dsckpt.checkpoint.Checkpoint.tensor"], failures


# ------------------------------------------------------------------------------------------------------------------
# The rendered surface, recorded


def _params(obj: Any, drop_self: bool) -> list[str] | None:
    """A signature as recorded: ``name`` (positional or keyword), ``pos:name``, ``kw:name``, ``*args``,
    ``**kwargs``; required parameters carry ``!`` (``name!``)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    out = []
    for i, p in enumerate(sig.parameters.values()):
        if drop_self and i == 0:
            continue
        prefix = {p.POSITIONAL_ONLY: "pos:", p.KEYWORD_ONLY: "kw:", p.VAR_POSITIONAL: "*",
                  p.VAR_KEYWORD: "**"}.get(p.kind, "")
        required = p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        out.append(f"{prefix}{p.name}{'!' if required else ''}")
    return out


def _members(cls: type) -> dict[str, Any]:
    """Public members a class defines in dsckpt (inherited from torch, Exception or Enum aside)."""
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("dsckpt"):
            continue
        for attr, raw in vars(klass).items():
            if attr.startswith("_") or (issubclass(cls, enum.Enum) and attr in cls.__members__):
                continue
            if isinstance(raw, property):
                out[attr] = "property"
            elif isinstance(raw, (staticmethod, classmethod)):
                out[attr] = _params(getattr(cls, attr), False)
            elif inspect.isfunction(raw):
                out[attr] = _params(raw, True)
            else:
                out[attr] = "attribute"
    if is_dataclass(cls):
        for f in fields(cls):
            out.setdefault(f.name, "attribute")
    return out


def rendered_targets() -> list[str]:
    return re.findall(r"^::: (dsckpt[\w.]*)\s*$", API_PAGE.read_text(encoding="utf-8"), flags=re.M)


def surface() -> dict[str, Any]:
    """What the page's ``:::`` references render, as recorded in tests/api_surface.json."""
    out: dict[str, Any] = {}
    for target in rendered_targets():
        obj = resolve(target)
        if inspect.isclass(obj):
            entry: dict[str, Any] = {"members": _members(obj)}
            if issubclass(obj, enum.Enum):
                entry["enum"] = list(obj.__members__)
            else:
                entry["init"] = _params(obj, False)
            out[target] = entry
        else:
            out[target] = {"params": _params(obj, False)}
    return out


def _merge(old: Any, new: Any) -> Any:
    """The union of two recorded surfaces (names kept in first-seen order)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {k: _merge(old[k], new[k]) if k in old and k in new else old.get(k, new.get(k))
                for k in {**old, **new}}
    if isinstance(old, list) and isinstance(new, list):
        plain = {p.rstrip("!") for p in old}
        return old + [p for p in new if p.rstrip("!") not in plain]
    return new if old is None else old


def _name(p: str) -> str:
    return p.split(":")[-1].lstrip("*").rstrip("!")


def signature_breaks(where: str, recorded: list[str] | None, now: list[str] | None, *, ordered: bool) -> list[str]:
    """How a call written against ``recorded`` would fail against ``now``."""
    if recorded is None or now is None:
        return [] if recorded == now else [f"{where}: signature {recorded} -> {now}"]
    out = []
    by_name = {_name(p): p for p in now}
    var_kw = any(p.startswith("**") for p in now)
    var_pos = any(p.startswith("*") and not p.startswith("**") for p in now)
    rec_positional = [_name(p) for p in recorded if not p.startswith(("kw:", "*"))]
    now_positional = [_name(p) for p in now if not p.startswith(("kw:", "*"))]
    for p in recorded:
        n = _name(p)
        if p.startswith("*"):
            if p.startswith("**") and not var_kw or not p.startswith("**") and not var_pos:
                out.append(f"{where}: no longer takes {p}")
        elif n not in by_name:
            if not (var_kw and not p.startswith("pos:")):
                out.append(f"{where}: parameter {n!r} removed")
        elif by_name[n].startswith("kw:") and not p.startswith("kw:"):
            out.append(f"{where}: {n!r} became keyword-only")
        elif by_name[n].startswith("pos:") and not p.startswith("pos:"):
            out.append(f"{where}: {n!r} became positional-only")
    if ordered and now_positional[:len(rec_positional)] != rec_positional:
        out.append(f"{where}: positional parameters {rec_positional} -> {now_positional}")
    recorded_names = {_name(p) for p in recorded}
    out += [f"{where}: new required parameter {_name(p)!r}" for p in now
            if p.endswith("!") and _name(p) not in recorded_names]
    return out


def surface_breaks(record: dict[str, Any], now: dict[str, Any],
                   objects: Callable[[str], Any] = resolve) -> list[str]:
    """How code written against ``record`` would break against ``now`` (``objects`` gives a rendered target's
    object, where a name no longer rendered may still be served by a deprecated alias)."""
    problems = []
    for target, rec in record.items():
        if target not in now:
            problems.append(f"{target}: no longer rendered by docs/api.md (or removed)")
            continue
        cur = now[target]
        if "params" in rec:
            problems += signature_breaks(target, rec["params"], cur.get("params"), ordered=True)
        if "init" in rec:
            # the records' constructors: readers build them, so only names and required-ness are kept
            problems += signature_breaks(f"{target}()", rec["init"], cur.get("init"), ordered=False)
        for member in rec.get("enum", []):
            if member not in cur.get("enum", []):
                problems += _kept_by_a_deprecated_alias(objects(target), member, f"{target}.{member}")
        for member, sig in rec.get("members", {}).items():
            if member not in cur["members"]:
                problems += _kept_by_a_deprecated_alias(objects(target), member, f"{target}.{member}")
            elif isinstance(sig, list):
                problems += signature_breaks(f"{target}.{member}", sig, cur["members"][member], ordered=True)
    return problems


def test_the_rendered_surface_keeps_every_recorded_name() -> None:
    record = json.loads(RECORD.read_text(encoding="utf-8"))
    now = surface()
    problems = surface_breaks(record, now)
    assert not problems, ("a name docs/api.md has published is gone or changed (keep it, or keep a deprecated "
                          "alias with a case in DEPRECATED):\n" + "\n".join(problems))
    unrecorded = _diff_names(now, record)
    assert not unrecorded, (f"docs/api.md renders names tests/api_surface.json does not hold yet: {unrecorded}; "
                            "record them: python tests/test_api.py --record")


def test_the_record_check_finds_a_removed_member_parameter_and_enum_member() -> None:
    """A control: the record of what 0.1.0 published (Role.EXP_AVG a member) against surfaces that broke it."""
    record = json.loads(RECORD.read_text(encoding="utf-8"))
    assert record["dsckpt.Role"]["enum"] == ["MASTER", "MODULE", "EXP_AVG", "EXP_AVG_SQ", "OPTIM_STATE"]
    now = surface()
    broken = json.loads(json.dumps(now))
    del broken["dsckpt.Checkpoint"]["members"]["finish_checks"]
    broken["dsckpt.Checkpoint"]["members"]["tensor"].remove("kw:state")
    broken["dsckpt.to_fp32"]["params"].insert(0, "source!")

    class RoleWithoutAliases(enum.Enum):
        MASTER = "master"

    objects = {"dsckpt.Role": RoleWithoutAliases, "dsckpt.Checkpoint": dsckpt.Checkpoint}
    got = surface_breaks(record, broken, objects.__getitem__)
    # Checkpoint.finish_checks still answers (the real class), as a deprecated alias would, but has no case
    assert sorted(got) == sorted([
        "dsckpt.Checkpoint.finish_checks: now an alias without a case in test_api.DEPRECATED",
        "dsckpt.Checkpoint.tensor: parameter 'state' removed",
        "dsckpt.to_fp32: positional parameters ['checkpoint', 'output'] -> ['source', 'checkpoint', 'output']",
        "dsckpt.to_fp32: new required parameter 'source'",
        "dsckpt.Role.EXP_AVG: removed", "dsckpt.Role.EXP_AVG_SQ: removed",
    ]), got
    assert surface_breaks(record, now) == []


def _kept_by_a_deprecated_alias(obj: Any, member: str, where: str) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        kept = hasattr(obj, member)
    if not kept:
        return [f"{where}: removed"]
    if not any(c.old == where for c in DEPRECATED):
        return [f"{where}: now an alias without a case in test_api.DEPRECATED"]
    return []


def _diff_names(now: Any, record: Any, where: str = "") -> list[str]:
    if isinstance(now, dict):
        return [x for k, v in now.items()
                for x in ([f"{where}{k}"] if k not in record else _diff_names(v, record[k], f"{where}{k}."))]
    if isinstance(now, list) and isinstance(record, list):
        have = {_name(p) for p in record}
        return [f"{where}{_name(p)}" for p in now if _name(p) not in have]
    return []


def test_signature_breaks_finds_each_kind_of_break() -> None:
    """A control for the record check: each way a documented call breaks is found, and a compatible change is not."""
    rec = ["path!", "kw:tag", "kw:check"]
    assert signature_breaks("f", rec, ["path!", "kw:tag", "kw:check", "kw:new"], ordered=True) == []
    assert signature_breaks("f", rec, ["path!", "kw:tag", "**kwargs"], ordered=True) == []
    assert signature_breaks("f", rec, ["path!", "kw:tag"], ordered=True) == ["f: parameter 'check' removed"]
    assert signature_breaks("f", rec, ["src!", "kw:tag", "kw:check"], ordered=True) == [
        "f: parameter 'path' removed", "f: positional parameters ['path'] -> ['src']",
        "f: new required parameter 'src'"]
    assert signature_breaks("f", ["a!", "b"], ["b", "a!"], ordered=True) == [
        "f: positional parameters ['a', 'b'] -> ['b', 'a']"]
    assert signature_breaks("f", ["a!", "b"], ["b", "a!"], ordered=False) == []
    assert signature_breaks("f", ["a!", "b"], ["a!", "kw:b"], ordered=True) == [
        "f: 'b' became keyword-only", "f: positional parameters ['a', 'b'] -> ['a']"]
    assert signature_breaks("f", ["a!"], ["a!", "kw:b!"], ordered=True) == ["f: new required parameter 'b'"]


# ------------------------------------------------------------------------------------------------------------------
# Deprecated names


@dataclass(frozen=True)
class Deprecated:
    """A name a release published and a later one replaced: how 0.1.0's docs used it, and the replacement's call."""

    old: str  # as the record and the messages name it
    replacement: str  # text the warning must contain
    use_old: Callable[[], Any]
    use_new: Callable[[], Any]


S2 = FIXTURES / "s2_bf16_w2_2groups" / "ckpt"  # docs/api.md's own example checkpoint (ZeRO-2 bf16, Adam)
PADDED = FIXTURES / "autotp" / "megatron_z1_bf16_tp2_dp1" / "ckpt"  # a padded TP vocabulary: optimizer padding


def _ckpt(path: Path) -> Any:
    return dsckpt.open_checkpoint(path)


def _role(name: str) -> Any:
    return getattr(dsckpt.Role, name)


def _tree() -> Any:
    """A parsed optimizer file of the fixture with every tensor read once (so each record has a check to finish)."""
    from dsckpt import parsed_tree, safe_load

    tree = safe_load.load(next((S2 / "global_step3").glob("*optim_states.pt")))
    for _, ref in parsed_tree.walk_tensors(tree):
        ref.read_numpy()
    return tree


DEPRECATED = [
    Deprecated("dsckpt.Role.EXP_AVG", 'ckpt.tensor(name, state="exp_avg")',
               lambda: _ckpt(S2).tensor("fc1.weight", role=_role("EXP_AVG")),
               lambda: _ckpt(S2).tensor("fc1.weight", state="exp_avg")),
    Deprecated("dsckpt.Role.EXP_AVG_SQ", 'ckpt.tensor(name, state="exp_avg_sq")',
               lambda: _ckpt(S2).tensor("fc1.weight", role=_role("EXP_AVG_SQ")),
               lambda: _ckpt(S2).tensor("fc1.weight", state="exp_avg_sq")),
    Deprecated("dsckpt.safe_load.finish_checks", "dsckpt.parsed_tree.finish_checks(tree)",
               lambda: MODULES["dsckpt.safe_load"].finish_checks(_tree()),
               lambda: MODULES["dsckpt.parsed_tree"].finish_checks(_tree())),
]

#: Where else a deprecated alias is taken, each against its replacement (the DeprecationWarning comes from naming it).
ALIAS_USES = {
    "TensorEntry.piece": (lambda e: e.piece(_role("EXP_AVG_SQ")), lambda e: e.state_piece("exp_avg_sq")),
    "TensorEntry.padding_piece": (lambda e: e.padding_piece(_role("EXP_AVG")),
                                  lambda e: e.padding_piece(dsckpt.Role.OPTIM_STATE, state_key="exp_avg")),
}


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def _deprecated_objects() -> dict[str, str]:
    """Every object in dsckpt marked ``@deprecated`` (PEP 702), by a name, with its message."""
    found: dict[str, str] = {}
    for modname, mod in MODULES.items():
        for attr, obj in vars(mod).items():
            if attr.startswith("_"):
                continue
            if getattr(obj, "__deprecated__", None) and getattr(obj, "__module__", None) == modname:
                found[f"{modname}.{attr}"] = obj.__deprecated__
            if inspect.isclass(obj) and obj.__module__ == modname:
                for klass in (obj, type(obj)):
                    for name, raw in vars(klass).items():
                        fn = raw.fget if isinstance(raw, property) else raw
                        if getattr(fn, "__deprecated__", None):
                            found[f"{modname}.{attr}.{name}"] = fn.__deprecated__
    return found


def test_every_deprecated_name_has_a_case_and_a_removal_still_ahead() -> None:
    found = _deprecated_objects()
    cases = {c.old.rsplit(".", 1)[-1]: c for c in DEPRECATED}
    assert sorted(n.rsplit(".", 1)[-1] for n in found) == sorted(cases), (found, cases)
    version = _version_tuple(dsckpt.__version__)
    for name, message in found.items():
        m = re.search(r"deprecated since dsckpt (\S+) and will be removed in (\S+):", message)
        assert m, f"{name}: the message must say since when and until when: {message!r}"
        assert _version_tuple(m.group(1)) <= version < _version_tuple(m.group(2)), (
            f"{name}: deprecated in {m.group(1)}, to be removed in {m.group(2)}; the package is {dsckpt.__version__}: "
            "remove it (and say so in CHANGELOG.md) or move the removal")
        case = cases[name.rsplit(".", 1)[-1]]
        assert case.replacement in message and case.old.split("dsckpt.")[-1] in message, (case, message)


@pytest.mark.parametrize("case", DEPRECATED, ids=[c.old for c in DEPRECATED])
def test_a_deprecated_name_warns_and_gives_what_its_replacement_gives(case: Deprecated) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the replacement itself warns of nothing
        new = case.use_new()
    with pytest.warns(DeprecationWarning, match=re.escape(case.replacement)) as caught:
        old = case.use_old()
    assert len([w for w in caught if w.category is DeprecationWarning]) == 1
    assert caught[0].filename == __file__  # the warning points at the caller's line, not at dsckpt
    assert "is deprecated since dsckpt 0.2.0 and will be removed in 0.3.0" in str(caught[0].message)
    if isinstance(new, torch.Tensor):
        assert old.dtype == new.dtype and torch.equal(old, new) and new.abs().sum() > 0
    else:
        assert old == new and new > 0


@pytest.mark.parametrize("use", list(ALIAS_USES), ids=list(ALIAS_USES))
def test_a_deprecated_role_works_where_0_1_0_took_a_role(use: str) -> None:
    old_call, new_call = ALIAS_USES[use]
    entry = _ckpt(PADDED).logical.entry("embed.weight")
    expected = new_call(entry)
    with pytest.warns(DeprecationWarning, match="Role.EXP_AVG"):
        got = old_call(entry)
    assert expected is not None and got is expected


OLD_SNIPPET = '''
from dsckpt import open_checkpoint
from dsckpt.model import Role

ckpt = open_checkpoint(CKPT)
exp_avg = ckpt.tensor("fc1.weight", role=Role.EXP_AVG)   # Adam moment, consolidated
lowp = ckpt.tensor("fc1.weight", role=Role.MODULE)        # the saved 16-bit copy
'''


def test_the_0_1_0_docs_example_still_runs() -> None:
    """docs/api.md of 0.1.0 (README's "Library" section before it), word for word, on the same fixture: the moment it
    reads is the one ``state="exp_avg"`` reads, and the warning points at its line."""
    scope: dict[str, Any] = {"CKPT": str(S2)}
    with pytest.warns(DeprecationWarning, match=r'Role\.EXP_AVG is deprecated .*state="exp_avg"') as caught:
        exec(compile(OLD_SNIPPET, "old_docs_example.py", "exec"), scope)
    assert [(w.filename, w.lineno) for w in caught if w.category is DeprecationWarning] == [("old_docs_example.py", 6)]
    ckpt = dsckpt.open_checkpoint(S2)
    assert torch.equal(scope["exp_avg"], ckpt.tensor("fc1.weight", state="exp_avg"))
    assert scope["lowp"].dtype == torch.bfloat16


def test_deprecated_roles_are_not_members() -> None:
    """Iterating Role, looking a value up and the members' names stay the three real ones."""
    Role = dsckpt.Role
    assert [r.name for r in Role] == ["MASTER", "MODULE", "OPTIM_STATE"] == list(Role.__members__)
    with pytest.raises(ValueError):
        Role("exp_avg")
    with pytest.warns(DeprecationWarning):
        alias = Role.EXP_AVG
    assert (alias.name, alias.value, alias.state_key) == ("EXP_AVG", "exp_avg", "exp_avg")
    with pytest.raises(AttributeError):
        Role.EXP_AVG_MAX  # noqa: B018


# ------------------------------------------------------------------------------------------------------------------
# python tests/test_api.py --record: add what the page renders now to the record (never drops a name)

if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_api.py --record")
    old = json.loads(RECORD.read_text(encoding="utf-8")) if RECORD.exists() else {}
    RECORD.write_text(json.dumps(_merge(old, surface()), indent=1) + "\n", encoding="utf-8")
    print(f"recorded {RECORD}")
