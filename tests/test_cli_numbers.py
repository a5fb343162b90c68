"""Every number option of every command refuses NaN and infinity before any work (the list is
walked from the typer app, so an option added later is covered); sizes and counts that must be
positive say so in one line."""

import inspect
import types
import typing

import pytest
import typer
from typer.models import ArgumentInfo, OptionInfo
from typer.testing import CliRunner

from handoff.cli import app

runner = CliRunner()


def _commands(group: typer.Typer, prefix: tuple = ()) -> list[tuple[tuple, typing.Callable]]:
    out = [(prefix + (c.name or c.callback.__name__.replace("_", "-"),), c.callback)
           for c in group.registered_commands]
    for g in group.registered_groups:
        out += _commands(g.typer_instance, prefix + (g.name,))
    return out


def _base(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _flag(name: str, info: OptionInfo) -> str:
    decls = [d for d in (info.param_decls or ()) if d.startswith("--")]
    return decls[0].split("/")[0] if decls else f"--{name.replace('_', '-')}"


def _required(fn) -> list[str]:
    """Placeholders for a command's required arguments and options (never reached)."""
    args = []
    for name, p in inspect.signature(fn).parameters.items():
        info = p.default
        if isinstance(info, ArgumentInfo) and info.default is ...:
            args.append("x")
        elif isinstance(info, OptionInfo) and info.default is ...:
            args += [_flag(name, info), "x"]
    return args


def _number_options(kind: type) -> list[tuple[tuple, str, list[str]]]:
    out = []
    for path, fn in _commands(app):
        hints = typing.get_type_hints(fn)
        for name, p in inspect.signature(fn).parameters.items():
            if isinstance(p.default, OptionInfo) and _base(hints[name]) is kind:
                out.append((path, _flag(name, p.default), _required(fn)))
    return out


FLOATS = _number_options(float)
INTS = _number_options(int)


def test_the_walk_finds_the_number_options():
    names = {(" ".join(path), flag) for path, flag, _ in FLOATS}
    assert ("plan", "--pcie-gbps") in names and ("bench memory", "--size-gib") in names
    assert ("generate", "--temperature") in names and len(FLOATS) >= 15 and len(INTS) >= 10


@pytest.mark.parametrize("path, flag, required", FLOATS,
                         ids=[f"{' '.join(p)} {f}" for p, f, _ in FLOATS])
def test_float_options_refuse_nan_and_infinity(path, flag, required):
    for text in ("nan", "inf", "-inf"):
        res = runner.invoke(app, [*path, *required, flag, text])
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert res.exit_code == 2, res.output
        assert len(lines) == 1 and lines[0].startswith("error:"), res.output
        assert f"{flag} " in lines[0] and "not a finite number" in lines[0]


@pytest.mark.parametrize("path, flag, required", INTS,
                         ids=[f"{' '.join(p)} {f}" for p, f, _ in INTS])
def test_integer_options_refuse_infinity_without_a_traceback(path, flag, required):
    """Parsing refuses these (typer's usage error, naming the option), before any work."""
    res = runner.invoke(app, [*path, *required, flag, "inf"])
    assert res.exit_code == 2 and f"Invalid value for '{flag}'" in res.output, res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)


@pytest.mark.parametrize("args, words", [
    (["bench", "memory", "--size-gib", "-1"], "--size-gib -1.0 is not positive"),
    (["bench", "memory", "--kv-gib", "0"], "--kv-gib 0.0 is not positive"),
    (["bench", "memory", "--repeats", "0"], "--repeats 0 is not positive"),
    (["bench", "trainer", "--model", "x", "--rows", "0"], "--rows 0 is not positive"),
    (["bench", "engine", "--util", "-0.5"], "--util -0.5 is not positive"),
])
def test_sizes_and_counts_must_be_positive(args, words):
    res = runner.invoke(app, args)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and words in lines[0], res.output
