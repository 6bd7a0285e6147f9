"""`--reward-model PATH`: a sequence classifier (a reward model) scoring each trajectory.

The folder is any `transformers.AutoModelForSequenceClassification` checkpoint with its
tokenizer, read from safetensors only (nothing is unpickled). A trajectory is scored as its whole
conversation (`inputs.RewardInputs.transcript`: the row's opening messages, then every message
after) through the tokenizer's chat template when it has one, else as plain text: the contents
before the seat's last message, a line apart (`context_text`), a newline, the completion. The score is
the logit `label` of the classifier's output (num_labels=1: the only one; default: the last).

Scoring runs on this rank, frozen (eval mode, no gradient), in batches of `batch_size`
right-padded rows: the classifier pools the last non-pad token, so a batch scores each row as
it scores alone. The weights load once, on the first call. A FAILED trajectory scores 0; one
longer than the model's context, or whose messages the chat template refuses, is marked FAILED
(`"reward reward_model: ..."`) and scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..types import Status, Trajectory
from .inputs import reward_inputs

NAME = "reward_model"


class RewardModelError(ValueError):
    """A --reward-model / --judge-model folder that cannot be used as asked."""


def check_weights(path: Path, flag: str) -> dict[str, Any]:
    """`path`'s config.json, once the folder is known to hold a model in safetensors."""
    import json

    config_file = path / "config.json"
    if not config_file.is_file():
        raise RewardModelError(f"{flag} {path}: not a model folder (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RewardModelError(f"{flag} {path}: config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        kind = type(config).__name__
        raise RewardModelError(f"{flag} {path}: config.json holds {kind}, expected a JSON object")
    if not list(path.glob("*.safetensors")):
        raise RewardModelError(
            f"{flag} {path}: no safetensors weights (*.safetensors); weights are read from "
            "safetensors only, never unpickled: save the model with save_pretrained(folder) "
            "(safe_serialization is the default)"
        )
    return config


def check_classifier(path: Path, label: int, flag: str = "--reward-model") -> int:
    """The number of labels of the classifier in `path`; errors name `flag` and the folder."""
    config = check_weights(path, flag)
    archs = config.get("architectures") or []
    if not any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in archs):
        raise RewardModelError(
            f"{flag} {path}: not a sequence classifier (config.json architectures: {archs}); "
            "expected a ...ForSequenceClassification folder, as AutoModelForSequenceClassification "
            "saves it"
        )
    labels = config.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) and labels else int(config.get("num_labels", 2))
    if not -num_labels <= label < num_labels:
        raise RewardModelError(
            f"--reward-model-label {label}: the classifier in {path} has {num_labels} labels "
            f"(expected an index in [{-num_labels}, {num_labels - 1}]; -1: the last)"
        )
    return num_labels


@dataclass
class Loaded:
    """The reward model and its tokenizer, frozen, with the pad id batches use."""

    model: Any
    tokenizer: Any
    pad_id: int
    device: torch.device
    max_length: int


def frozen(auto_class: Any, path: Path) -> tuple[Any, torch.device]:
    """`auto_class.from_pretrained(path)` from safetensors only, in eval mode without gradients,
    on this rank's device (a GPU when there is one)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # the folder's own dtype on a GPU; float32 on CPU, where half-precision matmuls are slow
    dtype = "auto" if cuda else torch.float32
    model = auto_class.from_pretrained(path, use_safetensors=True, dtype=dtype)
    model.eval().requires_grad_(False).to(device)
    return model, device


def load(path: Path) -> Loaded:
    """The classifier in `path` (safetensors only), frozen on this rank's device."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, device = frozen(AutoModelForSequenceClassification, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text_config = model.config.get_text_config()
    pads = (tokenizer.pad_token_id, text_config.pad_token_id, tokenizer.eos_token_id)
    pad = next((p for p in pads if p is not None), None)
    if pad is None:
        raise RewardModelError(f"--reward-model {path}: the tokenizer and config name no pad or eos token")
    text_config.pad_token_id = int(pad)  # batches of more than one row need it to find each row's end
    context = text_config.to_dict().get("max_position_embeddings") or tokenizer.model_max_length
    return Loaded(model, tokenizer, int(pad), device, int(context))


def fail(t: Trajectory, cause: str) -> None:
    """Mark `t` FAILED with `cause` (what failed first, then why): it scores 0 and leaves the loss."""
    t.status = Status.FAILED
    t.infos.stop_reason = cause


@dataclass
class RewardModel:
    """The `reward_model` reward function: `fn(trajectories, rows)` -> the classifier's scores."""

    path: Path
    label: int = -1
    batch_size: int = 8
    name: str = NAME
    _loaded: Loaded | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if self.batch_size < 1:
            raise RewardModelError(f"--reward-model-batch-size must be >= 1, got {self.batch_size}")
        check_classifier(self.path, self.label)

    @property
    def loaded(self) -> Loaded:
        if self._loaded is None:
            self._loaded = load(self.path)
        return self._loaded

    def input_ids(self, t: Trajectory, row: object = None) -> list[int]:
        """The tokens the classifier reads for `t`: the whole transcript through the chat
        template, else the context and the completion as plain text."""
        tok = self.loaded.tokenizer
        seen = reward_inputs(t, row)
        if tok.chat_template:
            text = tok.apply_chat_template(seen.transcript, tokenize=False)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return list(tok(seen.context_text + "\n" + seen.completion_text)["input_ids"])

    def __call__(self, trajectories: Sequence[Trajectory], rows: Sequence[object]) -> list[float]:
        scores = [0.0] * len(trajectories)
        todo: list[tuple[int, list[int]]] = []
        for i, (t, row) in enumerate(zip(trajectories, rows, strict=True)):
            if t.status is Status.FAILED:
                continue
            loaded = self.loaded  # loading the model is not one sample's failure: outside the try
            try:  # a transcript the chat template refuses (a role it does not know) fails only itself
                ids = self.input_ids(t, row)
            except Exception as exc:
                fail(t, f"reward {self.name}: {type(exc).__name__}: {exc}")
                continue
            if len(ids) > loaded.max_length:
                fail(
                    t,
                    f"reward {self.name}: {len(ids)} tokens do not fit the reward model's context "
                    f"of {loaded.max_length} ({self.path})",
                )
                continue
            todo.append((i, ids))
        for start in range(0, len(todo), self.batch_size):
            batch = todo[start : start + self.batch_size]
            for (i, _), s in zip(batch, self.score_ids([ids for _, ids in batch]), strict=True):
                scores[i] = s
        return scores

    @torch.inference_mode()
    def score_ids(self, rows: list[list[int]]) -> list[float]:
        """One forward over right-padded `rows`: each row's logit `label`."""
        m = self.loaded
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), m.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        logits = m.model(input_ids=ids.to(m.device), attention_mask=mask.to(m.device)).logits
        return [float(x) for x in logits[:, self.label].float().cpu()]
