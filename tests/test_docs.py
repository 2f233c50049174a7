"""The documentation cannot drift from the code (STYLE habit 19).

Every ```console and ```python example in README.md and docs/ runs here, against the fixtures shipped in
tests/fixtures/, and its shown output is compared. The convention (also in docs/contributing.md):

* A ```console block holds commands, each on a line starting with ``$ `` (a line ending in ``\\`` continues on
  the next one). The lines after a command, up to the next ``$ `` line, are its expected combined stdout and
  stderr. ``...`` alone on a line matches any number of lines (none too); ``...`` inside a line matches any
  text on that line. The command must exit 0 unless the last expected line is ``[exit N]``.
* A ```python block runs as a script; when a ```text block follows it (blank lines between them only), that
  block is its expected stdout, with the same ``...`` rules. It must exit 0. Each block runs in a fresh
  interpreter.
* Every example of one page runs in order in one temporary folder, which holds ``tests`` (a link to the
  repository's tests/), so an example names fixtures as ``tests/fixtures/...`` and a later example can use an
  earlier one's output.
* ``dsckpt`` and ``python`` in a command are this checkout's: a shim on PATH runs ``python -m dsckpt`` with
  the interpreter running the tests and the repository root first on PYTHONPATH, whether or not (and from
  wherever) dsckpt is installed.
* What cannot run in a test (pip install, torchrun over many nodes, a GPU, a whole training run) is shown in
  ```bash blocks, or ```py blocks for Python, which are not run. Use them sparingly.

Besides the examples: ``mkdocs build --strict`` (the site builds with no warning: every page in the nav,
every link and anchor resolves, the API reference renders from the docstrings), README.md stays a landing
page of at most 250 lines whose links resolve and whose test command is the one .ci/run runs, its error-message
table is the one in docs/errors.md, and docs/api.md renders every name of dsckpt.__all__.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
README_MAX_LINES = 250
COMMAND_TIMEOUT_S = 300

# a fence opens a code block only if its info string holds no backtick (CommonMark), so prose such as
# "```` ```bash ```` blocks" at the start of a line is not one
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)[^`\n]*$")
_EXIT = re.compile(r"^\[exit (\d+)\]$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, its 1-based first content line, its lines (fence indent removed)."""

    lang: str
    line: int
    lines: tuple[str, ...]
    follows_previous: bool  # only blank lines between this block and the one before it


@dataclass(frozen=True)
class Example:
    """One thing to run and what it must show."""

    kind: str  # "console" (a shell command) or "python" (a script)
    line: int
    source: str
    expected: tuple[str, ...] | None  # None: output not compared
    exit_code: int = 0


def parse_blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown page, in order (fences may be indented, e.g. inside a list)."""
    blocks: list[Block] = []
    lines = text.split("\n")
    i = 0
    last_end = -10
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m["indent"], m["fence"], m["lang"].lower()
        start = i + 1
        j = start
        while j < len(lines) and not (
            lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""
        ):
            j += 1
        body = tuple(ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[start:j])
        between = lines[last_end + 1 : i] if last_end >= 0 else ["x"]
        blocks.append(Block(lang, start + 1, body, all(not ln.strip() for ln in between)))
        last_end = j
        i = j + 1
    return blocks


def parse_examples(text: str) -> list[Example]:
    """The runnable examples of a page, in page order."""
    blocks = parse_blocks(text)
    examples: list[Example] = []
    for k, block in enumerate(blocks):
        if block.lang == "console":
            examples.extend(_console_examples(block))
        elif block.lang == "python":
            nxt = blocks[k + 1] if k + 1 < len(blocks) else None
            expected = nxt.lines if nxt is not None and nxt.lang == "text" and nxt.follows_previous else None
            examples.append(Example("python", block.line, "\n".join(block.lines) + "\n", expected))
    return examples


def _console_examples(block: Block) -> list[Example]:
    out: list[Example] = []
    command: list[str] = []
    expected: list[str] = []
    start = block.line
    lines = list(block.lines)
    i = 0

    def flush() -> None:
        if not command:
            return
        exp = list(expected)
        while exp and not exp[-1].strip():
            exp.pop()
        code = 0
        if exp and (m := _EXIT.match(exp[-1].strip())):
            code = int(m[1])
            exp.pop()
        out.append(Example("console", start, "\n".join(command), tuple(exp), code))

    while i < len(lines):
        ln = lines[i]
        if ln.startswith("$ "):
            flush()
            command, expected, start = [ln[2:]], [], block.line + i
            while command[-1].endswith("\\") and i + 1 < len(lines):
                i += 1
                command.append(lines[i])
        elif not command:
            if ln.strip():
                raise ValueError(f"line {block.line + i}: a console block must start with a '$ ' command line")
        else:
            expected.append(ln)
        i += 1
    flush()
    return out


def _lines(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _pattern(expected: list[str]) -> re.Pattern[str]:
    parts = []
    for ln in expected:
        if ln.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(r"[^\n]*?".join(re.escape(p) for p in ln.split("...")) + r"\n")
    return re.compile("".join(parts))


def output_matches(expected: list[str] | tuple[str, ...], actual: str) -> bool:
    """Whether ``actual`` shows what ``expected`` says, ``...`` masks included (trailing spaces ignored)."""
    exp = _lines("\n".join(expected))
    act = _lines(actual)
    text = "".join(ln + "\n" for ln in act)
    return _pattern(exp).fullmatch(text) is not None


def _line_matches(expected: str, actual: str) -> bool:
    return _pattern([expected]).fullmatch(actual + "\n") is not None


def _masks_filled(expected: list[str], actual: list[str]) -> list[str]:
    """``expected`` with each masked line that matches replaced by the actual text it stands for, so that a
    diff shows only real differences (a heuristic walk; the verdict is output_matches')."""
    out: list[str] = []
    j = 0
    for k, ln in enumerate(expected):
        if ln.strip() == "...":
            rest = [e for e in expected[k + 1:] if e.strip() != "..."]
            stop = len(actual) - len(rest)  # where the mask ends if the next line never matches
            if rest:
                stop = next((m for m in range(j, len(actual)) if _line_matches(rest[0], actual[m])), stop)
            out.extend(actual[j:max(j, stop)])
            j = max(j, stop)
        elif j < len(actual) and _line_matches(ln, actual[j]):
            out.append(actual[j])
            j += 1
        else:
            out.append(ln)
            j += 1
    return out


def _diff(expected: list[str] | tuple[str, ...], actual: str, where: str) -> str:
    act = _lines(actual)
    return "\n".join(difflib.unified_diff(
        _masks_filled(_lines("\n".join(expected)), act), act, f"expected ({where})", "actual", lineterm="", n=3))


@dataclass
class Runner:
    """Runs a page's examples in one folder; collects every failure (habit 4)."""

    folder: Path
    env: dict[str, str]
    page: str
    failures: list[str] = field(default_factory=list)

    def run(self, ex: Example, index: int) -> None:
        where = f"{self.page}:{ex.line}"
        if ex.kind == "console":
            argv = ["bash", "-c", ex.source]
            shown = "$ " + ex.source
        else:
            script = self.folder.parent / f"example_{index}.py"
            script.write_text(ex.source)
            argv = [sys.executable, str(script)]
            shown = "```python\n" + ex.source + "```"
        try:
            proc = subprocess.run(
                argv, cwd=self.folder, env=self.env, text=True, timeout=COMMAND_TIMEOUT_S,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT if ex.kind == "console" else subprocess.PIPE)
        except subprocess.TimeoutExpired:
            self.failures.append(f"{where}: timed out after {COMMAND_TIMEOUT_S} s\n{shown}")
            return
        problems = []
        if proc.returncode != ex.exit_code:
            extra = f"\nstderr:\n{proc.stderr}" if ex.kind == "python" and proc.stderr else ""
            problems.append(f"exit {proc.returncode}, expected {ex.exit_code}{extra}")
        if ex.expected is not None and not output_matches(ex.expected, proc.stdout):
            problems.append("output differs:\n" + _diff(ex.expected, proc.stdout, where))
        if problems:
            self.failures.append(f"{where}:\n{shown}\n" + "\n".join(problems))


def _env(shims: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSCKPT_")}
    env["PATH"] = str(shims) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(PYTHONUNBUFFERED="1", PYTHONIOENCODING="utf-8", LC_ALL="C.UTF-8", NO_COLOR="1", TERM="dumb",
               PYTHONDONTWRITEBYTECODE="1")
    return env


def _shims(where: Path) -> Path:
    """``dsckpt``, ``python`` and ``python3`` on PATH: this interpreter, this checkout's dsckpt."""
    where.mkdir()
    py = shlex.quote(sys.executable)
    for name, body in (("dsckpt", f'exec {py} -m dsckpt "$@"'), ("python", f'exec {py} "$@"'),
                       ("python3", f'exec {py} "$@"')):
        p = where / name
        p.write_text(f"#!/bin/sh\n{body}\n")
        p.chmod(0o755)
    return where


def _page_id(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_examples(page: Path, tmp_path: Path) -> None:
    examples = parse_examples(page.read_text(encoding="utf-8"))
    if not examples:
        return
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "tests").symlink_to(REPO / "tests", target_is_directory=True)
    runner = Runner(folder, _env(_shims(tmp_path / "bin")), _page_id(page))
    for i, ex in enumerate(examples):
        runner.run(ex, i)
    if runner.failures:
        pytest.fail(f"{len(runner.failures)} of {len(examples)} example(s) of {_page_id(page)} differ from "
                    "what they show:\n\n" + "\n\n".join(runner.failures), pytrace=False)


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """The site builds with no warning (CI builds the docs through this test)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "api" / "index.html").exists()


def test_readme_is_a_landing_page() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


_LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s#]+)(?:#[^)\s]*)?\)")


def test_readme_links_resolve() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    missing = sorted({t for t in _LINK.findall(text) if not (REPO / t).exists()})
    assert not missing, f"README.md links to files that do not exist: {missing}"


def _error_table(text: str) -> list[list[str]]:
    """The rows of the table whose header starts with '| you see |', links reduced to their text."""
    rows, inside = [], False
    for ln in text.splitlines():
        if ln.startswith("| you see |"):
            inside = True
            continue
        if inside:
            if not ln.startswith("|"):
                break
            if set(ln.replace("|", "").strip()) <= {"-", ":"}:
                continue
            cell = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", ln)
            rows.append([c.strip() for c in cell.strip().strip("|").split(" | ")])
    return rows


def test_error_table_is_the_same_in_readme_and_docs() -> None:
    readme = _error_table((REPO / "README.md").read_text(encoding="utf-8"))
    docs = _error_table((DOCS / "errors.md").read_text(encoding="utf-8"))
    assert readme, "README.md has no '| you see |' table"
    assert readme == docs, "README.md and docs/errors.md disagree on the error-message table:\n" + "\n".join(
        difflib.unified_diff([" | ".join(r) for r in readme], [" | ".join(r) for r in docs],
                             "README.md", "docs/errors.md", lineterm=""))


@pytest.mark.parametrize("expected, actual, ok", [
    (["a", "b"], "a\nb\n", True),
    (["a", "b"], "a\nc\n", False),
    (["a ... z"], "a 1 2 3 z\n", True),
    (["a ... z"], "a 1\n2 z\n", False),
    (["a", "...", "z"], "a\nz\n", True),
    (["a", "...", "z"], "a\n1\n2\nz\n", True),
    (["a", "...", "z"], "a\n1\n", False),
    (["...", "z"], "q\nz   \n\n", True),
    ([], "", True),
    ([], "noise\n", False),
], ids=["exact", "changed", "inline", "inline-not-across-lines", "lines-none", "lines-some", "lines-tail",
        "lead-trailing-space", "empty", "unexpected-output"])
def test_output_matches(expected: list[str], actual: str, ok: bool) -> None:
    assert output_matches(expected, actual) is ok


def test_parse_examples() -> None:
    page = "\n".join([
        "text", "```console", "$ dsckpt info x", "line 1", "...", "$ false", "[exit 1]", "$ echo a \\", "  b", "```",
        "", "```python", "print(1)", "```", "", "```text", "1", "```", "- item", "    ```python", "    x = 2", "    ```",
        "```bash", "pip install dsckpt", "```", "```py", "not_run()", "```",
        "  ```` ```console ```` in prose is no fence", "```console", "$ true", "```",
    ])
    exs = parse_examples(page)
    assert [(e.kind, e.line, e.source, e.expected, e.exit_code) for e in exs] == [
        ("console", 3, "dsckpt info x", ("line 1", "..."), 0),
        ("console", 6, "false", (), 1),
        ("console", 8, "echo a \\\n  b", (), 0),
        ("python", 13, "print(1)\n", ("1",), 0),
        ("python", 21, "x = 2\n", None, 0),
        ("console", 31, "true", (), 0),
    ]


def test_failure_shows_a_unified_diff() -> None:
    diff = _diff(["wrote 13 tensors (1.1 KB) to model.safetensors"], "wrote 12 tensors (1.0 KB) to model.safetensors\n",
                 "README.md:40")
    assert diff.splitlines()[:2] == ["--- expected (README.md:40)", "+++ actual"]
    assert "-wrote 13 tensors (1.1 KB) to model.safetensors" in diff
    assert "+wrote 12 tensors (1.0 KB) to model.safetensors" in diff


def test_failure_diff_shows_only_real_differences() -> None:
    expected = ["scanned ... 21 stored tensors", "...", "1 finding(s)"]
    actual = "scanned ckpt (deepspeed): 21 stored tensors\n  nonfinite a\n  nonfinite b\n2 finding(s)\n"
    diff = _diff(expected, actual, "p.md:1").splitlines()
    assert [ln for ln in diff[2:] if ln[:1] in "+-"] == ["-1 finding(s)", "+2 finding(s)"]


def test_shims_run_this_checkout(tmp_path: Path) -> None:
    env = _env(_shims(tmp_path / "bin"))
    out = subprocess.run(["bash", "-c", "python -c 'import dsckpt; print(dsckpt.__file__)'"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out).resolve() == (REPO / "dsckpt" / "__init__.py").resolve()
    assert shutil.which("dsckpt", path=env["PATH"]) == str(tmp_path / "bin" / "dsckpt")


def test_api_page_covers_the_public_surface() -> None:
    import dsckpt

    text = (DOCS / "api.md").read_text(encoding="utf-8")
    shown = set(re.findall(r"^::: dsckpt\.(\w+)\s*$", text, flags=re.M))
    public = set(dsckpt.__all__) - {"__version__"}
    assert shown == public, f"docs/api.md lacks {sorted(public - shown)}, shows non-public {sorted(shown - public)}"


TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest'


def test_ci_runs_the_readme_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert TEST_COMMAND in ci, f".ci/run does not run {TEST_COMMAND!r} on a line of its own"
    assert TEST_COMMAND in (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    # then the live tier, then lint and types (docs/testing.md), each after the one before
    steps = [TEST_COMMAND, "python -m pytest -m live -n 0 || [ $? -eq 5 ]", "ruff check", "mypy"]
    at = [ci.index(step) if step in ci else -1 for step in steps]
    assert -1 not in at and at == sorted(at), dict(zip(steps, at))


NOT_RUN = {"bash", "py", "text", "json", "yaml", "toml", "ini", "diff"}


def test_every_command_example_runs() -> None:
    """A ``$ `` command in a bash (or other not-run) block, or a block with no language, would escape the checks.
    (A ```text block may quote a transcript, e.g. a test failure; it is compared only after a python block.)"""
    problems = []
    for page in PAGES:
        for b in parse_blocks(page.read_text(encoding="utf-8")):
            where = f"{_page_id(page)}:{b.line}"
            if b.lang not in NOT_RUN | {"console", "python"}:
                problems.append(f"{where}: a ```{b.lang} block; use console or python (run), or one of {sorted(NOT_RUN)}")
            elif b.lang not in ("console", "text") and any(ln.startswith("$ ") for ln in b.lines):
                problems.append(f"{where}: '$ ' commands in a ```{b.lang} block are not run; use ```console")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------------------------
# CHANGELOG.md and the version (issue 43 item 5)

CHANGELOG = REPO / "CHANGELOG.md"
_RELEASE = re.compile(r"^## \[(?P<version>\d+\.\d+\.\d+)\] - (?P<date>\d{4}-\d{2}-\d{2})$")
# Keep a Changelog's kinds of change; "Added — what" groups a long list; the last is this project's own
_KINDS = re.compile(r"^### (Added|Changed|Deprecated|Removed|Fixed|Security)( — [a-zA-Z -]+)?$"
                    r"|^### DeepSpeed behaviours documented$")


def _changelog_sections() -> list[tuple[str, list[str]]]:
    """``(heading, lines)`` of every ``##`` section of CHANGELOG.md, in order."""
    sections: list[tuple[str, list[str]]] = []
    for line in CHANGELOG.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            sections.append((line, []))
        elif sections:
            sections[-1][1].append(line)
    return sections


def _pyproject_version() -> str:
    m = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(encoding="utf-8"), flags=re.M)
    assert m, "pyproject.toml has no version line"
    return m.group(1)


def test_changelog_version_dsckpt_version_and_pyproject_agree() -> None:
    """The newest release the changelog names is the version pyproject.toml gives, which the installed metadata,
    ``dsckpt.__version__`` and ``dsckpt --version`` report."""
    import importlib.metadata

    import dsckpt

    released = [m.group("version") for h, _ in _changelog_sections() if (m := _RELEASE.match(h))]
    assert released, "CHANGELOG.md names no release ('## [X.Y.Z] - YYYY-MM-DD')"
    newest = released[0]
    assert _pyproject_version() == newest, f"pyproject.toml says {_pyproject_version()}, CHANGELOG.md's newest is {newest}"
    installed = importlib.metadata.version("dsckpt")
    assert installed == newest, (f"the installed metadata says {installed}, pyproject.toml {newest}: the install is "
                                 "older than this checkout's version; run pip install -e . again")
    assert dsckpt.__version__ == newest
    pythonpath = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-m", "dsckpt", "--version"], env={**os.environ, "PYTHONPATH": pythonpath},
                         capture_output=True, text=True, check=True).stdout
    assert out == f"dsckpt, version {newest}\n"


def test_changelog_keeps_its_format() -> None:
    """Keep a Changelog: '# Changelog', an '[Unreleased]' section first, then releases newest first with ISO dates,
    each holding only the known kinds of change; and every deprecated name is in the Deprecated section of the
    release its warning names."""
    text = CHANGELOG.read_text(encoding="utf-8")
    assert text.startswith("# Changelog\n")
    sections = _changelog_sections()
    assert sections[0][0] == "## [Unreleased]", sections[0][0]
    releases = [m for h, _ in sections[1:] if (m := _RELEASE.match(h))]
    assert len(releases) == len(sections) - 1, [h for h, _ in sections[1:] if not _RELEASE.match(h)]
    versions = [tuple(int(x) for x in m.group("version").split(".")) for m in releases]
    dates = [m.group("date") for m in releases]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions), versions
    assert dates == sorted(dates, reverse=True), dates
    for heading, lines in sections:
        bad = [ln for ln in lines if ln.startswith("#") and not _KINDS.match(ln)]
        assert not bad, f"{heading}: {bad} is not a Keep a Changelog kind of change"
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from test_api import _deprecated_objects
    finally:
        sys.path.remove(str(REPO / "tests"))
    by_heading = {h: "\n".join(lines) for h, lines in sections}
    for name, message in _deprecated_objects().items():
        since = re.search(r"deprecated since dsckpt (\S+) ", message)
        assert since, message
        heading = next((h for h in by_heading if h.startswith(f"## [{since.group(1)}]")), None)
        assert heading, f"{name} is deprecated since {since.group(1)}, which CHANGELOG.md does not name"
        deprecated = by_heading[heading].partition("### Deprecated")[2].partition("\n### ")[0]
        short = name.removeprefix("dsckpt.model.")
        assert short in deprecated or name in deprecated, f"{heading} does not list {name} under Deprecated"


def test_changelog_is_linked_from_the_docs() -> None:
    """docs/changelog.md is CHANGELOG.md itself (included, so the two cannot differ), in the nav and on the index."""
    assert (DOCS / "changelog.md").read_text(encoding="utf-8").strip() == '--8<-- "CHANGELOG.md"'
    assert re.search(r"^\s+- Changelog: changelog\.md$", (REPO / "mkdocs.yml").read_text(encoding="utf-8"), re.M)
    assert "](changelog.md)" in (DOCS / "index.md").read_text(encoding="utf-8")
