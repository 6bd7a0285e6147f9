"""What schedulers and rollout functions hand `run_multi_turn`, checked before it is recorded;
and `prepare_requests`, which runs a scheduler's `before_first_turn` and checks its requests.

Every check raises a ValueError naming the request, the turn and the field, so bad scheduler
output is found where it is made, not as a misaligned trajectory later.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from ..types import validate_tokens
from .limits import maybe_await
from .round import no_running_loop
from .scheduler import MultiTurnRequest, MultiTurnScheduler, ResponseChoice

STEP_KEYS = ("infer_request", "response_token_ids", "response_loss_mask", "rollout_logprobs", "rollout_infos")
TURN_END_KEYS = ("done", "rollout_infos")


def check_ids(
    ids: object, where: str, vocab_size: int | None, sampled: AbstractSet[int] = frozenset()
) -> None:
    """Token ids: a list of Python ints >= 0, below `vocab_size` unless the engine sampled them
    (a model's vocabulary may be padded past its tokenizer's)."""
    if not isinstance(ids, list):
        raise ValueError(f"{where} must be a list of token ids, got {type(ids).__name__}")
    for i, t in enumerate(ids):
        # type() and not isinstance(): True is an int, and no tokenizer has a token True
        if type(t) is not int or t < 0 or (vocab_size is not None and t >= vocab_size and t not in sampled):
            below = f" below the vocabulary size {vocab_size}" if vocab_size is not None else ""
            raise ValueError(f"{where}[{i}] is {t!r}; expected an int >= 0{below} (not a bool)")


def check_logprobs(logprobs: object, where: str) -> None:
    """None, or a list of finite numbers; any length (the completeness rule judges the length)."""
    if logprobs is None:
        return
    if not isinstance(logprobs, list):
        raise ValueError(f"{where} must be a list of floats or None, got {type(logprobs).__name__}")
    for i, x in enumerate(logprobs):
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            raise ValueError(f"{where} must be floats, got {x!r} at [{i}]")
        if not math.isfinite(x):
            raise ValueError(f"{where} must be finite, got {x!r} at [{i}]")


def check_infos(infos: object, where: str) -> dict[str, object]:
    if infos is not None and not isinstance(infos, dict):
        raise ValueError(f"{where} rollout_infos must be a dict or None, got {type(infos).__name__}")
    return infos or {}


def check_keys(result: dict[str, object], allowed: tuple[str, ...], where: str) -> None:
    # a misspelt key would otherwise be ignored, and the turn recorded as the engine gave it
    unknown = sorted(str(k) for k in result if k not in allowed)
    if unknown:
        raise ValueError(f"{where} returned unknown key(s) {unknown}; expected some of {list(allowed)}")


def check_choice(choice: object, where: str) -> ResponseChoice:
    """What a rollout_fn returned for one request; sampled ids are not bounded by the tokenizer."""
    if not isinstance(choice, ResponseChoice):
        raise ValueError(f"{where} must return ResponseChoice, got {choice!r}")
    check_ids(choice.token_ids, f"{where} token_ids", None)
    check_logprobs(choice.logprobs, f"{where} logprobs")
    if not isinstance(choice.text, str):
        raise ValueError(f"{where} text must be a str, got {type(choice.text).__name__}")
    return choice


def turn_end_result(result: object, where: str) -> tuple[bool | None, dict[str, object]]:
    """(done, rollout_infos) of what `on_turn_end` returned; done None lets check_finished decide."""
    if result is None:
        return None, {}
    if not isinstance(result, dict):
        raise ValueError(f"{where} must return a dict or None, got {result!r}")
    check_keys(result, TURN_END_KEYS, where)
    done = result.get("done")
    if done is not None and not isinstance(done, bool):
        raise ValueError(f"{where} 'done' must be a bool or None, got {done!r}")
    return done, check_infos(result.get("rollout_infos"), where)


@dataclass
class StepResult:
    """A checked `scheduler.step()` result: the next request and what the turn contributes."""

    request: MultiTurnRequest
    ids: list[int]
    mask: list[int]
    logprobs: list[float] | None
    infos: dict[str, object]


def step_result(
    result: object,
    req: MultiTurnRequest,
    choice: ResponseChoice,
    where: str,
    check_ids: Callable[[object, str], None],
) -> StepResult:
    """Check a step's result against the request it answers; `check_ids` knows the vocabulary."""
    nxt = result.get("infer_request") if isinstance(result, dict) else None
    if not isinstance(result, dict) or not isinstance(nxt, MultiTurnRequest):
        raise ValueError(
            f"{where} must return a dict with 'infer_request' (a MultiTurnRequest), got {result!r}"
        )
    check_keys(result, STEP_KEYS, where)
    # reply()/continue_turn(response_token_ids=...) set the turn's ids and mask on the request
    given_ids, given_mask = nxt.response if nxt.response is not None else (choice.token_ids, None)
    ids = result.get("response_token_ids", given_ids)
    check_ids(ids, f"{where} response_token_ids")
    if nxt.response is not None and ids != given_ids:
        raise ValueError(f"{where}: response_token_ids differ from those given to reply()/continue_turn()")
    mask = result.get("response_loss_mask", [1] * len(ids) if given_mask is None else given_mask)
    if not isinstance(mask, list) or not all(isinstance(m, int) for m in mask):
        raise ValueError(f"{where} response_loss_mask must be a list of 0/1 ints, got {mask!r}")
    # the scheduler's logprobs are preferred: it knows which tokens it kept
    logprobs = result.get("rollout_logprobs", choice.logprobs)
    check_logprobs(logprobs, f"{where} rollout_logprobs")
    validate_tokens(ids, mask, logprobs, where=f"{where} response")
    infos = check_infos(result.get("rollout_infos"), where)
    if nxt.index != req.index:
        raise ValueError(
            f"{where}: infer_request.index is {nxt.index}; expected {req.index} (the same request)"
        )
    check_ids(nxt.prompt_ids, f"{where} infer_request.prompt_ids")
    if not isinstance(nxt.messages, list) or not all(isinstance(m, dict) for m in nxt.messages):
        raise ValueError(f"{where} infer_request.messages must be a list of dicts")
    expected = req.prompt_ids + ids
    if nxt.prompt_ids[: len(expected)] != expected:
        raise ValueError(
            f"{where}: infer_request.prompt_ids must extend the previous prompt_ids + "
            f"response_token_ids ({len(expected)} tokens); rebuild it with reply()/continue_turn()"
        )
    return StepResult(nxt, list(ids), [int(m) for m in mask], logprobs, infos)


async def prepare_requests_async(
    scheduler: MultiTurnScheduler, requests: Sequence[MultiTurnRequest]
) -> list[MultiTurnRequest]:
    """Run `scheduler.before_first_turn` (sync or async) on the requests before turn 1."""
    out = await maybe_await(scheduler.before_first_turn(list(requests)))
    where = f"{type(scheduler).__name__}.before_first_turn"
    if not isinstance(out, list) or not all(isinstance(r, MultiTurnRequest) for r in out):
        raise ValueError(f"{where} must return a list of MultiTurnRequest, got {type(out).__name__}")
    if [r.index for r in out] != [r.index for r in requests]:
        raise ValueError(
            f"{where} returned requests {[r.index for r in out]}; expected one per request, in order "
            f"({[r.index for r in requests]})"
        )
    return out


def prepare_requests(
    scheduler: MultiTurnScheduler, requests: Sequence[MultiTurnRequest]
) -> list[MultiTurnRequest]:
    """`prepare_requests_async` from synchronous code."""
    no_running_loop("prepare_requests")
    return asyncio.run(prepare_requests_async(scheduler, requests))
