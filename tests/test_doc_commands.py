"""Every shell command of README.md, docs/*.md and the package READMEs runs under a test, as written.

The commands are collected from the documents themselves (fenced `bash`/`sh`/
`shell`/`console` blocks and indented code blocks, read with markdown-it), so a
command added to any of them is picked up without editing this file. Each is then
matched against `COVERAGE`, the table of how each kind of command is exercised on
the CPU; a command that no row matches fails `test_every_doc_command_is_covered`.

- `run`: executed by bash as written (`./uvw run X` runs X in this environment,
  as uv would) in a sandbox folder, after one real demo run on CPU-sized data
  (`ppo-driver demo` itself runs 2 steps instead of 80; other `demo` / `train`
  lines get `--dry-run`: validated as written, nothing trained twice). Files a
  command assumes (`run.yaml`, `runs/shared`) are made there from the demo's run.
- `parse`: a GPU-only benchmark: its argparse parses the arguments exactly as
  written (its quick mode runs in tests/*/test_*bench*.py).
- `ci`: what .ci/run runs (checked against its text).
- `static`: an install or a GPU-host step: the folders, extras, files and markers
  it names exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.ppo.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    {
        ROOT / "README.md",
        ROOT / "tests" / "README.md",
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("packages/*/README.md"),
    }
)
SHELL_INFOS = {"bash", "sh", "shell", "console", "zsh"}
GPU_KIT = "source .gpu-kit/setup.sh && "
RUN_TIMEOUT_S = 850
DEMO_CPU_SIZE = ("--num-rollout", "2", "--eval-interval", "1", "--save-interval", "2")
"""What the doc's `ppo-driver demo` (80 steps) gets appended here: 2 steps, eval and save in both."""


@dataclass(frozen=True)
class DocCommand:
    """One command line of a document."""

    doc: str
    line: int
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _strip_comment(line: str) -> str:
    """`line` without a trailing `# comment` (a `#` outside quotes, after a blank)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def doc_commands(path: Path) -> list[DocCommand]:
    """The command lines of `path`'s shell blocks (continuations joined, comments dropped)."""
    from markdown_it import MarkdownIt

    commands = []
    for token in MarkdownIt().parse(path.read_text()):
        shell = token.type == "fence" and token.info.split()[:1] and token.info.split()[0] in SHELL_INFOS
        if not (shell or token.type == "code_block"):
            continue
        start = token.map[0] + (1 if token.type == "fence" else 0) if token.map else 0
        pending, first = "", 0
        for offset, raw in enumerate(token.content.splitlines()):
            line = _strip_comment(raw.strip())
            if not pending:
                first = start + offset + 1
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            text = (pending + line).strip()
            pending = ""
            if text:
                commands.append(DocCommand(str(path.relative_to(ROOT)), first, text))
    return commands


COMMANDS = [c for doc in DOCS for c in doc_commands(doc)]


# --- how each kind of command is exercised -----------------------------------------------------------


@dataclass(frozen=True)
class Cover:
    """A row of the coverage table: commands matching `pattern` (the whole line) are exercised by `how`."""

    pattern: str
    kind: str  # run | parse | ci | static | fixture | cluster
    how: str


COVERAGE = (
    Cover(
        r"ppo-driver train .*--ray-address HEAD_IP:\d+ .*",
        "cluster",
        "tests/ppo/test_cluster.py trains on its two nodes so",
    ),
    Cover(r"(\./uvw run )?ppo-driver demo", "run", "the demo, on CPU-sized data (2 steps, eval and save)"),
    Cover(r"(\./uvw run )?ppo-driver (demo|train) .*", "run", "as written plus --dry-run"),
    Cover(r"(\./uvw run )?ppo-driver (eval|export|plot) .*", "run", "as written, on the demo's run"),
    Cover(r"(\./uvw run )?ppo-driver .*--help", "run", "as written"),
    Cover(
        r"(\./uvw run )?ppo-driver demo && (\./uvw run )?ppo-driver plot .*", "run", "both parts, as written"
    ),
    Cover(
        r"source \.gpu-kit/setup\.sh && python3 bench/\w+\.py.*", "parse", "GPU only: its arguments parsed"
    ),
    Cover(r"(nice -n \d+ )?\./uvw run python bench/\w+\.py.*", "parse", "its arguments parsed"),
    Cover(
        r"source \.gpu-kit/setup\.sh && python3 -m pytest( tests\S*)+ -m gpu( .*)?",
        "static",
        "the GPU suite's setup, and the test paths it names",
    ),
    Cover(r"tools/gpu-kit/prepare-host-kit\.sh \S+", "static", "the kit script (bash -n)"),
    Cover(r"\./uvw run (--locked )?pytest( -m \"not slow\")?", "ci", "the test suite"),
    Cover(r"\./uvw run (--locked )?(ruff|mypy) .*", "ci", "lint and types"),
    Cover(r"bash \.ci/run", "ci", "CI itself"),
    Cover(r"\./uvw sync", "ci", "the environment"),
    Cover(r"\./uvw build .*", "ci", "the wheels"),
    Cover(
        r"pip install (['\"]?\./packages/[\w-]+(\[[\w,-]+\])?['\"]? ?)+", "static", "packages of this tree"
    ),
    Cover(r"pip install [a-z][\w-]*", "static", "a dependency we declare"),
    Cover(
        r"(\./uvw run )?ppo-driver fetch-model smollm2",
        "fixture",
        "tests/conftest.py's smollm2 fixture runs it",
    ),
    Cover(r"ray start --(head|address) .*", "cluster", "tests/ppo/test_cluster.py starts its two nodes so"),
    Cover(
        r"ray job submit .* -- ppo-driver train .*", "cluster", "tests/ppo/test_cluster.py submits its job so"
    ),
)


def cover_of(command: DocCommand) -> Cover | None:
    for cover in COVERAGE:
        if re.fullmatch(cover.pattern, command.text):
            return cover
    return None


def test_documents_hold_commands() -> None:
    assert len(COMMANDS) >= 20, [c.id for c in COMMANDS]
    assert any(c.text.startswith("./uvw run ppo-driver demo") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.id)
def test_every_doc_command_is_covered(command: DocCommand) -> None:
    assert cover_of(command) is not None, (
        f"{command.id}: `{command.text}` is run by no test; add a row to COVERAGE in tests/test_doc_commands.py "
        "saying how it is exercised on the CPU"
    )


def _of_kind(kind: str) -> list[DocCommand]:
    return [c for c in COMMANDS if (cover := cover_of(c)) is not None and cover.kind == kind]


# --- ci: what .ci/run runs ---------------------------------------------------------------------------


def _ci_text() -> str:
    return (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("command", _of_kind("ci"), ids=lambda c: c.id)
def test_ci_runs_it(command: DocCommand) -> None:
    ci = re.sub(r" --locked\b", "", _ci_text())
    for part in command.text.split(" && "):
        part = re.sub(r" --locked\b", "", part)
        if part == "bash .ci/run":
            assert os.access(ROOT / ".ci" / "run", os.R_OK)
            continue
        words = shlex.split(part)
        if words[:3] == ["./uvw", "run", "mypy"]:
            paths = sorted(str(p.relative_to(ROOT)) for w in words[3:] for p in ROOT.glob(w))
            line = next(line for line in ci.splitlines() if " mypy " in line)
            assert sorted(shlex.split(line)[3:]) == paths, (part, line)
        elif words[:3] == ["./uvw", "run", "pytest"]:
            assert "./uvw run pytest" in ci  # the whole suite; `-m "not slow"` is its quick part
            if "-m" in words:
                markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
                    "ini_options"
                ]
                assert any(m.startswith("slow:") for m in markers["markers"])
        elif words[:3] == ["./uvw", "build", "--package"]:
            names = {
                tomllib.loads(p.read_text())["project"]["name"]
                for p in ROOT.glob("packages/*/pyproject.toml")
            }
            assert words[3] in names and "./uvw build --all-packages" in ci
        else:
            assert part.split(" -o ")[0] in ci, f"{command.id}: .ci/run does not run `{part}`"


# --- static: installs and the GPU host ------------------------------------------------------------


@pytest.mark.parametrize("command", _of_kind("fixture") + _of_kind("cluster"), ids=lambda c: c.id)
def test_the_test_that_runs_it_runs_it(command: DocCommand) -> None:
    # These run for real elsewhere: the fetch in every test that needs SmolLM2, the cluster in the slow
    # two-node test, with local addresses in place of HEAD_IP. Here: that those tests run each of the
    # command's words that is not a value to fill in (the subcommand and every flag).
    cover = cover_of(command)
    assert cover is not None
    words = shlex.split(command.text.replace("./uvw run ", ""))
    if cover.kind == "fixture":
        assert repr(tuple(words)).replace("'", '"') in (ROOT / "tests" / "conftest.py").read_text(), (
            command.id
        )
        return
    source = "".join((ROOT / "tests" / f).read_text() for f in ("ppo/test_cluster.py", "_ray_cluster.py"))
    program = words[: words.index("--")] if "--" in words else words
    named = [w for w in program[1:] if w.isalpha() or (w.startswith("--") and len(w) > 2)]
    assert named, command.id
    for word in named:
        assert f'"{word}"' in source, (command.id, word)


@pytest.mark.parametrize("command", _of_kind("static"), ids=lambda c: c.id)
def test_what_it_names_exists(command: DocCommand) -> None:
    text = command.text
    if (
        text.startswith("pip install ./")
        or text.startswith("pip install '")
        or text.startswith('pip install "')
    ):
        for target in shlex.split(text)[2:]:
            folder, _, extras = target.partition("[")
            project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
            for extra in filter(None, extras.rstrip("]").split(",")):
                assert extra in project.get("optional-dependencies", {}), (command.id, extra)
    elif text.startswith("pip install "):
        name = text.split()[2]
        declared = (ROOT / "pyproject.toml").read_text() + "".join(
            p.read_text() for p in ROOT.glob("packages/*/pyproject.toml")
        )
        assert re.search(rf'"{re.escape(name)}[><=\[]', declared), (
            f"{command.id}: {name} is no dependency of ours"
        )
    elif text.startswith("tools/gpu-kit/"):
        script = ROOT / text.split()[0]
        assert os.access(script, os.X_OK), script
        subprocess.run(["bash", "-n", str(script)], check=True)
        assert "setup.sh" in script.read_text()
    else:  # the GPU suite: the kit writes setup.sh, `-m gpu` selects a registered marker, the paths exist
        words = shlex.split(text.removeprefix(GPU_KIT))
        start = words.index("pytest") + 1
        paths = words[start : words.index("-m", start)]
        assert paths and all((ROOT / w).exists() for w in paths), (command.id, paths)
        assert "setup.sh" in (ROOT / "tools" / "gpu-kit" / "prepare-host-kit.sh").read_text()
        markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
            "markers"
        ]
        assert any(m.startswith("gpu:") for m in markers)


# --- parse: the benchmarks' arguments, exactly as written ---------------------------------------------

_PARSE_ONLY = r"""
import argparse, json, os, runpy, sys

class Parsed(BaseException):
    pass

real = argparse.ArgumentParser.parse_args

def parse_args(self, args=None, namespace=None):
    real(self, args, namespace)
    raise Parsed

argparse.ArgumentParser.parse_args = parse_args
results = {}
for key, script, argv in json.loads(sys.argv[1]):
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
        results[key] = "finished without parsing arguments"
    except Parsed:
        results[key] = "ok"
    except SystemExit as exc:
        results[key] = f"argparse refused it (exit {exc.code})"
print(json.dumps(results))
"""


def _bench_call(command: DocCommand, out: Path) -> tuple[str, list[str]]:
    text = re.sub(r"^nice -n \d+ ", "", command.text).removeprefix(GPU_KIT).removeprefix("./uvw run ")
    words = shlex.split(os.path.expandvars(text.replace("$OUT", str(out)).replace('"$OUT', f'"{out}')))
    assert words[0] in ("python", "python3"), command
    return str(ROOT / words[1]), words[2:]


@pytest.fixture(scope="module")
def parsed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("OUT")
    calls = [(c.id, *_bench_call(c, out)) for c in _of_kind("parse")]
    done = subprocess.run(
        [sys.executable, "-c", _PARSE_ONLY, json.dumps(calls)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env={**os.environ, "OUT": str(out)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("command", _of_kind("parse"), ids=lambda c: c.id)
def test_the_benchmarks_take_their_arguments_as_written(command: DocCommand, parsed: dict[str, str]) -> None:
    assert parsed[command.id] == "ok", f"{command.id}: `{command.text}`: {parsed[command.id]}"


# --- run: the ppo-driver commands, in a sandbox with the demo's run --------------------------------


def _bash(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    }
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env
    )


def _check(done: subprocess.CompletedProcess[str], what: str) -> None:
    assert done.returncode == 0, (
        f"{what}: exit {done.returncode}\n--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-5000:]}"
    )


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the demo's run (CPU-sized) and the files the docs' commands assume."""
    here = tmp_path_factory.mktemp("docs")
    done = _bash(shlex.join(["ppo-driver", "demo", *DEMO_CPU_SIZE]), here)
    _check(done, "ppo-driver demo (CPU-sized)")
    demo = here / "runs" / "demo"
    (here / "demo.stdout").write_text(done.stdout)
    (here / "demo.stderr").write_text(done.stderr)
    (here / "run.yaml").write_text(
        (ROOT / "examples" / "demo.yaml").read_text()
        + f"hf_checkpoint: {demo / 'base'}\nprompt_data: {demo / 'data' / 'train.jsonl'}\n"
        + f"eval_prompt_data: {demo / 'data' / 'eval.jsonl'}\nrun_dir: runs/from-yaml\n"
    )
    for name in ("shared", "resident"):
        shutil.copytree(demo, here / "runs" / name, ignore=shutil.ignore_patterns("actor", "critic", "hf"))
    return here


def _as_run(part: str) -> str:
    part = part.removeprefix("./uvw run ")
    words = shlex.split(part)
    if words[:2] == ["ppo-driver", "demo"] and len(words) == 2:
        return shlex.join([*words, *DEMO_CPU_SIZE])
    if words[1:2] in (["demo"], ["train"]) and "--help" not in words:
        return shlex.join([*words, "--dry-run"])
    return part


def _checks_after(part: str, here: Path) -> Callable[[subprocess.CompletedProcess[str]], None]:
    """What each subcommand must leave behind, beyond exiting 0."""
    words = shlex.split(part.removeprefix("./uvw run "))

    def check(done: subprocess.CompletedProcess[str]) -> None:
        if words[1] == "eval":
            # Scored as the run scored it: its reward, lengths and greedy decoding on its final
            # weights give the figure its last eval logged.
            printed = dict(re.findall(r"^(eval/[\w/]+): ([-\d.]+)$", done.stdout, re.M))
            last = [row for row in read_metrics(here / words[2]) if "eval/accuracy" in row][-1]
            assert printed and float(printed["eval/accuracy"]) == pytest.approx(
                last["eval/accuracy"], abs=1e-4
            )
            assert float(printed["eval/mean"]) == pytest.approx(last["eval/mean"], abs=1e-4)
        elif words[1] == "export":
            # The folder it printed: RUN_DIR/hf, or beside it where the run exported already.
            folder = here / done.stdout.strip().splitlines()[-1]
            assert (
                folder.resolve().parent == (here / words[2]).resolve() and (folder / "config.json").is_file()
            )
        elif words[1] == "plot":
            assert list((here / words[2] / "plots").glob("*.png"))
        elif "--help" in words:
            assert "--config FILE" in done.stdout
        elif "--dry-run" in _as_run(part):
            assert "# dry run: config valid" in done.stdout

    return check


@pytest.mark.slow
@pytest.mark.parametrize("command", _of_kind("run"), ids=lambda c: c.id)
def test_the_command_runs_as_written(command: DocCommand, sandbox: Path) -> None:
    for part in command.text.split(" && "):
        if _as_run(part) == shlex.join(["ppo-driver", "demo", *DEMO_CPU_SIZE]):
            continue  # the sandbox's own demo run was this very command
        done = _bash(_as_run(part), sandbox)
        _check(done, f"{command.id}: `{part}`")
        _checks_after(part, sandbox)(done)


@pytest.mark.slow
def test_the_demo_terminal_is_clean_and_names_the_worker_logs(sandbox: Path) -> None:
    err, out = (sandbox / "demo.stderr").read_text(), (sandbox / "demo.stdout").read_text()
    noisy = [line for line in err.splitlines() if re.search(r"warn|error|illegal|traceback", line, re.I)]
    assert not noisy, noisy
    lines = [line for part in err.split("\r") for line in part.splitlines() if line.strip()]
    assert len([line for line in lines if "step/s" not in line and "?step" not in line]) <= 3, err
    logs = sandbox / "runs" / "demo" / "logs"
    for name in ("actor-0.log", "critic-0.log", "engine-0.log"):
        assert (logs / name).is_file() and (logs / name).stat().st_size > 0, sorted(logs.iterdir())
    assert f"logs:         {logs.relative_to(sandbox)}" in out or str(logs) in out, out


@pytest.mark.slow
def test_export_of_a_moved_run(sandbox: Path) -> None:
    runs = sandbox / "runs"
    moved = runs / "moved-away"
    (runs / "demo").rename(moved)
    try:
        done = _bash("ppo-driver export runs/moved-away --out exported", sandbox)
        _check(done, "ppo-driver export of a moved run")
        assert (sandbox / "exported" / "config.json").is_file()
        assert list((sandbox / "exported").glob("*.safetensors"))
    finally:
        moved.rename(runs / "demo")
