"""`ppo-driver train --help`: grouped flags that the parser takes as written, examples, and no torch or Ray."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any, get_type_hints

import pytest

from tandem.ppo.app.cli import run
from tandem.ppo.config import PPOConfig, flag
from tandem.ppo.config.file import parse_config
from tandem.ppo.config.flag_help import EXAMPLES, GROUPS, field_group, field_metavar, help_text

FIELDS = [f.name for f in dataclasses.fields(PPOConfig)]


def _help(command: str = "train", width: int = 100) -> str:
    return help_text(
        command, PPOConfig(hf_checkpoint="", rollout_batch_size=32, global_batch_size=32), width=width
    )


def test_help_imports_neither_torch_nor_ray() -> None:
    code = (
        "import sys\n"
        "from tandem.ppo.app.cli import run\n"
        "try:\n    run(['train', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "heavy = [m for m in ('torch', 'ray', 'transformers', 'megatron') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--rollout-batch-size" in done.stdout


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_has_a_named_group(name: str) -> None:
    assert field_group(name) in {title for title, _ in GROUPS[:-1]}, (
        f"{name}: add it to a group in tandem/ppo/config/flag_help.py (_GROUP_MEMBERS)"
    )


def test_groups_are_in_the_help_in_order_and_config_is_a_flag() -> None:
    text = _help()
    positions = [text.index(f"\n{title} (") for title, _ in GROUPS[:-1]]
    assert positions == sorted(positions)
    assert "  --config FILE" in text and "  --dry-run" in text
    examples = text[text.index("examples:") : text.index("the command:")]
    assert all(line.split("\n")[0] in examples for line in EXAMPLES["train"])
    assert "\nother (" not in text


def test_help_lines_fit_and_no_word_is_cut() -> None:
    width = 72
    text = _help(width=width)
    docs_words = {w for line in text.splitlines() for w in line.split()}
    for line in text.splitlines():
        if line.startswith("  --") or line.startswith("  ppo-driver") or line.startswith("      --"):
            continue  # a flag's own line and the examples are never wrapped
        words = line.split()
        assert len(line) <= width or len(words) == 1, line
    # Every docstring's words appear whole: a word split mid-way would leave fragments that no
    # docstring holds.
    from tandem.ppo.config.flag_help import _docstrings

    doc_words = {w for doc in _docstrings(PPOConfig).values() for w in doc.split()}
    assert doc_words <= docs_words


def _sample(annotation: Any, metavar: str) -> tuple[list[str], Any]:
    """An argument list for `metavar` and the value the parser must give the field."""
    if metavar.startswith("{None}|"):
        return ["None"], None
    if metavar == "{None,True,False}":
        return ["True"], True
    if metavar.startswith("{"):
        first = metavar[1:-1].split(",")[0]
        return [first], first
    if metavar.startswith("["):
        inner = metavar[1:].split(" ")[0]
        values = {"INT": (3, 5), "FLOAT": (0.5, 2.0), "STR": ("a", "b")}[inner]
        return [str(v) for v in values], values
    return {"INT": (["3"], 3), "FLOAT": (["0.5"], 0.5), "STR": (["x"], "x")}[metavar]


@pytest.mark.parametrize("name", FIELDS)
def test_every_flag_in_the_help_is_taken_as_written(name: str) -> None:
    annotation = get_type_hints(PPOConfig, include_extras=True)[name]
    metavar = field_metavar(annotation)
    option = flag(name)
    assert (f"  {option}, --no-{option[2:]}" if metavar is None else f"  {option} {metavar}") in _help()
    if metavar is None:
        for argv, expected in (([option], True), ([f"--no-{option[2:]}"], False)):
            assert getattr(parse_config(argv, validate=False), name) is expected
        return
    values, expected = _sample(annotation, metavar)
    parsed = getattr(parse_config([option, *values], validate=False), name)
    assert parsed == expected, (option, values, parsed)


def test_demo_help_shows_the_demo_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run(["demo", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "ppo-driver demo --dry-run" in text
    block = text[text.index("  --num-rollout INT") :].split("\n  --", 1)[0]
    assert "(default: 80)" in block


def test_help_defaults_come_from_the_config_file(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("rollout-batch-size: 12\n")
    with pytest.raises(SystemExit):
        parse_config(["--config", str(config), "--help"])
    text = capsys.readouterr().out
    block = text[text.index("  --rollout-batch-size INT") :].split("\n  --", 1)[0]
    assert "(default: 12)" in block


def test_plot_without_arguments_prints_its_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["plot"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ppo-driver plot") and "RUN_DIR" in err and "Traceback" not in err
