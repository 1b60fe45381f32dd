"""The command line and YAML into a `Config`: defaults < `--config run.yaml` < flags, then what a
launcher or a `--deepspeed` file fixes (`toolkit.layout.launcher`, `toolkit.layout.deepspeed`), then
`validate`. Here: turning a flag string or a YAML value into its field's type (`_coerce`, with the same
checks and messages for both), the names other tools use for our flags and keys (`translate_aliases`,
`translate_keys`, `closest_key`; their tables are `toolkit.config.foreign`'s), the argparse parser
(`build_parser`), YAML reading and writing (`load_yaml`, `save_config`), and `parse_config`, which says
every problem in one `UserError`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import typing
from pathlib import Path
from typing import Any, Collection

import yaml

from toolkit.config.foreign import ALIASES, FOREIGN, HINT_ONLY, MISSING, hint, joined, normalize, translate
from toolkit.config.paths import dataset_problems, eval_dataset_problems
from toolkit.config.schema import Config, _field_type, _fields
from toolkit.config.checks import validate
from toolkit.errors import UserError
from toolkit.layout.deepspeed import adopt_deepspeed_file
from toolkit.layout.launcher import adopt_launcher


# keys whose YAML value may take more than one shape: what to say when it has another
SHAPES = {"reward": "a list of reward specs, or one", "reward_weights": "a list of numbers, or 'w1,w2,...'",
          "columns": "a mapping of ours: yours (instruction: prompt) or a string OURS=YOURS,...",
          "lora_targets": "a list of module names, a comma-separated string, or all-linear",
          "dataset": "a path (a.jsonl, or a mixture a.jsonl:0.7,b.json:0.3), or a list of sources, each a path or "
                     "{path, weight, columns}",
          "eval_dataset": "a path, or {path, columns}"}


def _column_mapping(value: dict, where: str, forbidden: str = ",=") -> str:
    """A YAML mapping of ours: yours as --columns writes it, each name checked to be one column."""
    for ours, yours in value.items():
        if not isinstance(yours, (str, int, float)) or isinstance(yours, bool) or any(c in str(yours)
                                                                                      for c in forbidden):
            shape = {list: "a list", dict: "a mapping"}.get(type(yours))
            got = f"{shape} ({yours!r})" if shape else repr(yours)
            raise UserError(f"{where}: '{ours}' maps to {got}; a column name must be a string without "
                            f"{' or '.join(repr(c) for c in forbidden)} (one column for each of ours, e.g. "
                            f"{ours}: prompt)")
    return ",".join(f"{k}={v}" for k, v in value.items())


def _dataset_sources(value: Any, where: str) -> str:
    """YAML's list of sources (each a path string or `{path, weight, columns}`; one mapping alone is one
    source) as `toolkit.config.datasets` writes them: a.json:0.5:instruction=prompt;output=response,b.json."""
    from toolkit.config.datasets import source_spec

    out = []
    for entry in value if isinstance(value, list) else [value]:
        if isinstance(entry, str):
            out.append(entry)
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise UserError(f"{where}: each source is a path or a mapping with a path ({{path: a.jsonl, weight: 0.5, "
                            f"columns: {{instruction: prompt}}}}), got {entry!r}")
        unknown = sorted(set(entry) - {"path", "weight", "columns"})
        if unknown:
            raise UserError(f"{where}: source {entry['path']} has unknown key(s) {', '.join(map(str, unknown))}; a "
                            "source takes path, weight and columns")
        weight, columns = entry.get("weight"), entry.get("columns") or {}
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))):
            raise UserError(f"{where}: source {entry['path']}'s weight must be a number, got {weight!r}")
        if isinstance(columns, str):
            columns = {k: v for k, v in (e.split("=", 1) for e in columns.split(",") if "=" in e)}
        if not isinstance(columns, dict):
            raise UserError(f"{where}: source {entry['path']}'s columns must be a mapping of ours: yours, got "
                            f"{columns!r}")
        _column_mapping(columns, f"{where}: source {entry['path']}'s columns", ",;:=")
        out.append(source_spec(entry["path"], None if weight is None else float(weight), columns))
    return ",".join(out)


def _coerce(key: str, value: Any, origin: str, name: str | None = None) -> Any:
    """Turn a flag string or a YAML value into the field's type, or raise naming the key (as `name`
    where the user wrote another: a YAML key of transformers' Trainer, `ALIASES`)."""
    section, f = _fields()[key]
    tp, optional = _field_type(section, f)
    where = f"--{key.replace('_', '-')}" if origin == "flag" else f"'{name or key}' in {origin}"
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "auto")):
        if optional:
            return None
        raise UserError(f"{where} needs a value")
    try:
        if tp is bool:
            if isinstance(value, bool):
                out: Any = value
            elif str(value).lower() in ("1", "true", "yes", "on"):
                out = True
            elif str(value).lower() in ("0", "false", "no", "off"):
                out = False
            else:
                raise ValueError
        elif tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            out = int(value) if not isinstance(value, str) else int(value.strip())
        elif tp is float:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
        else:
            if isinstance(value, (list, tuple)) and key in ("lora_targets", "reward_weights"):
                value = ",".join(map(str, value))
            # one spec per flag or list item (a spec may hold a comma: a regex)
            if isinstance(value, (list, tuple)) and key in ("reward", "tools", "environment"):
                value = "\n".join(map(str, value))
            if isinstance(value, dict) and key == "columns":
                value = _column_mapping(value, where)
            if isinstance(value, (list, dict)) and key in ("dataset", "eval_dataset"):
                value = _dataset_sources(value, where)
            if not isinstance(value, (str, int, float)):
                raise ValueError
            out = str(value)
    except (TypeError, ValueError):
        kind = SHAPES.get(key) or {bool: "true or false", int: "an integer", float: "a number"}.get(tp, "a string")
        shape = {list: "a list", tuple: "a list", dict: "a mapping"}.get(type(value))
        raise UserError(f"{where} must be {kind}, got " + (f"{shape} ({value!r})" if shape else repr(value))) from None
    choices = f.metadata.get("choices")
    if choices and out is not None and out not in choices:
        names = [str(c) for c in choices]
        hint = difflib.get_close_matches(str(out), names, n=1)
        also = f" (did you mean '{hint[0]}'?)" if hint and hint[0] != str(out) else ""
        raise UserError(f"{where} must be one of {', '.join(names)}; got '{out}'{also}")
    return out


# Trainer's booleans: --bf16 [true|false] -> --mixed-precision bf16
PRECISION_ALIASES = ("bf16", "fp16")


def translate_aliases(argv: list[str], typed: dict[str, str] | None = None) -> list[str]:
    """The flag names people bring from transformers' Trainer, TRL, axolotl and LLaMA-Factory, as ours
    (`toolkit.config.foreign`): `--learning_rate` -> `--lr`, `--output_dir` -> `--output-dir` (underscores
    for any of ours), `--bf16` [true|false] -> `--mixed-precision bf16`, `--load_in_4bit` -> `--method
    qlora`. Only names that are no flag of ours are translated; --help shows ours. `typed` gets our
    flag -> the name typed for it, so a problem is said in the user's words."""
    out: list[Any] = []
    typed = {} if typed is None else typed
    theirs = _their_flags(argv)
    # hub_model_id, read by push_to_hub
    consumed = {FOREIGN[k].reads for k in theirs if FOREIGN[k].reads}
    # our key -> (value, as typed) from their flags
    found: dict[str, list[tuple[Any, str]]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = name.replace("-", "_")
        nxt = argv[i + 1] if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        settings, took = _their_flag(key, value if eq else MISSING, nxt, theirs) if name else (None, False)
        # one of ours, given their kind of value (push_to_hub true without a repo)
        if isinstance(settings, str):
            raise UserError(f"--{name}{' ' + nxt if took else ''}: {settings}")
        if settings is not None:
            said = f"{arg} {nxt}" if took else arg
            for ours, v in settings.items():
                found.setdefault(ours, []).append((v, said))
                # where it goes: the first of their flags that sets it
                out.append((ours,))
            i += 1 + took
            continue
        if key in consumed and key not in _fields():
            i += 1 + (nxt is not None)
            continue
        if name in PRECISION_ALIASES or key in PRECISION_ALIASES:
            if not eq and i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false", "1", "0", "yes", "no"):
                value, i = argv[i + 1], i + 1
            if (value or "true").lower() in ("true", "1", "yes"):
                out += ["--mixed-precision", key]
                typed["--mixed-precision"] = f"--{name}"
        elif name and (key in ALIASES and key not in HINT_ONLY or ("_" in name and key in _fields())):
            ours = f"--{ALIASES.get(key, key).replace('_', '-')}"
            out.append(f"{ours}{eq}{value}")
            typed[ours] = f"--{name}"
        else:
            # our own name typed after the other: ours is the one read
            if name and typed.get(f"--{name}"):
                del typed[f"--{name}"]
            out.append(arg)
        i += 1
    flags = {k: _as_flag(k, v) for k, v in _agreed(found, typed).items()}
    return [a for item in out for a in (flags.pop(item[0], []) if isinstance(item, tuple) else [item])]


def _their_flags(argv: list[str]) -> dict[str, Any]:
    """Their options among the flags (`toolkit.config.foreign.FOREIGN`), name -> the value after it
    (None: none), for one that reads another's (`Foreign.reads`: push_to_hub's hub_model_id)."""
    out: dict[str, Any] = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name.replace("-", "_") in FOREIGN:
            after = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            out[name.replace("-", "_")] = value if eq else after
    return out


def _their_flag(key: str, value: Any, nxt: str | None, theirs: dict[str, Any]) -> tuple[dict | str | None, bool]:
    """(our settings for their flag `--key [value]`, or the line refusing it, or None; whether the
    next argument was its value)."""
    entry = FOREIGN.get(key)
    if entry is None:
        return None, False
    took = value is MISSING and nxt is not None and (not entry.switch or isinstance(normalize(nxt), bool))
    if value is MISSING and nxt is not None and not took and key in _fields():
        # ours, with its value: --push_to_hub me/x
        return None, False
    settings = translate(key, nxt if took else value, theirs, ours=key in _fields())
    if isinstance(settings, str) and key not in _fields():
        # said as an unknown flag, with what to use instead (`_unknown`)
        return None, False
    return settings, took and settings is not None


def _agreed(found: dict[str, list[tuple[Any, str]]], typed: dict[str, str], where: str = "",
            given: Collection[str] = ()) -> dict[str, Any]:
    """Our settings from what their options set (`found`: our key -> (value, as they wrote it)), where
    they agree or join (`foreign_names.JOINS`: use_peft with load_in_4bit is qlora), else one line each;
    `typed` learns their words for each, except for a key a flag sets (`given`: the flag wins)."""
    out, problems = {}, []
    for key, said in found.items():
        ok, out[key] = joined(key, [v for v, _ in said])
        if not ok:
            problems.append(f"{' and '.join(s for _, s in said)}{where} disagree (--{key.replace('_', '-')} "
                            f"{' vs '.join(str(v) for v, _ in said)}); keep one")
        # a problem with the value is said in their words: --load_in_4bit with ZeRO-3 ...
        elif key not in given:
            typed[" ".join(_as_flag(key, out[key]))] = " and ".join(dict.fromkeys(s for _, s in said)) + where
    if problems:
        raise UserError("; ".join(problems))
    return out


def _as_flag(key: str, value: Any) -> list[str]:
    flag = f"--{key.replace('_', '-')}"
    if isinstance(value, bool):
        return [flag if value else f"--no-{flag[2:]}"]
    return [flag, str(value)]


def translate_keys(loaded: dict[str, Any], path: str, typed: dict[str, str], given: dict[str, Any]) -> dict[str, Any]:
    """A YAML file's keys of Trainer, TRL, axolotl or LLaMA-Factory whose values translate (`adapter:
    qlora`, `load_in_4bit: true`, `lr_scheduler_type: cosine`) as ours; the rest as they are (ours,
    `ALIASES`, or unknown: said with what to use instead). Two that disagree are one line, as is one
    that disagrees with our own key in the same file; a flag given wins over both."""
    settings = {k: translate(k, v, loaded, ours=k in _fields()) for k, v in loaded.items()}
    refused = [f"'{k}: {_shown(loaded[k])}' in {path}: {s}" for k, s in settings.items()
               # theirs are said as unknown keys, with what to use
               if isinstance(s, str) and k in _fields()]
    if refused:
        raise UserError("; ".join(refused))
    translated = {k: s for k, s in settings.items() if isinstance(s, dict)}
    # push_to_hub reads hub_model_id
    done = {*translated, *(FOREIGN[k].reads for k in translated if FOREIGN[k].reads)}
    found: dict[str, list[tuple[Any, str]]] = {}
    for k, ours in translated.items():
        for key, v in ours.items():
            found.setdefault(key, []).append((v, f"'{k}: {_shown(loaded[k])}'"))
    # our own key in the same file is read with theirs
    for ours in found:
        if ours in loaded and ours not in done:
            found[ours].append((loaded[ours], f"'{ours}: {_shown(loaded[ours])}'"))
    return {**{k: v for k, v in loaded.items() if k not in done}, **_agreed(found, typed, f" in {path}", given)}


def _shown(value: Any) -> str:
    """A YAML value as the user wrote it: true, not True."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def closest_key(name: str) -> str | None:
    """Our key that does the job of a misspelt or foreign name, if there is one: a foreign name by
    `toolkit.config.foreign`' tables (never by a close spelling of an unrelated key of ours), and a
    near typo of ours or theirs ('lerning_rate' finds 'lr')."""
    return hint(name.lstrip("-").replace("-", "_"), [*_fields(), "config"])[0]


def _unknown(key: str, origin: str) -> UserError:
    ours, instead = hint(key.lstrip("-").replace("-", "_"), [*_fields(), "config"])
    if origin == "flag":
        if instead:
            return UserError(f"{key}: not a flag here; {instead}")
        return UserError(f"unknown flag {key}" + (f" (did you mean --{ours.replace('_', '-')}?)" if ours
                                                   else "; see --help"))
    if instead:
        return UserError(f"'{key}' in {origin}: not a key here; {instead}")
    return UserError(f"unknown key '{key}' in {origin}" + (f" (did you mean '{ours}'?)" if ours
                                                           else "; see python finetune.py --help for the keys"))


class _Parser(argparse.ArgumentParser):
    # argparse would print usage + exit
    def error(self, message: str) -> typing.NoReturn:
        raise UserError(message)


def build_parser(prog: str = "finetune.py") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, allow_abbrev=False, argument_default=argparse.SUPPRESS,
                     description="Finetune a Hugging Face causal LM. Every flag is also a YAML key "
                                 "(dashes -> underscores) for --config.")
    parser.add_argument("--config", help="YAML file of keys; flags override it")
    for section in dataclasses.fields(Config):
        group = parser.add_argument_group(section.name)
        for key, (sec, f) in _fields().items():
            if sec != section.name:
                continue
            tp, _ = _field_type(sec, f)
            # shown once, as the metavar
            names = [str(c) for c in f.metadata.get("choices", ())]
            help_ = f.metadata["help"] + _default_note(f)
            flag = f"--{key.replace('_', '-')}"
            if tp is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_)
            # given once per function
            elif key in ("reward", "tools", "environment"):
                group.add_argument(flag, action="append", metavar="SPEC", help=help_)
            else:
                group.add_argument(flag, metavar="{" + ",".join(names) + "}" if names else key.upper(), help=help_)
    return parser


def _default_note(f: dataclasses.Field) -> str:
    """' (default: X)' unless the help already says it, the default is unset, or a switch is off."""
    default = f.default if f.default is not dataclasses.MISSING else None
    if "default" in f.metadata["help"] or default is None or default is False or default == "":
        return ""
    return " (default: on)" if default is True else f" (default: {default})"


def load_yaml(path: str) -> dict[str, Any]:
    """Flat `key: value` YAML; section-nested YAML (`train: {lr: ...}`) is accepted too, where a key
    may leave out its section's prefix (`plan: {gpu: h100}` is `plan_gpu: h100`)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"--config {path}:{at} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of keys to values, got {type(data).__name__}")
    sections = {s.name for s in dataclasses.fields(Config)}
    flat: dict[str, Any] = {}
    for k, v in data.items():
        k = str(k).replace("-", "_")
        if k in sections and isinstance(v, dict):
            for kk, vv in v.items():
                kk = str(kk).replace("-", "_")
                flat[f"{k}_{kk}" if kk not in _fields() and f"{k}_{kk}" in _fields() else kk] = vv
        else:
            flat[k] = v
    return flat


def parse_config(argv: list[str] | None = None, prog: str = "finetune.py", check_dataset: bool = True) -> Config:
    """defaults < --config YAML < flags; raises `UserError` for any problem, collected once, naming
    each setting as the user wrote it. `check_dataset=False` leaves the dataset's files unlooked-for
    (`plan --config` reads a recipe on a machine that need not hold its data)."""
    from toolkit.layout.launcher import local_rank_problem, pop_local_rank

    argv = sys.argv[1:] if argv is None else argv
    # DeepSpeed's launcher appends --local_rank=K
    argv, local_rank, problem = pop_local_rank(argv)
    problem = problem or local_rank_problem(local_rank, os.environ)
    if problem:
        raise UserError(problem)
    # our flag -> what the user wrote for it, where that was another name
    typed: dict[str, str] = {}
    try:
        return _parse(argv, prog, typed, check_dataset)
    # said in the user's words: --per_device_train_batch_size, not --micro-batch-size
    except UserError as e:
        raise UserError(_in_typed_words(str(e), typed)) from None


def _in_typed_words(message: str, typed: dict[str, str]) -> str:
    import re

    for ours, theirs in typed.items():
        message = re.sub(re.escape(ours) + r"(?![\w-])", lambda _: theirs, message)
    return message


def _parse(argv: list[str], prog: str, typed: dict[str, str], check_dataset: bool) -> Config:
    parser = build_parser(prog)
    ns, extra = parser.parse_known_args(translate_aliases(argv, typed))
    flags = [a.split("=")[0] for a in extra if a.startswith("-")]
    # every unknown flag in one line, not the first of several runs
    if flags:
        raise UserError("; ".join(str(_unknown(f, "flag")) for f in dict.fromkeys(flags)))
    if extra:
        raise UserError(f"unexpected argument '{extra[0]}' (flags take the form --name value)")
    given = vars(ns)
    values: dict[str, Any] = {}
    # every problem of the YAML and the values, said together in one line
    problems: list[str] = []
    if "config" in given:
        path = given.pop("config")
        loaded = translate_keys(load_yaml(path), path, typed, given)
        unknown = [k for k in loaded if k not in _fields() and (k not in ALIASES or k in HINT_ONLY)
                   and k not in PRECISION_ALIASES]
        problems += [str(_unknown(k, path)) for k in unknown]
        for k, v in ((k, v) for k, v in loaded.items() if k not in unknown):
            ours = "mixed_precision" if k in PRECISION_ALIASES else ALIASES.get(k, k)
            # a flag, if given, is what the run reads
            if ours != k and ours not in given:
                typed.setdefault(f"--{ours.replace('_', '-')}", f"'{k}' in {path}")
            try:
                # Trainer's bf16: true
                if k in PRECISION_ALIASES:
                    # a boolean, read as our booleans are
                    if _coerce("overwrite_output_dir", v, path, name=k):
                        values["mixed_precision"] = k
                    continue
                values[ours] = _coerce(ours, v, path, name=k)
            # said with the others; the key keeps its default meanwhile
            except UserError as e:
                problems.append(str(e))
    for k, v in given.items():
        try:
            values[k] = _coerce(k, v, "flag")
        except UserError as e:
            problems.append(str(e))
    settings, notes = _Settings(values), []
    # --resume typed over a config file that overwrites its output folder (as the quickstarts' do, to run again
    # from scratch): resuming is what was asked, so the file's overwrite is not applied; typed together they contradict
    if given.get("resume") and "overwrite_output_dir" not in given and settings.get("overwrite_output_dir"):
        settings["overwrite_output_dir"] = False
        notes.append(f"--resume {given['resume']}: the config's overwrite_output_dir: true is not applied (it would "
                     "delete the checkpoints to resume from)")
    adopted = (adopt_launcher(settings, set(values), notes)
               or adopt_deepspeed_file(settings, set(values), notes, _coerce))
    if adopted:
        raise UserError("; ".join(problems + adopted))
    cfg = Config.from_values({k: v for k, v in settings.items() if k in _fields()}, tuple(notes))
    checked = validate(cfg)
    if not check_dataset:
        files = dataset_problems(cfg.data.dataset) + eval_dataset_problems(cfg.data.eval_dataset, cfg.data.eval_split)
        checked = [p for p in checked if p not in files]
    if problems + checked:
        raise UserError("; ".join(problems + checked))
    return cfg


class _Settings(dict):
    """The flat key -> value settings being resolved (flags and YAML so far); a key not set reads
    as its default. What a launcher or a --deepspeed file fixes is written here before the frozen
    `Config` is built from it."""

    def __missing__(self, key: str) -> Any:
        section, f = _fields()[key]
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as flat YAML that `--config` reads back to the same run."""
    flat = cfg.flat()
    flat["lr"] = cfg.lr
    try:
        path.write_text(yaml.safe_dump(flat, sort_keys=False))
    # a write names no file: this one is said with its path (toolkit.errors)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
