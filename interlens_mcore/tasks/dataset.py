"""Prompt datasets: rows read with the `datasets` library, one policy reply each.

`source("train.jsonl", prompt_column="prompt")` reads JSONL, JSON, parquet or CSV files
(`datasets.load_dataset`) or a folder written by `Dataset.save_to_disk` (`load_from_disk`;
a `DatasetDict` by its `split`). The prompt column holds a string (one user message) or a
list of chat messages (`{"role": ..., "content": ...}` dicts, e.g. a system message first).

A row is a `PromptRow`: its opening transcript and `columns`, every column of the dataset row
(the prompt column too), which reward functions read as `rows[i].columns["answer"]`. The
lineup is the policy and `PromptEnd`, which ends the conversation after the reply; it gives
no reward of its own, so a dataset trains with reward functions (`--reward MODULE:FN`).

Evaluation rows come from `eval_path`, or else a held-out `eval_fraction` of the rows (chosen
by a fixed shuffle, at least one row, never a training row). `rows(n, seed)` draws training
rows without repeats while `n` allows (a fresh permutation per seed).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..rollout.conversation import Conversation, Environment, Participant, Policy
from ..types import Message, Trajectory
from .base import TaskSource
from .split import derive_seed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(eq=False)
class PromptRow:
    """One dataset row: its opening transcript and all of its columns."""

    messages: list[Message]
    columns: dict[str, object] = field(default_factory=dict)
    max_turns: int = 2  # the reply and PromptEnd's silent close
    text_prompt: bool = False  # the prompt cell was a string: TRL reward functions see text

    def prompt(self) -> list[Message]:
        return list(self.messages)

    def lineup(self, seat: Callable[[str], Policy]) -> list[Participant]:
        return [seat("policy"), PromptEnd()]


class PromptEnd(Environment):
    """Ends the conversation after the policy's reply (silently; tools, if any, come first)."""

    name, role = "prompt_end", "user"

    def respond(self, conv: Conversation) -> None:
        conv.request_stop("answered")
        return None


def load_rows(path: str, *, split: str = "train") -> Any:
    """A `datasets.Dataset` from a file or a `save_to_disk` folder, or a ValueError naming `path`."""
    import datasets

    if os.path.isdir(path):
        try:
            data = datasets.load_from_disk(path)
        except FileNotFoundError as exc:
            raise ValueError(
                f"dataset {path!r}: a folder, but not one written by save_to_disk ({exc})"
            ) from exc
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"dataset {path!r} has splits {sorted(data)}, not {split!r}")
            data = data[split]
        return data
    ext = os.path.splitext(path)[1].lower()
    if ext not in _BUILDERS:
        raise ValueError(f"dataset {path!r}: expected a {', '.join(_BUILDERS)} file or a save_to_disk folder")
    if not os.path.isfile(path):
        raise ValueError(f"dataset {path!r}: no such file")
    try:
        with _quiet_datasets():  # its own lines about an unreadable file would not be the one line
            data = datasets.load_dataset(_BUILDERS[ext], data_files=path, split="train")
    except Exception as exc:  # the builders raise their own error types for unreadable files
        # their messages name neither the line nor the cause: for JSON, find it ourselves
        problem = _json_problem(path) if ext in (".jsonl", ".json") else None
        if problem is None and "corresponds to no data" in str(exc):
            problem = "is empty"
        if problem is not None:
            raise ValueError(f"dataset {path!r} {problem}") from None
        raise ValueError(f"dataset {path!r}: cannot read it as {ext} ({type(exc).__name__}: {exc})") from exc
    if len(data) == 0:
        raise ValueError(f"dataset {path!r} is empty")
    return data


@contextmanager
def _quiet_datasets():
    import datasets

    verbosity, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _json_problem(path: str) -> str | None:
    """What makes a JSON or JSON-lines file unreadable ("line N: ..."), or None."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text ({exc.reason} at byte {exc.start})"
    if not text.strip():
        return "is empty"
    try:
        json.loads(text)  # a JSON array (or one object) is a .json file datasets reads
        return None
    except json.JSONDecodeError:
        pass
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            return f"line {n}: not JSON ({exc.msg} at column {exc.colno})"
        if not isinstance(row, dict):
            return f"line {n}: expected a JSON object per line, got {type(row).__name__}"
    return None


def prompt_messages(value: object, *, where: str) -> list[Message]:
    """A prompt cell as messages: a string is one user message; a list holds chat messages."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: the prompt is empty")
        return [Message(speaker="user", content=value, role="user")]
    if not isinstance(value, Sequence) or not value:
        raise ValueError(
            f"{where}: the prompt must be a string or a non-empty list of messages, got {value!r}"
        )
    out = []
    for i, m in enumerate(value):
        ok = isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        if not ok or not m["role"]:
            raise ValueError(
                f"{where}: message {i} must be a dict with string 'role' and 'content', got {m!r}"
            )
        out.append(Message(speaker=m["role"], content=m["content"], role=m["role"]))
    return out


class DatasetSource(TaskSource):
    """Rows of a prompt dataset (see the module docstring)."""

    def __init__(
        self,
        path: str,
        *,
        prompt_column: str = "prompt",
        eval_path: str | None = None,
        eval_fraction: float = 0.05,
        split: str = "train",
        success_threshold: float = 1.0,
    ):
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"dataset: eval_fraction must lie in [0, 1), got {eval_fraction!r}")
        self.path, self.prompt_column, self.eval_path = path, prompt_column, eval_path
        self.eval_fraction, self.split = eval_fraction, split
        # a dataset has no environment to judge a sample: it succeeds when its reward (from the
        # reward functions) reaches this, 1.0 being the usual reward of a right answer
        self.success_threshold = success_threshold
        self.name = f"dataset:{os.path.basename(os.path.normpath(path))}"
        rows = self._read(path)
        if eval_path is not None:
            self._train, self._eval = rows, self._read(eval_path)
        else:
            order = list(range(len(rows)))
            random.Random(0).shuffle(order)  # a fixed split: the same held-out rows on every run
            k = math.ceil(eval_fraction * len(rows)) if eval_fraction and len(rows) > 1 else 0
            held = set(order[:k])
            self._train = [r for i, r in enumerate(rows) if i not in held]
            self._eval = [r for i, r in enumerate(rows) if i in held]

    def _read(self, path: str) -> list[PromptRow]:
        data = load_rows(path, split=self.split)
        if len(data) == 0:
            raise ValueError(f"dataset {path!r} is empty")
        if self.prompt_column not in data.column_names:
            raise ValueError(
                f"dataset {path!r} has no column {self.prompt_column!r}; its columns: {data.column_names} "
                "(choose one with --prompt-column)"
            )
        return [
            PromptRow(
                messages=prompt_messages(row[self.prompt_column], where=f"dataset {path!r} row {i}"),
                text_prompt=isinstance(row[self.prompt_column], str),
                columns=dict(row),
            )
            for i, row in enumerate(data)
        ]

    def rows(self, n: int, *, seed: int) -> list[PromptRow]:
        rng = random.Random(derive_seed(seed, "dataset"))
        out: list[PromptRow] = []
        while len(out) < n:  # whole permutations first, so no row repeats before all were drawn
            out.extend(rng.sample(self._train, min(n - len(out), len(self._train))))
        return out

    def eval_rows(self, n: int, *, seed: int) -> list[PromptRow]:
        """The first `n` evaluation rows, the same at every evaluation (`seed` is not used)."""
        return self._eval[:n]

    def success_of(self, trajectory: Trajectory) -> float | None:
        reward = trajectory.reward  # set by the trainer before it asks
        return None if reward is None else float(reward >= self.success_threshold)

    def option_defaults(self) -> dict[str, object]:
        return {"max_new_tokens": 64}  # a short answer; the model is the user's (--model)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "path": self.path,
            "prompt_column": self.prompt_column,
            "eval_path": self.eval_path,
            "eval_fraction": self.eval_fraction if self.eval_path is None else None,
            "train_rows": len(self._train),
            "eval_rows": len(self._eval),
        }


def source(
    path: str,
    prompt_column: str = "prompt",
    eval_path: str | None = None,
    eval_fraction: float = 0.05,
    tools: Any = None,
    *,
    split: str = "train",
    success_threshold: float = 1.0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **tool_args: Any,  # with_tools' options
) -> TaskSource:
    """The task source of `--dataset PATH`; `tools` (functions or `MODULE:FN,...`) adds tools."""
    src: TaskSource = DatasetSource(
        path,
        prompt_column=prompt_column,
        eval_path=eval_path,
        eval_fraction=eval_fraction,
        split=split,
        success_threshold=success_threshold,
    )
    if tools is None:
        if tool_args:
            raise ValueError(f"dataset: options {sorted(tool_args)} apply to tools, and no tools were given")
        return src
    from ..tools import load_tools, with_tools

    tools = load_tools(tools) if isinstance(tools, str) else tools
    return with_tools(src, tools, tokenizer=tokenizer, **tool_args)
