"""Typed configs for the scripts: dataclasses whose fields carry their ``--help`` text, filled from a YAML
file (``--config FILE.yaml``) and then from command-line flags, which win."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxseq.errors import JaxseqError


def arg(default: Any, help: str, **kw) -> Any:
    """A config field with its help text (``choices=`` is passed to argparse; ``const=``: the value of the flag
    given alone)."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def _base_type(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _str2bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "y", "on"):
        return True
    if lowered in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


class _OneLineErrors(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints usage; keep it to one line
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(description: str, *sections: type) -> argparse.ArgumentParser:
    # no abbreviations: a misspelt flag (--learning_rat) is an error, not silently another flag
    parser = _OneLineErrors(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--config", type=Path, default=None, help="YAML file of flag values; flags given here win")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks instead of one-line errors")
    for section in sections:
        group = parser.add_argument_group(section.__name__)
        hints = typing.get_type_hints(section)
        for field in dataclasses.fields(section):
            tp = _base_type(hints[field.name])
            kwargs = {"help": field.metadata.get("help", ""), "default": field.default}
            if "choices" in field.metadata:
                kwargs["choices"] = field.metadata["choices"]
            if "const" in field.metadata:  # the flag alone means this value
                kwargs.update(nargs="?", const=field.metadata["const"])
            if tp is bool:
                kwargs.update(type=_str2bool, nargs="?", const=True, metavar="BOOL")
            elif typing.get_origin(tp) is list:  # repeatable flag: --prompt a --prompt b
                kwargs.update(type=typing.get_args(tp)[0], action="append")
            else:
                kwargs["type"] = tp if tp in (int, float, str) else str
            group.add_argument(f"--{field.name}", **kwargs)
            if tp is bool:  # --no_X is --X false
                group.add_argument(
                    f"--no_{field.name}",
                    dest=field.name,
                    action="store_false",
                    default=argparse.SUPPRESS,
                    help=f"same as --{field.name} false",
                )
    return parser


def parse_args(parser: argparse.ArgumentParser, sections: tuple[type, ...], argv=None):
    """``(args, instances)``: YAML values (flat, or nested under any keys) become defaults, flags override."""
    argv = sys.argv[1:] if argv is None else argv
    pre, _ = parser.parse_known_args(argv)
    if pre.config is not None:
        parser.set_defaults(**load_yaml(pre.config, parser))
    args = parser.parse_args(argv)
    values = vars(args)
    instances = tuple(section(**{f.name: values[f.name] for f in dataclasses.fields(section)}) for section in sections)
    return args, instances


def load_yaml(path: Path, parser: argparse.ArgumentParser) -> dict:
    if not path.is_file():
        raise JaxseqError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise JaxseqError(f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise JaxseqError(f"config file {path} must be a mapping of flag names to values")
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    known = {a.dest for a in parser._actions}
    unknown = sorted(set(flat) - known)
    if unknown:
        raise JaxseqError(f"config file {path} has unknown key(s) {', '.join(unknown)}; see --help for the names")
    return flat


SECRET = re.compile(r"(^|_)(token|password|secret)$")  # field names whose values never reach a file


def save_config(path: Path, *instances) -> None:
    """The config a run used, as YAML sections named after the dataclasses; secrets (``--hub_token``)
    are written as null, never as their value."""
    data = {
        type(i).__name__: {k: None if SECRET.search(k) else v for k, v in dataclasses.asdict(i).items()}
        for i in instances
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
