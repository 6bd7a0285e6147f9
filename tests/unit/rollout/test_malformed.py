"""Malformed input never silently misaligns: property tests over scheduler steps, turn-end hooks
and environment replies. Every malformed value is a ValueError that names the request or
conversation and the field; every well-formed but arbitrary step keeps the trajectory aligned.

The engine is not under test: fake rollouts answer at once and deterministically.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlens_mcore.chat import ChatFormat
from interlens_mcore.engines.base import Generation, SamplingParams
from interlens_mcore.rollout.conversation import Conversation, Environment, Policy
from interlens_mcore.rollout.costep import co_step
from interlens_mcore.rollout.multiturn import (
    STEP_KEYS,
    TURN_END_KEYS,
    MultiTurnRequest,
    MultiTurnValueError,
    ResponseChoice,
    ToolScheduler,
    run_multi_turn,
)
from interlens_mcore.rollout.stop import MaxTurns
from interlens_mcore.rollout.vote import RolloutValueError
from interlens_mcore.types import Message, Status

SETTINGS = settings(max_examples=60, deadline=None, database=None)
CFG = SamplingParams(max_new_tokens=4)


@pytest.fixture(scope="module")
def chat(tiny_path):
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(tiny_path))


def _answer(r: MultiTurnRequest) -> ResponseChoice:
    ids = [30 + r.turn, 40 + r.index, 50]
    return ResponseChoice(
        text=f"r{r.index}t{r.turn}", token_ids=ids, logprobs=[-0.5] * 3, finish_reason="stop"
    )


def answers(requests, config):
    """The fake rollout_fn of the malformed-input tests."""
    return [_answer(r) for r in requests]


def requests_for(chat, n: int) -> list[MultiTurnRequest]:
    return [
        MultiTurnRequest.from_messages(chat, [{"role": "user", "content": f"question {i}"}], index=i)
        for i in range(n)
    ]


# -- malformed scheduler output ------------------------------------------------------------------
# each strategy yields (how to corrupt a well-formed result, a regex the error must match)
def _not_a_list(values):
    return st.one_of(
        st.tuples(values), st.text(max_size=3), st.none(), st.integers(), st.dictionaries(st.text(), values)
    )


def bad_ids(vocab: int):
    """Values that are not token ids of this vocabulary (bools and floats included)."""
    return st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=vocab, max_value=vocab + 10**9),
        st.booleans(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=3),
        st.none(),
    )


def step_corruptions(vocab: int):
    def with_bad_id(field):
        def corrupt(bad, pos):
            def apply(result):
                ids = list(result.get(field, [31, 41, 50]))
                ids.insert(min(pos, len(ids)), bad)
                result[field] = ids

            return apply

        return st.builds(corrupt, bad_ids(vocab), st.integers(0, 4))

    def setter(field, value):
        def apply(result):
            result[field] = value

        return apply

    def bad_prompt(bad):
        def apply(result):
            nxt = result["infer_request"]
            nxt.prompt_ids = nxt.prompt_ids + [bad]  # still extends: only the new id is wrong

        return apply

    def retype_prompt(value):
        def apply(result):
            result["infer_request"].prompt_ids = value

        return apply

    def shifted_index(k):
        def apply(result):
            result["infer_request"] = dataclasses.replace(result["infer_request"], index=1 + k)

        return apply

    mask_value = st.one_of(
        st.integers().filter(lambda m: m not in (0, 1)), st.floats(), st.text(max_size=2), st.none()
    )
    logprob_value = st.one_of(
        st.sampled_from([float("nan"), float("inf"), float("-inf")]),
        st.text(max_size=2),
        st.none(),
        st.booleans(),
    )
    return st.one_of(
        st.tuples(
            with_bad_id("response_token_ids"), st.just(r"response_token_ids\[\d+\] is .*expected an int")
        ),
        st.tuples(
            _not_a_list(st.integers(0, 99)).map(lambda v: setter("response_token_ids", v)),
            st.just("response_token_ids must be a list of token ids"),
        ),
        st.tuples(
            st.lists(st.integers(0, 1), max_size=6)
            .filter(lambda m: len(m) != 3)
            .map(lambda m: setter("response_loss_mask", m)),
            st.just("loss_mask has \\d+ entries but token_ids has 3"),
        ),
        st.tuples(
            st.builds(
                lambda v, i: setter("response_loss_mask", [1, 1, 1][:i] + [v] + [1, 1, 1][i + 1 :]),
                mask_value,
                st.integers(0, 2),
            ),
            st.just("loss_mask"),
        ),
        st.tuples(
            _not_a_list(st.integers(0, 1)).map(lambda v: setter("response_loss_mask", v)),
            st.just("response_loss_mask must be a list"),
        ),
        st.tuples(
            st.builds(
                lambda v, n: setter("rollout_logprobs", [-0.5] * n + [v]), logprob_value, st.integers(0, 4)
            ),
            st.just("rollout_logprobs must be (floats|finite)"),
        ),
        st.tuples(
            st.one_of(
                st.tuples(st.floats(-5, 0)), st.text(max_size=2), st.dictionaries(st.text(), st.floats())
            ).map(lambda v: setter("rollout_logprobs", v)),
            st.just("rollout_logprobs must be a list of floats or None"),
        ),
        st.tuples(
            st.one_of(
                st.lists(st.integers(), max_size=2), st.text(max_size=3), st.integers(), st.tuples()
            ).map(lambda v: setter("rollout_infos", v)),
            st.just("rollout_infos must be a dict or None"),
        ),
        st.tuples(
            st.text(max_size=8).filter(lambda k: k not in STEP_KEYS).map(lambda k: setter(k, 1)),
            st.just("unknown key"),
        ),
        st.tuples(bad_ids(vocab).map(bad_prompt), st.just(r"infer_request\.prompt_ids\[\d+\] is")),
        st.tuples(
            st.one_of(st.tuples(st.integers(0, 9)), st.text(min_size=1, max_size=3)).map(retype_prompt),
            st.just("infer_request.prompt_ids must be a list"),
        ),
        st.tuples(st.integers(1, 10).map(shifted_index), st.just("infer_request.index is")),
    )


class Corrupting(ToolScheduler):
    """Well-formed steps, except request 1's at turn `at`, which `corrupt` edits in place."""

    def __init__(self, chat, corrupt, at: int):
        super().__init__(chat, lambda text: "ok")
        self.corrupt, self.at = corrupt, at

    def step(self, request, response_choice, current_turn):
        result = super().step(request, response_choice, current_turn)
        if request.index == 1 and current_turn == self.at:
            self.corrupt(result)
        return result


def _expect_rejected(chat, scheduler, where: str, pattern: str) -> None:
    requests = requests_for(chat, 3)
    with pytest.raises(MultiTurnValueError) as ei:
        run_multi_turn(requests, answers(requests, CFG), scheduler, answers, CFG, max_turns=4)
    cause = str(ei.value.__cause__)
    assert isinstance(ei.value, ValueError) and where in cause, cause
    assert re.search(pattern, cause), f"{pattern!r} not in {cause!r}"
    assert ei.value.outputs[1].status is Status.FAILED
    assert ei.value.outputs[0].status is not Status.FAILED  # the others keep their own state


@SETTINGS
@given(data=st.data(), at=st.integers(1, 3))
def test_malformed_step_results_are_rejected(chat, data, at):
    corrupt, pattern = data.draw(step_corruptions(len(chat.tokenizer)))
    _expect_rejected(chat, Corrupting(chat, corrupt, at), f"request 1 (turn {at}): scheduler.step()", pattern)


class BadTurnEnd(ToolScheduler):
    def __init__(self, chat, result, at: int):
        super().__init__(chat, lambda text: "ok")
        self.result, self.at = result, at

    async def on_turn_end(self, request, response_choice, current_turn):
        if request.index == 1 and current_turn == self.at:
            return self.result
        return {"done": None, "rollout_infos": {"turn": current_turn}}


turn_end_corruptions = st.one_of(
    st.tuples(
        st.one_of(st.text(max_size=3), st.integers(), st.booleans(), st.lists(st.booleans(), max_size=2)),
        st.just("on_turn_end must return a dict or None"),
    ),
    st.tuples(
        st.one_of(st.integers(), st.floats(), st.text(max_size=3), st.lists(st.booleans(), max_size=1)).map(
            lambda d: {"done": d}
        ),
        st.just("'done' must be a bool or None"),
    ),
    st.tuples(
        st.one_of(st.lists(st.integers(), max_size=2), st.text(max_size=3), st.integers(), st.booleans()).map(
            lambda v: {"rollout_infos": v}
        ),
        st.just("rollout_infos must be a dict or None"),
    ),
    st.tuples(
        st.text(max_size=8).filter(lambda k: k not in TURN_END_KEYS).map(lambda k: {"done": False, k: 1}),
        st.just("unknown key"),
    ),
)


@SETTINGS
@given(bad=turn_end_corruptions, at=st.integers(1, 3))
def test_malformed_turn_end_results_are_rejected(chat, bad, at):
    result, pattern = bad
    _expect_rejected(chat, BadTurnEnd(chat, result, at), f"request 1 (turn {at}): on_turn_end", pattern)


# -- malformed environment replies -------------------------------------------------------------
# patterns follow "returned a Message " (or "returned " for values that are no Message at all)
class Sevens:
    """A fake engine: three 7s per row."""

    name, max_context = "sevens", 100_000

    def generate(self, requests):
        return [
            Generation(token_ids=[7, 7, 7], logprobs=[-1.0] * 3, finish_reason="length") for _ in requests
        ]


class Replying(Environment):
    """Replies "fine", except at turn `at`, where it returns `reply`."""

    name = "env"

    def __init__(self, reply, at: int):
        self.reply, self.at = reply, at

    def respond(self, conv):
        return self.reply if conv.turns_taken + 1 == self.at else "fine"


_ids = st.lists(st.integers(0, 500), min_size=1, max_size=4)
env_messages = st.one_of(
    # a spoofed speaker: the policy itself (with or without sampled-looking ids) or anyone else
    st.tuples(
        st.builds(lambda ids: Message(speaker="agent", content="x", role="assistant", token_ids=ids), _ids),
        st.just("with speaker 'agent'; expected its own name 'env'"),
    ),
    st.tuples(
        st.text(max_size=6).filter(lambda s: s != "env").map(lambda s: Message(speaker=s, content="x")),
        st.just("with speaker .*; expected its own name 'env'"),
    ),
    # its own name, but ids (and logprobs) only an engine-sampled policy turn may carry
    st.tuples(
        st.builds(lambda ids: Message(speaker="env", content="x", token_ids=ids), _ids),
        st.just("with token_ids/logprobs; expected none"),
    ),
    st.tuples(
        st.builds(
            lambda ids: Message(speaker="env", content="x", token_ids=ids, logprobs=[-1.0] * len(ids)), _ids
        ),
        st.just("with token_ids/logprobs; expected none"),
    ),
    st.tuples(
        st.one_of(st.just(""), st.integers(), st.none(), st.lists(st.text(), max_size=1)).map(
            lambda r: Message(speaker="env", content="x", role=r)
        ),
        st.just("with role .*; expected a non-empty str"),
    ),
)
env_other_types = st.tuples(
    st.one_of(
        st.integers(), st.floats(), st.binary(max_size=3), st.lists(st.text(), max_size=2), st.booleans()
    ),
    st.just("(int|float|bytes|list|bool); expected str, Message or None"),
)


@pytest.fixture(scope="module")
def agent(chat):
    return Policy("agent", Sevens(), chat.tokenizer, SamplingParams(max_new_tokens=3))


@SETTINGS
@given(bad=st.one_of(env_messages, env_other_types), at=st.sampled_from([2, 4, 6]))
def test_malformed_environment_replies_are_rejected(agent, bad, at):
    reply, pattern = bad
    what = "a Message " if isinstance(reply, Message) else ""
    conv = Conversation([agent, Replying(reply, at)], run_until=MaxTurns(8), id="c0")
    with pytest.raises(
        RolloutValueError, match=f"conversation c0: participant 'env' returned {what}{pattern}"
    ):
        co_step([conv], turns=None)
    assert conv.turns_taken == at - 1  # nothing of the bad reply was committed


@SETTINGS
@given(bad=env_messages)
def test_hooks_cannot_reattribute_or_attach_ids(agent, bad):
    replacement, pattern = bad

    def swap(conv, msg):
        return replacement if msg.speaker == "env" else msg

    conv = Conversation([agent, Replying(None, 0)], hooks=[swap], run_until=MaxTurns(4), id="c0")
    with pytest.raises(RolloutValueError, match=f"conversation c0: hook 'swap' returned a Message {pattern}"):
        co_step([conv], turns=None)


# -- well-formed but arbitrary steps stay aligned ----------------------------------------------
class Drawn:
    """A fake rollout_fn whose ids, logprobs (any length, or None) and finish reasons are drawn."""

    def __init__(self, data):
        self.data = data
        self.last: dict[int, ResponseChoice] = {}  # each request's latest response

    def __call__(self, requests, config):
        out = []
        for r in requests:
            ids = self.data.draw(st.lists(st.integers(10, 200), min_size=1, max_size=5))
            n = self.data.draw(st.one_of(st.none(), st.integers(0, len(ids) + 1)))
            choice = ResponseChoice(
                text=f"r{r.index}t{r.turn}",
                token_ids=ids,
                logprobs=None if n is None else [-0.125 * (k + 1) for k in range(n)],
                finish_reason=self.data.draw(st.sampled_from(["stop", "stop", "length"])),
            )
            self.last[r.index] = choice
            out.append(choice)
        return out


class Arbitrary(ToolScheduler):
    """Steps that cut, mask, re-score and continue at random; records what each turn keeps."""

    def __init__(self, chat, data):
        super().__init__(chat, lambda text: f"seen {len(text)}")
        self.data = data
        self.pieces: dict[int, list[tuple[list[int], list[int], list[float] | None]]] = {}

    def step(self, request, response_choice, current_turn):
        draw, ids = self.data.draw, response_choice.token_ids
        kept = ids[: draw(st.integers(0, len(ids)))]  # e.g. a reply cut at a stop string
        mask = draw(st.lists(st.integers(0, 1), min_size=len(kept), max_size=len(kept)))
        result = {"response_token_ids": kept, "response_loss_mask": mask}
        mode = draw(st.sampled_from(["engine", "none", "exact", "any"]))
        logprobs = response_choice.logprobs
        if mode != "engine":
            n = {"none": None, "exact": sum(mask), "any": draw(st.integers(0, len(kept) + 2))}[mode]
            logprobs = None if n is None else [-1.0 - k for k in range(n)]
            result["rollout_logprobs"] = logprobs
        if draw(st.booleans()):
            result["rollout_infos"] = {"turn": current_turn}
        kept_choice = dataclasses.replace(response_choice, token_ids=kept)
        if draw(st.booleans()):
            result["infer_request"] = self.continue_turn(
                request, kept_choice, draw(st.sampled_from(["", " and"]))
            )
        else:
            result["infer_request"] = self.reply(
                request, response_choice, "tool says hi", response_token_ids=kept
            )
        self.pieces.setdefault(request.index, []).append((kept, mask, logprobs))
        return result


@settings(max_examples=100, deadline=None, database=None)
@given(data=st.data(), n=st.integers(1, 3), max_turns=st.integers(1, 5))
def test_arbitrary_well_formed_steps_keep_the_trajectory_aligned(chat, data, n, max_turns):
    rollout, scheduler = Drawn(data), Arbitrary(chat, data)
    requests = requests_for(chat, n)
    outs = run_multi_turn(requests, rollout(requests, CFG), scheduler, rollout, CFG, max_turns)
    for i, out in enumerate(outs):
        final = rollout.last[i]  # the response the request finished on: trained whole
        pieces = scheduler.pieces.get(i, []) + [(final.token_ids, [1] * len(final.token_ids), final.logprobs)]
        traj = out.to_trajectory()  # validate_tokens runs in Trajectory.__post_init__
        assert out.status in (Status.STOPPED, Status.MAX_TURNS)
        # the sequence is the last prompt the engine saw plus its last answer
        assert traj.token_ids == out.request.prompt_ids + final.token_ids
        kept = [t for ids, mask, _ in pieces for t, m in zip(ids, mask) if m]
        assert [t for t, m in zip(traj.token_ids, traj.loss_mask) if m] == kept
        assert traj.num_trained_tokens == len(kept)
        # logprobs: exactly the ones given, in token order, or none at all (and counted); a
        # piece with no trained token owes none (None fits it)
        fits = all(len(lp or []) == sum(mask) and (lp is not None or not any(mask)) for _, mask, lp in pieces)
        if fits:
            assert traj.rollout_logprobs == [x for _, _, lp in pieces for x in lp or []]
            assert traj.infos["logprobs_complete"] is True
        else:
            assert traj.rollout_logprobs is None and traj.infos["logprobs_complete"] is False
