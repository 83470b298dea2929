"""Each command-line flag is declared once: a flag that several commands take comes
from one option object or factory in ``mlx_mtp/cli.py``, so its name, short flag, type
and help cannot drift apart between commands. bench writes its results with
``--output`` (``--json``, its old spelling, is a deprecated alias for one release)."""

import ast
import json
import re
from collections import defaultdict
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mlx_mtp import cli

CLI_SOURCE = Path(cli.__file__)


def _is_click_option(func: ast.expr) -> bool:
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "option"
        and isinstance(func.value, ast.Name)
        and func.value.id == "click"
    )


def _flag_patterns(arg: ast.expr) -> list:
    """The long flags a ``click.option`` argument names, as regular expressions: a
    literal ``"--a/--no-a"`` gives both flags, an f-string such as
    ``f"--{kind}-penalty"`` gives ``--.+-penalty``; any other argument gives none."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        pieces = [arg.value]
    elif isinstance(arg, ast.JoinedStr):
        pieces = [v.value if isinstance(v, ast.Constant) else None for v in arg.values]
    else:
        return []
    pattern = "".join(".+" if p is None else re.escape(p) for p in pieces)
    text = "".join("x" if p is None else p for p in pieces)
    return [p for p, t in zip(pattern.split("/"), text.split("/")) if t[:2] == "--"]


def declarations(source: str) -> list:
    """(line, flag patterns) of every ``click.option(...)`` call in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _is_click_option(node.func):
            patterns = [p for arg in node.args for p in _flag_patterns(arg)]
            found.append((node.lineno, patterns))
    return found


def declaring_lines(flag: str, decls: list) -> list:
    """Lines of the ``click.option`` calls in ``decls`` that declare ``flag``."""
    return [
        line for line, patterns in decls if any(re.fullmatch(p, flag) for p in patterns)
    ]


def options_by_flag() -> dict:
    """Each long flag of the CLI: the (command name, `click.Option`) pairs taking it."""
    found = defaultdict(list)
    for name, command in cli.main.commands.items():
        for param in command.params:
            if isinstance(param, click.Option):
                for flag in param.opts + param.secondary_opts:
                    if flag.startswith("--"):
                        found[flag].append((name, param))
    return found


def signature(option: click.Option) -> str:
    """What a user sees of an option: its type, help, default and multiple."""
    info = option.to_info_dict()
    keys = ("type", "help", "default", "multiple")
    return json.dumps([info[k] for k in keys], default=repr, sort_keys=True)


def test_each_flag_is_declared_by_one_click_option():
    """No long flag appears in two ``click.option(...)`` calls of the CLI's source:
    commands share the option object or the factory that declares it."""
    decls = declarations(CLI_SOURCE.read_text())
    count = defaultdict(list)
    for line, patterns in decls:
        for pattern in patterns:
            count[pattern].append(line)
    repeated = {
        p.replace("\\", ""): lines for p, lines in count.items() if len(lines) > 1
    }
    assert not repeated, f"flags declared more than once (lines): {repeated}"


def test_the_source_scan_sees_every_visible_flag():
    """Every visible flag of the command tree comes from a ``click.option`` call the
    scan above reads (so a flag cannot escape it); only hidden aliases of old
    spellings, declared by `renamed_option` and `deprecated_option`, may not."""
    decls = declarations(CLI_SOURCE.read_text())
    unseen = {
        flag: [name for name, _ in uses]
        for flag, uses in options_by_flag().items()
        if not declaring_lines(flag, decls)
        and not all(option.hidden for _, option in uses)
    }
    assert not unseen, f"flags not declared by a click.option call: {unseen}"


def test_flags_several_commands_take_agree_or_share_one_declaration():
    """A flag taken by several commands either means the same to each (type, help,
    default and multiple identical) or is declared in exactly one place."""
    decls = declarations(CLI_SOURCE.read_text())
    uses = options_by_flag()
    assert len(uses) > 50  # the walk reached the commands
    differing = {}
    for flag, pairs in uses.items():
        if len({signature(option) for _, option in pairs}) < 2:
            continue
        lines = declaring_lines(flag, decls)
        if len(lines) != 1:
            differing[flag] = {"commands": [n for n, _ in pairs], "lines": lines}
    assert not differing, f"flags that differ between commands: {differing}"


def test_json_is_the_json_output_flag_wherever_it_is_visible():
    """``--json`` means "make the output a JSON object" on every command that shows
    it; bench's results file is ``--output``."""
    for name, option in options_by_flag()["--json"]:
        if not option.hidden:
            assert option.is_flag and option.help == "Make the output a JSON object."
    bench = {o.name: o for o in cli.main.commands["bench"].params}
    assert "-o" in bench["output"].opts and "--output" in bench["output"].opts


@pytest.fixture
def fake_bench(monkeypatch):
    """bench without a model: `load` and the benchmark replaced, a fixed result."""
    import mlx_mtp.bench
    import mlx_mtp.loading

    result = {"rows": [{"k": 2, "tokens_per_s": 123.0}]}
    monkeypatch.setattr(mlx_mtp.loading, "load", lambda *a, **k: (None, None))
    monkeypatch.setattr(mlx_mtp.bench, "bench", lambda *a, **k: result)
    return result


def test_bench_output_writes_the_results(fake_bench, tmp_path):
    for flag in ("--output", "-o"):
        out = tmp_path / f"{flag.strip('-')}.json"
        result = CliRunner().invoke(cli.main, ["bench", "--model", "m", flag, out])
        assert result.exit_code == 0, result.output
        assert json.loads(out.read_text()) == fake_bench
        assert "deprecated" not in result.stderr


def test_bench_json_is_a_deprecated_alias_of_output(fake_bench, tmp_path):
    """``bench --json PATH`` still writes the results to PATH, as ``--output PATH``
    does, after one warning line on stderr; giving both is a usage error."""
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    runner = CliRunner()
    alias = runner.invoke(cli.main, ["bench", "--model", "m", "--json", str(old)])
    assert alias.exit_code == 0, alias.output
    current = runner.invoke(cli.main, ["bench", "--model", "m", "--output", str(new)])
    assert current.exit_code == 0, current.output
    assert old.read_bytes() == new.read_bytes()
    warnings = [line for line in alias.stderr.splitlines() if "deprecated" in line]
    assert warnings == [
        "mlx-mtp: warning: --json is deprecated here: use --output (--json is removed "
        "in the next release)"
    ]
    both = ["bench", "--model", "m", "--json", str(old), "--output", str(new)]
    refused = runner.invoke(cli.main, both)
    assert refused.exit_code == 2
    assert "--json and --output cannot go together" in refused.output
    assert "--json" not in runner.invoke(cli.main, ["bench", "--help"]).output
