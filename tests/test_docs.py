"""The documentation runs as written: every fenced code block of README.md and docs/*.md runs here,
unless an HTML comment on the line just before its opening fence says why not (MARKERS). README.md
stays a front door of at most 300 lines, and every relative link points to a file and heading that
exist.

- `bash`/`sh`/`console` blocks: each `jaxpar ...` or `bash run.sh train|jaxpar ...` line runs in this
  process through `jaxpar.cli.main(argv)` (a command that asks for more devices than the 8 emulated
  here runs as `python -m jaxpar` instead). A block's commands run in order in one temporary folder
  holding copies of configs/ and tests/fixtures/, and any `--input` file the block names, written from
  the built-in corpus. `train` gets overrides appended (SPEED) so that each runs in seconds; `verify`
  runs as written. A command exits 0, unless a console block shows it printing `jaxpar: error: ...`: then it
  must exit 2 and print that very sentence. Any other shell line fails the test: such a block needs a
  marker, or splitting so that its runnable part stands alone.
- `python` blocks run with exec() in a fresh namespace, in such a folder.
- `yaml` blocks must parse; one whose top-level keys are config sections must load as a preset.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300
NOT_RUN = ("needs a GPU", "needs a cluster", "downloads", "output", "long")
RUN_BY = ("test_python_api", "test_distributed")  # modules that run a marked block themselves (marked_block)
MARKERS = {f"<!-- not run: {why} -->" for why in NOT_RUN} | {
    f"<!-- tests/{module}.py runs the next code block -->" for module in RUN_BY}
SHELL = {"bash", "sh", "shell", "console"}
RUN_LANGUAGES = SHELL | {"python", "yaml", "yml"}
CONFIG_SECTIONS = {"extends", "model", "mesh", "train", "parallel", "checkpoint", "data", "run", "rl"}
# Appended so that each command runs in seconds on 2 cores; checkpoint.every is capped, not dropped. verify keeps
# its steps (5 by default: four updates, each followed by a compared loss): one step would judge no update.
SPEED = {"train": ["train.steps=2", "train.eval_batches=1", "train.sample_tokens=0"], "verify": []}
MAX_CHECKPOINT_EVERY = 2
IN_PROCESS_DEVICES = 8  # tests/conftest.py emulates this many before jax starts
FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    marker: str | None  # the HTML comment on the line before the fence

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def fenced_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page.relative_to(REPO)}:{i + 1}: a code block that is never closed"
        before = lines[i - 1].strip() if i > 0 else ""
        marker = before if before.startswith("<!--") else None
        found.append(Block(page, i + 1, opening.group(1).lower(), "\n".join(lines[i + 1:end]) + "\n", marker))
        i = end + 1
    return found


def marked_block(page: Path, module: str) -> Block:
    """The one block of `page` whose marker says that tests/<module>.py runs it."""
    marker = f"<!-- tests/{module}.py runs the next code block -->"
    blocks = [block for block in fenced_blocks(page) if block.marker == marker]
    assert len(blocks) == 1, f"{page.relative_to(REPO)} has {len(blocks)} blocks marked `{marker}`, not one"
    return blocks[0]


ALL_BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]
# A block written word for word on two pages (README's tour and the guide it links to) runs once.
_UNMARKED = [block for block in ALL_BLOCKS if block.marker is None]
RUN_BLOCKS = [block for i, block in enumerate(_UNMARKED)
              if all((b.language, b.text) != (block.language, block.text) for b in _UNMARKED[:i])]


# ------------------------------------------------------------------------------------- structure

def test_the_readme_is_a_front_door():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the detail into docs/"
    assert "## Quick start" in (REPO / "README.md").read_text()


def test_every_marker_is_one_of_the_known_ones():
    unknown = [f"{b.name}: {b.marker}" for b in ALL_BLOCKS if b.marker is not None and b.marker not in MARKERS]
    assert not unknown, "markers must be one of " + ", ".join(sorted(MARKERS)) + "; found " + "; ".join(unknown)


def test_every_unmarked_block_is_of_a_language_that_runs():
    odd = [f"{b.name} ({b.language or 'no language'})" for b in RUN_BLOCKS if b.language not in RUN_LANGUAGES]
    assert not odd, f"give these blocks a language that runs or a <!-- not run: ... --> marker: {odd}"


def _prose(page: Path) -> list[tuple[int, str]]:
    """The lines of a page outside its fenced code blocks, with their 1-based numbers."""
    kept, inside = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            kept.append((number, line))
    return kept


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, line in _prose(page):
        if heading := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
    return {f"{base}-{n}" if n else base for base, count in seen.items() for n in range(count)}


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_points_to_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for number, line in _prose(page):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # code spans are not links
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                    continue
                path, _, anchor = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(REPO)}:{number}: {target}"
                if not file.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                    broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


# ---------------------------------------------------------------------------------- shell blocks

@dataclass
class Command:
    line: int
    words: list[str]
    errors: list[str]  # console output lines `jaxpar: error: ...` that the command must print


def shell_commands(block: Block) -> list[Command]:
    """The block's commands, backslash-continued lines joined; in a console block only the `$ ` lines
    are commands, and the lines after one are its output."""
    commands: list[Command] = []
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        line, start = lines[i], i
        if block.language == "console":
            if not line.startswith("$ "):
                if commands and "jaxpar: error:" in line:
                    commands[-1].errors.append(line.strip())
                i += 1
                continue
            line = line[2:]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        words = shlex.split(line, comments=True)
        if words:
            commands.append(Command(block.line + 1 + start, words, []))
    return commands


def jaxpar_argv(block: Block, command: Command) -> list[str]:
    words, where = command.words, f"{block.page.relative_to(REPO)}:{command.line}"
    if words[0] == "jaxpar":
        return words[1:]
    if words[:2] == ["bash", "run.sh"] and len(words) > 2:
        if words[2] == "train":
            return ["train", "configs/default.yaml", *words[3:]]
        if words[2] == "jaxpar":
            return words[3:]
        pytest.fail(f"{where}: `{shlex.join(words)}` is not run here (`bash run.sh test` is this suite); "
                    "mark its block <!-- not run: long -->")
    pytest.fail(f"{where}: `{shlex.join(words)}` is not a jaxpar command; give its block a "
                "<!-- not run: ... --> marker, or split the block so that its jaxpar commands stand alone")


def faster(argv: list[str]) -> list[str]:
    """argv with SPEED appended to a train or verify command (also one inside `launch ... --`)."""
    if argv[:1] == ["launch"] and "--" in argv:
        cut = argv.index("--") + 1
        return argv[:cut] + faster(argv[cut:])
    if not argv or argv[0] not in SPEED:
        return argv
    settings = []
    for word in argv:
        key, _, value = word.partition("=")
        if key == "checkpoint.every" and value.isdigit() and int(value) > MAX_CHECKPOINT_EVERY:
            word = f"checkpoint.every={MAX_CHECKPOINT_EVERY}"
        settings.append(word)
    return settings + SPEED[argv[0]]


def devices_asked(argv: list[str]) -> int:
    asked = [int(w.split("=", 1)[1]) for w in argv if re.fullmatch(r"run\.devices=\d+", w)]
    return asked[-1] if asked else 0


def prepare_folder(folder: Path, blocks_text: str) -> None:
    """configs/ and tests/fixtures/ copied in, and every file the text names after --input written."""
    shutil.copytree(REPO / "configs", folder / "configs")
    shutil.copytree(REPO / "tests" / "fixtures", folder / "tests" / "fixtures")
    inputs: set[str] = set()
    for line in blocks_text.replace("\\\n", " ").splitlines():  # continued lines as one
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if "--input" in words:
            for word in words[words.index("--input") + 1:]:
                if word.startswith("-"):
                    break
                inputs.add(word)
    if inputs:
        from jaxpar.data.corpus import builtin_text, builtin_topics

        text = builtin_text()
        # JSONL: a line per topic, its text whole and cut into a prompt (its first line) and a response,
        # which is also the chosen response of a preference pair whose rejected one has its lines reversed
        records = [{"text": t, "prompt": t.split("\n", 1)[0], "response": t.split("\n", 1)[-1],
                    "chosen": t.split("\n", 1)[-1], "rejected": "\n".join(t.split("\n")[:0:-1])}
                   for t in builtin_topics()]
        lines = "".join(json.dumps(r) + "\n" for r in records)
        for name in inputs:
            if not (folder / name).exists():
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                (folder / name).write_text(lines if name.endswith(".jsonl") else text)


def run_jaxpar(argv: list[str], folder: Path, capfd) -> tuple[int, str]:
    """Exit code and output (stdout + stderr) of one jaxpar command run in `folder`."""
    if devices_asked(argv) > IN_PROCESS_DEVICES:  # jax here has only the 8 emulated devices
        proc = subprocess.run([sys.executable, "-m", "jaxpar", *argv], cwd=folder, capture_output=True, text=True,
                              timeout=600)
        return proc.returncode, proc.stdout + proc.stderr
    from jaxpar.cli import main

    capfd.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else 2
    captured = capfd.readouterr()
    return code, captured.out + captured.err


def run_shell_block(block: Block, folder: Path, capfd) -> None:
    commands = shell_commands(block)
    assert commands, f"{block.name}: a shell block without commands; mark it <!-- not run: output -->"
    argvs = [jaxpar_argv(block, command) for command in commands]  # every line checked before any runs
    for command, argv in zip(commands, argvs):
        argv = faster(argv)
        code, output = run_jaxpar(argv, folder, capfd)
        expected = 2 if command.errors else 0
        where = f"{block.page.relative_to(REPO)}:{command.line}: jaxpar {shlex.join(argv)}"
        assert code == expected, f"{where} exited {code}, expected {expected}; its output ended:\n{output[-3000:]}"
        said = {" ".join(line.split()) for line in output.splitlines()}
        for error in command.errors:
            assert " ".join(error.split()) in said, f"{where} did not print\n{error}\nbut:\n{output[-3000:]}"


# --------------------------------------------------------------------------------- python, yaml

def run_python_block(block: Block) -> None:
    namespace = {"__name__": "docs_block"}
    exec(compile(block.text, block.name, "exec"), namespace)


def check_yaml_block(block: Block, folder: Path) -> None:
    data = yaml.safe_load(block.text)
    if isinstance(data, dict) and data and set(data) <= CONFIG_SECTIONS:
        import jaxpar

        preset = folder / "configs" / "docs_block.yaml"  # beside the presets, for `extends:`
        preset.write_text(block.text)
        jaxpar.load_config(str(preset))


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[block.name for block in RUN_BLOCKS])
def test_the_code_block_runs_as_written(block, tmp_path, monkeypatch, capfd):
    folder = tmp_path / "work"
    folder.mkdir()
    prepare_folder(folder, block.text)
    monkeypatch.chdir(folder)
    if block.language in SHELL:
        run_shell_block(block, folder, capfd)
    elif block.language == "python":
        run_python_block(block)
    else:
        check_yaml_block(block, folder)
