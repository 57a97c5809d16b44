"""Typed configs for the scripts: dataclasses whose fields carry their ``--help`` text, filled from a YAML
file (``--config FILE.yaml``, or a config shipped in ``jaxseq/configs`` by name) and then from command-line
flags, which win. A YAML value goes through the same conversion and checks as the flag would."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from jaxseq.errors import JaxseqError


def arg(default: Any, help: str, **kw) -> Any:
    """A config field with its help text. ``choices=`` is passed to argparse; ``const=``: the value of the flag
    given alone; ``aliases=``: other names of the flag (transformers' ``optim`` for ``optimizer``);
    ``value_aliases=``: other names of its values (``{"adamw_torch": "adamw"}``); ``switches=``: flags that set
    this field to a value (``{"bf16": "bfloat16"}``: ``--bf16`` means ``--dtype bfloat16``)."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def shipped_configs() -> dict[str, Path]:
    """The configs shipped with jaxseq (package data in ``jaxseq/configs``), by name."""
    folder = resources.files("jaxseq") / "configs"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def config_path(value: str) -> Path:
    """``--config``: a YAML file, or the name of a shipped config (``glue_sst2``)."""
    path = Path(value).expanduser()
    if path.is_file() or "/" in value:
        return path
    return shipped_configs().get(value.removesuffix(".yaml"), path)


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


class _Canonical:
    """argparse ``type`` that maps a value's other names to its own (``adamw_torch`` -> ``adamw``)."""

    def __init__(self, aliases: dict[str, str]):
        self.aliases = aliases
        self.__name__ = "value"  # argparse names the type in its error message

    def __call__(self, value: str) -> str:
        return self.aliases.get(value, value)


class _Switch(argparse.Action):
    """``--bf16`` (or ``--bf16 true``) sets another field to one value; ``--bf16 false`` leaves it be."""

    def __init__(self, option_strings, dest, value=None, **kw):
        super().__init__(option_strings, dest, nargs="?", const=True, type=_str2bool, metavar="BOOL", **kw)
        self.value = value

    def __call__(self, parser, namespace, given, option_string=None):
        if given:
            setattr(namespace, self.dest, self.value)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Flags with their defaults; the job's description (its module docstring, example commands included)
    as written, not reflowed into one paragraph."""


class _OneLineErrors(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints usage; keep it to one line
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(description: str, *sections: type) -> argparse.ArgumentParser:
    # no abbreviations: a misspelt flag (--learning_rat) is an error, not silently another flag
    parser = _OneLineErrors(description=description, formatter_class=_HelpFormatter, allow_abbrev=False)
    parser.add_argument(
        "--config",
        type=config_path,
        default=None,
        help=f"YAML file of flag values (or a shipped config: {', '.join(sorted(shipped_configs()))}); "
        "flags given here win",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks instead of one-line errors")
    for section in sections:
        group = parser.add_argument_group(section.__name__)
        hints = typing.get_type_hints(section)
        for field in dataclasses.fields(section):
            tp = _base_type(hints[field.name])
            meta = field.metadata
            kwargs = {"help": meta.get("help", ""), "default": field.default}
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
            if "const" in field.metadata:  # the flag alone means this value
                kwargs.update(nargs="?", const=field.metadata["const"])
            if tp is bool:
                kwargs.update(type=_str2bool, nargs="?", const=True, metavar="BOOL")
            elif typing.get_origin(tp) is list:  # --prompt a --prompt b, or a list as TRL's: --reward_weights 1 0.5
                kwargs.update(type=typing.get_args(tp)[0], action="extend", nargs="+")
            elif "value_aliases" in meta:
                kwargs["type"] = _Canonical(meta["value_aliases"])
                kwargs["help"] += f" (also transformers' names: {', '.join(meta['value_aliases'])})"
            else:
                kwargs["type"] = tp if tp in (int, float, str) else str
            names = [field.name, *meta.get("aliases", ())]
            group.add_argument(*(f"--{name}" for name in names), dest=field.name, **kwargs)
            for name, value in meta.get("switches", {}).items():
                group.add_argument(
                    f"--{name}",
                    dest=field.name,
                    action=_Switch,
                    value=value,
                    default=argparse.SUPPRESS,
                    help=f"same as --{field.name} {value} (transformers' flag)",
                )
            if tp is bool:  # --no_X is --X false
                group.add_argument(
                    f"--no_{field.name}",
                    dest=field.name,
                    action=_Switch,
                    value=False,
                    default=argparse.SUPPRESS,
                    help=f"same as --{field.name} false",
                )
    return parser


def parse_args(parser: argparse.ArgumentParser, sections: tuple[type, ...], argv=None):
    """``(args, instances)``: YAML values (flat, or nested under any keys) become defaults, flags override."""
    argv = sys.argv[1:] if argv is None else argv
    pre, _ = parser.parse_known_args(argv)
    if pre.config is not None:
        values = load_yaml(pre.config, parser)
        for action in parser._actions:  # not parser.set_defaults: that would reach --bf16's action too
            if action.dest in values and not isinstance(action, _Switch):
                action.default = values[action.dest]
    args = parser.parse_args(argv)
    values = vars(args)
    instances = tuple(section(**{f.name: values[f.name] for f in dataclasses.fields(section)}) for section in sections)
    return args, instances


def load_yaml(path: Path, parser: argparse.ArgumentParser) -> dict:
    if not path.is_file():
        raise JaxseqError(
            f"config file {path} does not exist; pass a YAML file or a shipped config "
            f"({', '.join(sorted(shipped_configs()))})"
        )
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
    actions = {o[2:]: a for a in parser._actions for o in a.option_strings if o.startswith("--")}
    unknown = sorted(set(flat) - set(actions))
    if unknown:
        raise JaxseqError(f"config file {path} has unknown key(s) {', '.join(unknown)}; see --help for the names")
    values = {}
    for key, value in flat.items():
        action = actions[key]
        value = yaml_value(action, value, f"config file {path}: {key}")
        if isinstance(action, _Switch):
            if value:
                values[action.dest] = action.value
        else:
            values[action.dest] = value
    return values


def yaml_value(action: argparse.Action, value: Any, where: str) -> Any:
    """A YAML value converted and checked as the flag's string would be (type, choices); ``where`` starts the
    one-line error, which names the value expected."""
    if value is None:
        if action.default is None:
            return None
        raise JaxseqError(f"{where} is empty; give it a value (its default is {action.default!r})")
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [yaml_value(_item_of(action), item, where) for item in items]
    convert = action.type or str
    if isinstance(value, (list, dict)):
        raise JaxseqError(f"{where} must be a single value, got {value!r}")
    if convert is _str2bool:
        if isinstance(value, bool):
            return value
        if not isinstance(value, str):
            raise JaxseqError(f"{where} must be true or false, got {value!r}")
    if isinstance(value, bool) and convert is not _str2bool:
        if action.const is not None and action.nargs == "?":  # `remat: true` is the flag given alone
            return action.const if value else action.default
        raise JaxseqError(f"{where} must be {_expected(action)}, got {value!r}")
    try:
        converted = convert(value if isinstance(value, str) else str(value))
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise JaxseqError(f"{where} must be {_expected(action)}, got {value!r}") from None
    if action.choices is not None and converted not in action.choices:
        raise JaxseqError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return converted


def _item_of(action: argparse.Action) -> argparse.Action:
    """One item of a repeatable flag: the same type and choices, no default."""
    return argparse.Action(action.option_strings, action.dest, type=action.type, choices=action.choices)


def _expected(action: argparse.Action) -> str:
    if action.choices is not None:
        return f"one of {', '.join(map(str, action.choices))}"
    return {int: "an integer", float: "a number", _str2bool: "true or false"}.get(action.type, "a string")


SECRET = re.compile(r"(^|_)(token|password|secret)$")  # field names whose values never reach a file


def save_config(path: Path, *instances) -> None:
    """The config a run used, as YAML sections named after the dataclasses; secrets (``--hub_token``)
    are written as null, never as their value."""
    data = {
        type(i).__name__: {k: None if SECRET.search(k) else v for k, v in dataclasses.asdict(i).items()}
        for i in instances
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))


@dataclasses.dataclass
class Stages:
    """The stages of a run, as transformers' TrainingArguments gives every run_* script: ``--do_train``,
    ``--do_eval`` and, where a job predicts, ``--do_predict``. Every training job has them (``stage_flags``
    makes a job's section, its help saying what the job does by default)."""

    do_train: bool | None = arg(None, "train on the training data")
    do_eval: bool | None = arg(None, "evaluate on the validation data")

    def stages(
        self, default: tuple[bool, bool] = (True, True), alone: tuple[bool, bool] = (False, False)
    ) -> tuple[bool, bool, bool]:
        """(train, evaluate, predict) asked for. Given --do_train or --do_eval: only what they name. Given
        neither: the job's ``default`` training and evaluation, or with --do_predict ``alone`` (run_glue's:
        neither, it only predicts), less a stage turned off (``--do_eval false``). Flags that leave nothing to
        do are an error."""
        predict = bool(getattr(self, "do_predict", None))
        if self.do_train or self.do_eval:
            train, evaluate = bool(self.do_train), bool(self.do_eval)
        else:
            train, evaluate = alone if predict else default
            train, evaluate = train and self.do_train is None, evaluate and self.do_eval is None
        names = [f.name for f in dataclasses.fields(self)]
        if not (train or evaluate or predict) and any(getattr(self, name) is not None for name in names):
            raise JaxseqError(f"nothing to do: pass {' or '.join(f'--{name}' for name in names)}")
        return train, evaluate, predict


@functools.cache
def stage_flags(default: str, predict: str | None = None, no_eval: str | None = None) -> type[Stages]:
    """A job's ``Stages`` section (one class per job, so parsed configs compare equal), whose help says what
    a run does given neither --do_train nor --do_eval (``default``), what --do_predict does (``predict``;
    None: the job has no --do_predict), and for a job without evaluation why --do_eval is an error
    (``no_eval``)."""
    train = (
        f"train on the training data; given neither --do_train nor --do_eval a run does its default: {default} "
        "(--no_do_train, --no_do_eval: less that stage)"
    )
    evaluate = (
        f"not available, an error: {no_eval}"
        if no_eval
        else "evaluate on the validation data: after training, or without --do_train the model of "
        "--model_name_or_path (or the saved step of --resume_from_checkpoint, then exported too)"
    )
    fields = [("do_train", bool | None, arg(None, train)), ("do_eval", bool | None, arg(None, evaluate))]
    if predict:
        fields.append(("do_predict", bool | None, arg(None, f"predict the test data: {predict}")))
    return dataclasses.make_dataclass("Stages", fields, bases=(Stages,))
