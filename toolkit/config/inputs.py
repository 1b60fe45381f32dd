"""What a run reads and writes, checked before anything heavy loads: the dataset's path or mixture,
`--columns`, what `--streaming` allows, `--sample-prompts`, the output folder. Standard library only:
config validation calls these, and the data and train layers read `--columns` and the prompts here."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.datasets import is_mixture, parse_sources, spec_problems
from toolkit.errors import UserError

# the fields the formats read (toolkit.data.formats), which --columns may map a dataset's columns to
DATA_FIELDS = ("instruction", "input", "output", "system", "messages", "conversations", "text",
               "prompt", "chosen", "rejected", "completion", "label")  # from prompt on: preference data (pairs, KTO)
# how the turns of messages / conversations (and of preference data's message lists) are written, as LLaMA-
# Factory's dataset_info `tags`: the key of a turn's speaker (ours: role, ShareGPT's from) and of its text
# (content, ShareGPT's value), and your speaker values for our three roles (beside ShareGPT's own names)
TURN_FIELDS = ("role", "content", "user_role", "assistant_role", "system_role")
ROLE_FIELDS = {"user_role": "user", "assistant_role": "assistant", "system_role": "system"}
# names people give our fields, for "did you mean": a hint names only a field that does the same job
# (difflib alone offered 'conversations' for 'completion', 'prompt' for 'from', 'content' for 'context')
SAME_JOB = {"response": "output", "answer": "output", "reply": "output", "target": "output",
            "question": "instruction", "query": "instruction", "context": "input", "system_prompt": "system",
            "dialog": "conversations", "dialogue": "conversations", "turns": "conversations",
            "history": "conversations", "from": "role", "speaker": "role", "role_tag": "role", "value": "content",
            "content_tag": "content", "user": "user_role", "human": "user_role", "user_tag": "user_role",
            "assistant": "assistant_role", "gpt": "assistant_role", "assistant_tag": "assistant_role",
            "system_tag": "system_role", "good": "chosen", "preferred": "chosen", "bad": "rejected",
            "kto_tag": "label"}


def parse_columns(spec: str) -> dict[str, str]:
    """'instruction=prompt,output=response' -> {'instruction': 'prompt', 'output': 'response'}."""
    pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
    return {ours.strip(): yours.strip() for ours, *rest in pairs for yours in rest}


def same_job(name: str) -> str | None:
    """The field `name` most likely means: a name people use for it (`SAME_JOB`), or a typo of one."""
    if name in SAME_JOB:
        return SAME_JOB[name]
    hint = difflib.get_close_matches(name, DATA_FIELDS + TURN_FIELDS, n=1, cutoff=0.8)
    return hint[0] if hint else None


def column_problems(spec: str, where: str = "--columns") -> list[str]:
    """What is wrong with a column mapping (`where`: --columns, or the --dataset source that gives its own)."""
    problems, seen = [], []
    for item in (i for i in spec.split(",") if i.strip()):
        ours, sep, yours = (x.strip() for x in item.partition("="))
        seen.append(ours)
        if not sep or not ours or not yours:
            problems.append(f"{where} {item.strip()!r}: write OURS=YOURS, e.g. --columns "
                            "instruction=prompt,output=response")
        elif ours not in DATA_FIELDS + TURN_FIELDS:
            hint = same_job(ours)
            problems.append(f"{where} {item.strip()}: '{ours}' is not a field the formats read"
                            + (f" (did you mean '{hint}'?)" if hint else "")
                            + f"; use one of {', '.join(DATA_FIELDS)}, or for the turns of messages/conversations "
                            f"{', '.join(TURN_FIELDS)}")
    twice = sorted({k for k in seen if seen.count(k) > 1})
    if twice:
        problems.append(f"{where} maps {', '.join(twice)} more than once; give one column for each")
    return problems


def record_columns(spec: str) -> dict[str, str]:
    """{ours: yours} of the mapping's record columns (`DATA_FIELDS`): the renames a dataset gets."""
    return {k: v for k, v in parse_columns(spec).items() if k not in TURN_FIELDS}


@dataclass(frozen=True)
class Turns:
    """How a file writes a turn: the key of its speaker and of its text ("": the format's own), and your
    speaker values for our roles, (yours, ours) pairs, read beside ShareGPT's names."""

    role: str = ""
    content: str = ""
    roles: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.role or self.content or self.roles)

    def keys(self, role: str, content: str) -> tuple[str, str]:
        """The speaker's and the text's key: yours, else the format's (`role`, `content`)."""
        return self.role or role, self.content or content

    def role_of(self, speaker: str) -> str | None:
        return dict(self.roles).get(speaker)


def turn_mapping(spec: str) -> Turns:
    """The turn keys and role values of a column mapping (`TURN_FIELDS`)."""
    mapping = parse_columns(spec)
    return Turns(mapping.get("role", ""), mapping.get("content", ""),
                 tuple((yours, ROLE_FIELDS[ours]) for ours, yours in mapping.items() if ours in ROLE_FIELDS))


DATA_SUFFIXES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def streaming_problems(dataset: str, eval_split: float, max_steps: int) -> list[str]:
    """What `--streaming` cannot do: count epochs, hold data out, or read a mixture or built-in data."""
    why = "a stream has no length to count epochs by"
    p = [] if max_steps > 0 else [f"--streaming needs --max-steps ({why})"]
    if eval_split > 0:
        p.append("--streaming with --eval-split is not supported (a stream holds nothing out); drop one")
    if is_mixture(dataset) or dataset.startswith("builtin:"):
        p.append(f"--streaming reads one dataset file, folder or hub id (got --dataset {dataset}); "
                 "drop --streaming for mixtures and built-in data")
    return p


def dataset_problems(spec: str, flag: str = "--dataset") -> list[str]:
    """One source, or each source of a mixture (`toolkit.config.datasets`): its path, and its own columns."""
    problems = spec_problems(spec, flag)
    if problems:
        return problems
    sources = parse_sources(spec)
    return [p for s in sources for p in column_problems(s.columns, f"{flag} {s.spec}:")] + \
        [p for s in sources for p in _dataset_path_problems(s.spec, flag)]


def unused_columns_problems(columns: str, dataset: str, eval_dataset: str) -> list[str]:
    """--columns where every source gives its own columns (which are used instead): it would be ignored."""
    sources = parse_sources(dataset) + (parse_sources(eval_dataset) if eval_dataset else [])
    if not columns or not all(s.columns for s in sources):
        return []
    both = " and --eval-dataset" if eval_dataset else ""
    return [f"--columns {columns} applies to no source: each source of --dataset{both} gives its own columns, "
            "used instead; drop --columns, or add its entries to a source's own"]


def eval_dataset_problems(spec: str, eval_split: float) -> list[str]:
    """`--eval-dataset`: one file, folder or hub id, held out as --eval-split's rows are, never both."""
    if not spec:
        return []
    if eval_split > 0:
        return [f"--eval-dataset and --eval-split {eval_split:g} both give the held-out data; drop one"]
    if is_mixture(spec):
        return [f"--eval-dataset {spec}: give one file, folder or hub id (a mixture's weights draw training "
                "examples; held-out data is evaluated whole)"]
    if spec.startswith("builtin:"):
        return [f"--eval-dataset {spec}: built-in data holds out its own eval split; use --eval-split with "
                "--dataset builtin:NAME"]
    return dataset_problems(spec, "--eval-dataset")


def _dataset_path_problems(spec: str, flag: str = "--dataset") -> list[str]:
    if spec.startswith("builtin:"):
        return []
    path = Path(spec)
    if path.suffix.lower() in DATA_SUFFIXES or os.sep in spec and not _looks_like_hub_id(spec):
        if not path.exists():
            return [f"{flag} {spec}: file not found"]
        if path.is_file() and path.suffix.lower() not in DATA_SUFFIXES:
            return [f"{flag} {spec}: unsupported file type '{path.suffix}' (use .json, .jsonl, .csv or .parquet)"]
        if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
            return [f"{flag} {spec}: cannot be read (permission denied); make it readable, or copy it somewhere "
                    "you can read it"]
    return []


def sample_prompts(spec: str) -> list[str]:
    """`--sample-prompts`: a file (a prompt per line, or JSON Lines of {"prompt": ...}) or "p1;p2"."""
    import json

    path = Path(spec)
    if not path.is_file():
        return [p.strip() for p in spec.split(";") if p.strip()]
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        out = []
        for n, line in enumerate(lines, 1):
            try:
                out.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise UserError(f"--sample-prompts {spec}: line {n} is not a JSON object with a \"prompt\"") from None
        return out
    return [line.strip() for line in lines]


def sample_problems(spec: str, pp: int, cp: int) -> list[str]:
    if not spec:
        return []
    if not sample_prompts(spec):
        return [f"--sample-prompts {spec!r} holds no prompt"]
    if pp > 1 or cp > 1:
        return [f"--sample-prompts does not run under {'--pp' if pp > 1 else '--cp'} (generation needs the whole "
                "model on each rank, or its TP/ZeRO/FSDP shards); leave it out, or sample from the saved folder "
                "with python -m toolkit generate"]
    return []


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


TRAINER_STATE = "trainer_state.json"  # a checkpoint is complete when this is in it (written last)


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """checkpoint-N folders (renamed from .tmp once complete) holding a trainer_state.json, oldest first."""
    found = [p for p in Path(out_dir).glob("checkpoint-*")
             if p.is_dir() and p.name.split("-", 1)[1].isdigit() and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


def checkpoint_step(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def finished_step(out_dir: Path) -> int | None:
    """The step a finished run's `final/` was saved at (its summary.json), 0 where final/ exists but
    the step is unknown (the run stopped between the save and the summary); None: no final/."""
    import json

    out = Path(out_dir)
    if not (out / "final").is_dir():
        return None
    try:
        return int(json.loads((out / "summary.json").read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def later_checkpoints(out_dir: Path) -> list[Path]:
    """The complete checkpoints `--resume auto` may continue from: all of them, or in a finished run's
    folder those past its final/ (written by a run that was continuing it)."""
    done, saved = finished_step(out_dir), complete_checkpoints(out_dir)
    if done is None:
        return saved
    return [c for c in saved if done and checkpoint_step(c) > done]  # final/'s step unknown: none is later


def finished_problems(output_dir: str, continue_finished: bool, max_steps: int) -> list[str]:
    """`--resume auto` in a finished run's folder: stop, saying so (its final/ is kept), unless
    `--continue-finished` asks to train it on, from its newest checkpoint, past the steps it finished."""
    out = Path(output_dir)
    done = finished_step(out)
    if done is None or later_checkpoints(out):
        return ["--continue-finished: " + output_dir + " holds no finished run (no final/); --resume auto "
                "continues an unfinished one without it"] if continue_finished and done is None else []
    at = f" at step {done}" if done else ""
    saved = complete_checkpoints(out)
    if not continue_finished:
        further = (f"--continue-finished --max-steps N (N > {done or 'its steps'}) trains it further from "
                   f"{saved[-1].name}, " if saved else "")
        return [f"--resume auto: {output_dir} holds a finished run (final/{at}) and no later checkpoint: there is "
                f"nothing to resume. {further}--overwrite-output-dir starts it again, or choose another --output-dir"]
    if not saved:
        return [f"--continue-finished: {output_dir} has no checkpoint to continue from (the run saved none: "
                "--save-every N keeps some); start a new run from its final/ in another --output-dir"]
    if max_steps <= done:
        return [f"--continue-finished: the run finished {done} steps; pass --max-steps beyond them "
                f"(got {max_steps if max_steps > 0 else 'none, so --epochs decides'})"]
    return []


def output_dir_problems(output_dir: str, overwrite: bool, resume: str, continue_finished: bool = False,
                        max_steps: int = -1) -> list[str]:
    """A file in the way, a folder that cannot be written, a run's folder that is not empty, or
    `--resume auto` on a run that is finished. Each refusal offers only what would work there."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        return [f"--output-dir {output_dir} is a file, not a folder"]
    unwritable = _unwritable(out)
    if unwritable:
        return [f"--output-dir {output_dir}: {unwritable}; choose a folder you can write to"]
    if continue_finished and resume != "auto":
        return ["--continue-finished goes with --resume auto (it continues the finished run in --output-dir)"]
    if resume == "auto":
        return finished_problems(output_dir, continue_finished, max_steps)
    if out.is_dir() and any(not f.name.startswith(PROBE) for f in out.iterdir()) and not overwrite and not resume:
        return [_not_empty(output_dir)]
    return []


def _not_empty(output_dir: str) -> str:
    out = Path(output_dir)
    done, saved = finished_step(out), complete_checkpoints(out)
    if done is not None:
        at = f" at step {done}" if done else ""
        further = (f"--resume auto --continue-finished --max-steps N (N > {done or 'its steps'}) trains it further, "
                   if saved else "")
        return (f"--output-dir {output_dir} holds a finished run (final/{at}); {further}--overwrite-output-dir "
                "replaces it, or choose another folder")
    if saved:
        return (f"--output-dir {output_dir} is not empty; pass --resume auto to continue its run (from "
                f"{saved[-1].name}), --overwrite-output-dir to replace it, or choose another folder")
    return (f"--output-dir {output_dir} is not empty and holds no checkpoint to resume; pass --overwrite-output-dir "
            "to replace this toolkit's files in it (others are kept), or choose another folder")


PROBE = ".toolkit-probe-"  # `_unwritable`'s file: another rank checking the same folder at once may see it


def _unwritable(out: Path) -> str | None:
    """Why `out` cannot be created or written (None: it can): a file is made and removed in it, or
    in the nearest folder above it that exists, so root on a read-only mount is caught too."""
    import errno
    import tempfile

    here = out.absolute()
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        return f"{here} is a file, so no folder can be made under it"
    try:
        fd, probe = tempfile.mkstemp(dir=here, prefix=PROBE)
    except OSError as e:
        why = "a read-only file system" if e.errno == errno.EROFS else (e.strerror or str(e)).lower()
        return f"{here} cannot be written ({why})"
    os.close(fd)
    os.unlink(probe)
    return None
