"""The objects an ms-swift scheduler reads and writes, with ms-swift's field names.

A scheduler sees a `RolloutInferRequest` (`messages`, `data_dict`, `uuid`) and a
`ChatCompletionResponseChoice` (`message.content`, `token_ids`, `logprobs` with
`content[i]['logprob']`, `finish_reason`). It mutates `infer_request.messages` and returns the
request; the compat driver turns what changed into token ids (see transcript.py).
`SwiftOutput` is what a finished request produced, with ms-swift's output field names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ... import ResponseChoice, Status, Trajectory
from ... import RolloutOutput as NativeOutput
from ...chat import Tokenizer
from ...rollout.rollouter import describe_request

Message = dict[str, Any]  # {"role": ..., "content": str | None, ...}
Messages = list[Message]  # ms-swift's name of a conversation
TrainTurns = Literal["all", "last_round"]  # ms-swift's loss_scale: every assistant round, or the last


@dataclass(kw_only=True)
class RolloutInferRequest:
    """One conversation as an ms-swift scheduler sees it; schedulers mutate `messages`."""

    messages: list[Message]
    data_dict: dict[str, Any] = field(default_factory=dict)  # the row's other fields (solution, env_config)
    uuid: str = ""  # stable per request within a rollout; gym schedulers key environments by it


@dataclass(kw_only=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: list[dict[str, object]] | None = None  # tool calls stay in `content`, as the model wrote them


@dataclass(kw_only=True)
class ChatCompletionResponseChoice:
    """What the engine answered to one request, shaped like ms-swift's choice."""

    index: int
    message: ChatMessage
    finish_reason: str  # "stop" | "length"
    token_ids: list[int]  # sampled ids, verbatim
    logprobs: dict[str, list[dict[str, Any]]] | None  # {"content": [{"token", "logprob"}, ...]}

    @classmethod
    def from_native(cls, choice: ResponseChoice, tokenizer: Tokenizer) -> ChatCompletionResponseChoice:
        logprobs = None
        if choice.logprobs is not None:
            tokens = tokenizer.convert_ids_to_tokens(list(choice.token_ids))
            tokens = [tokens] if isinstance(tokens, str) else tokens
            content = [{"token": t, "logprob": lp} for t, lp in zip(tokens, choice.logprobs, strict=True)]
            logprobs = {"content": content}
        return cls(
            index=0,
            message=ChatMessage(role="assistant", content=choice.text),
            finish_reason=choice.finish_reason,
            token_ids=list(choice.token_ids),
            logprobs=logprobs,
        )


@dataclass(kw_only=True)
class ChatCompletionResponse:
    """An engine's answer to one request, shaped like ms-swift's (`choices[0]` is the reply)."""

    choices: list[ChatCompletionResponseChoice]
    model: str = ""
    id: str = ""
    usage: dict[str, int] | None = None


@dataclass(kw_only=True)
class RequestConfig:
    """ms-swift's sampling settings of a request, for type hints and `n == 1` checks in ported
    files; the run's own sampling (--temperature, --max-new-tokens, ...) is what the engine uses."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None


def choice_logprobs(choice: ChatCompletionResponseChoice) -> list[float]:
    """The engine's logprobs of a choice as floats; [] when it has none (ms-swift's helper)."""
    if choice.logprobs is None or "content" not in choice.logprobs:
        return []
    return [float(item["logprob"]) for item in choice.logprobs["content"]]


@dataclass(kw_only=True)
class SwiftOutput:
    """One finished request, with ms-swift's names over the native record.

    Unlike ms-swift's, each turn's `response_token_ids` starts with the ids that came before
    the turn's reply (closing template ids, appended messages, the assistant opener; loss mask
    0), so `prompt_ids` + the turns concatenated is exactly the sequence the engine saw.
    """

    request: RolloutInferRequest  # the last request: its messages end with the final reply
    prompt_ids: list[int]
    response_token_ids: list[list[int]]
    response_loss_mask: list[list[int]]
    rollout_logprobs: list[list[float] | None]  # one per mask-1 token of each turn
    rollout_infos: dict[str, Any]
    status: Status
    native: NativeOutput  # the native driver's record this output reads from

    @property
    def messages(self) -> list[Message]:
        return self.request.messages

    @property
    def num_turns(self) -> int:
        return int(self.rollout_infos.get("num_turns", 0))

    def to_trajectory(self, *, group: int = 0, reward_key: str | None = None) -> Trajectory:
        """The trajectory, its infos filled as on every scheduler path (`describe_request`):
        `conversation` is the request's uuid, `env_reward` is `rollout_infos[reward_key]` when
        it is set; a FAILED one's `stop_reason` is its cause (`"scheduler: ..."`)."""
        traj = self.native.to_trajectory(group=group)
        describe_request(traj, self.request.uuid, self.request.messages, reward_key)
        if self.status is Status.FAILED:  # the cause, as every failed sample carries it
            traj.infos.stop_reason = self.native.error
        return traj


RolloutOutput = SwiftOutput  # ms-swift's name, for type hints in ported scheduler files
