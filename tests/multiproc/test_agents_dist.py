"""OpenAI-API agents on two real gloo ranks, run as `AgentTasks` runs them: a `Rollouter`'s plan
through `run_agents_async`, the real aiohttp endpoint, the real `openai` clients (AsyncOpenAI for
an async agent, OpenAI for a plain def in its daemon thread), the tiny HF engine and the vote
over the gloo group.

Ranks whose agents make different numbers of calls (none at all on one) finish with the same
number of engine calls; each sample's trajectory holds, turn by turn, the ids the engine sampled;
an agent raising on rank 1 fails both ranks with its message ("raise") or only its sample
("skip"); an agent that hangs ends TIMEOUT, and a sync agent's thread that calls after its time
limit is refused. `run_ranks`'s deadline turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import threading
import time

from support.dist import run_ranks

UNIQUE = "agent-gave-up-7f3c91"  # the text of the failing agent's error, found on both ranks
STEP_TIMEOUT_S = 1.5


def _row(prompt: str, calls: int, *, fail_after: int | None = None, hang_after: int | None = None):
    return {"prompt": prompt, "calls": calls, "fail_after": fail_after, "hang_after": hang_after}


def _next(history, reply) -> None:
    history += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "more"},
    ]


async def async_agent(client, row):
    """Makes `row["calls"]` calls re-sending its history; raises or hangs where the row says."""
    history, ids = [{"role": "user", "content": row["prompt"]}], []
    for k in range(row["calls"]):
        if row["hang_after"] == k:
            await asyncio.Event().wait()  # never set: the agent waits without calling
        reply = await client.chat.completions.create(model="policy", messages=history, max_tokens=4)
        ids.append(list(reply.choices[0].token_ids))
        _next(history, reply)
        if row["fail_after"] == k + 1:
            raise ValueError(f"{UNIQUE} after call {k + 1}")
    return {"reward": float(len(ids)), "ids": ids, "client": type(client).__name__}


def sync_agent(client, row):
    """`async_agent` as a plain def with the blocking client (it runs in a daemon thread)."""
    history, ids = [{"role": "user", "content": row["prompt"]}], []
    for k in range(row["calls"]):
        if row["hang_after"] == k:
            threading.Event().wait()  # never set: the thread blocks without calling
        reply = client.chat.completions.create(model="policy", messages=history, max_tokens=4)
        ids.append(list(reply.choices[0].token_ids))
        _next(history, reply)
        if row["fail_after"] == k + 1:
            raise ValueError(f"{UNIQUE} after call {k + 1}")
    return {"reward": float(len(ids)), "ids": ids, "client": type(client).__name__}


AGENTS = {"async": async_agent, "sync": sync_agent}

# A late agent outlives its time limit; a steady one calls, briefly apart, until the late one is
# through, so the rollout still runs when the late one calls; a "once" agent calls once.
LATE_DONE = threading.Event()
LATE: dict[str, str] = {}  # what the late agent's call got, in this rank's process
GAP_S = STEP_TIMEOUT_S / 6  # between a steady agent's calls: well inside the time limit
CALLS = {"late": 0, "once": 1, "steady": 200}  # the most calls of each kind (after the late one's)


def _late_ask(row):
    return {"model": "policy", "messages": [{"role": "user", "content": row["prompt"]}], "max_tokens": 2}


async def async_late(client, row):
    calls = 0
    if row["kind"] == "late":
        try:  # cancelled at the time limit: it never calls
            await asyncio.sleep(2 * STEP_TIMEOUT_S)
            await client.chat.completions.create(**_late_ask(row))
            LATE["answer"] = "answered"
        finally:
            LATE_DONE.set()
    while calls < CALLS[row["kind"]] and not (row["kind"] == "steady" and LATE_DONE.is_set()):
        await client.chat.completions.create(**_late_ask(row))
        calls += 1
        await asyncio.sleep(GAP_S)
    return {"reward": float(calls), "steady": calls}


def sync_late(client, row):
    import openai

    calls = 0
    if row["kind"] == "late":
        time.sleep(2 * STEP_TIMEOUT_S)  # its thread runs on past the time limit, then calls
        try:
            client.chat.completions.create(**_late_ask(row))
            LATE["answer"] = "answered"
        except openai.APIStatusError as exc:
            LATE["answer"] = f"{exc.status_code} {exc.body}"
        finally:
            LATE_DONE.set()
    while calls < CALLS[row["kind"]] and not (row["kind"] == "steady" and LATE_DONE.is_set()):
        client.chat.completions.create(**_late_ask(row))
        calls += 1
        time.sleep(GAP_S)
    return {"reward": float(calls), "steady": calls}


LATE_AGENTS = {"async": async_late, "sync": sync_late}


class Recording:
    """Spy around the real engine: rows per generate call, and each row's generation by tag."""

    def __init__(self, engine):
        self.engine, self.name, self.max_context = engine, engine.name, engine.max_context
        self.calls: list[int] = []
        self.sampled: dict[str, tuple[list[int], list[float]]] = {}

    def generate(self, requests):
        out = self.engine.generate(requests)
        self.calls.append(len(requests))
        for r, g in zip(requests, out, strict=True):
            self.sampled[r.tag] = (list(g.token_ids), list(g.logprobs))
        return out


def _rollouts(rank, world, tiny_path, rows_by_rank, on_sample_error, step_timeout_s, agents=AGENTS):
    """Both agents (async, then sync) over this rank's rows; what each rollout gave, picklable."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import HFEngine, RolloutError, distributed
    from interlens_mcore.agents.task import run_agents_async
    from interlens_mcore.rollout.rollouter import RolloutConfig, Rollouter

    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = Recording(HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path), tok))
    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    config = RolloutConfig(
        num_generations=1, max_new_tokens=4, on_sample_error=on_sample_error, step_timeout_s=step_timeout_s
    )
    rollouter = Rollouter(engine=engine, tokenizer=tok, groups=groups, config=config)
    report: dict[str, dict[str, object]] = {}
    for step, flavor in enumerate(agents):
        engine.calls, engine.sampled = [], {}
        LATE_DONE.clear()
        LATE.clear()
        plan = rollouter.plan(rows_by_rank[rank], step)
        try:
            trajectories, _, rounds = asyncio.run(run_agents_async(plan, agents[flavor]))
        except RolloutError as exc:
            report[flavor] = {"error": f"{type(exc).__name__}: {exc}", "engine": list(engine.calls)}
            continue
        samples = []
        for t, sample in zip(trajectories, plan.samples, strict=True):
            samples.append(
                {
                    "id": sample.id,
                    "status": t.status.value,
                    "reason": t.infos.stop_reason,
                    "reward": t.infos.env_reward,
                    "turns": t.infos.turns,
                    "calls": t.infos.extra["agent_calls"],
                    "agent_ids": t.infos.extra.get("ids"),
                    "client": t.infos.extra.get("client"),
                    "steady": t.infos.extra.get("steady"),
                    "token_ids": t.token_ids,
                    "loss_mask": t.loss_mask,
                    "logprobs": t.rollout_logprobs,
                    "spans": [(s.start, s.end, s.trained) for s in t.turns],
                }
            )
        report[flavor] = {
            "engine_calls": rounds.engine_calls,
            "engine": list(engine.calls),
            "sampled": dict(engine.sampled),
            "samples": samples,
            "late": LATE.get("answer"),
        }
    return report


def _check_turns(sample, sampled, n):
    """The sample's trajectory holds its `n` calls as turns: mask 1 exactly on the ids the
    engine sampled for each call (and the agent received), with the engine's logprobs."""
    assert sample["calls"] == sample["turns"] == n, sample["id"]
    assert len(sample["spans"]) == n and all(trained for _, _, trained in sample["spans"])
    ids, mask = sample["token_ids"], sample["loss_mask"]
    engine_ids = [sampled[f"{sample['id']}/call{k + 1}/choice0"] for k in range(n)]
    in_spans: set[int] = set()
    for (start, end, _), (want, _) in zip(sample["spans"], engine_ids, strict=True):
        trained = [ids[i] for i in range(start, end) if mask[i]]
        assert trained == want, sample["id"]
        in_spans.update(range(start, end))
    assert not any(m for i, m in enumerate(mask) if i not in in_spans)  # prompts, openers: mask 0
    assert sum(mask) == sum(len(w) for w, _ in engine_ids)
    assert sample["logprobs"] == [x for _, lp in engine_ids for x in lp]
    if sample["agent_ids"] is not None:  # what the client got is what was trained on
        assert sample["agent_ids"] == [w for w, _ in engine_ids]


def _check_no_calls(sample):
    """A sample whose agent made no call: one untrained filler token, its reward kept."""
    assert sample["calls"] == sample["turns"] == 0 and sample["spans"] == []
    assert sample["loss_mask"] == [0] and len(sample["token_ids"]) == 1


def _made(row) -> int:
    """The calls a row's agent makes: all of them, or up to the one after which it raises."""
    return row["calls"] if row["fail_after"] is None else min(row["calls"], row["fail_after"])


def _check_equal_calls(results, flavor, rows_by_rank):
    """Both ranks made as many generate calls; each rank brought exactly its agents' calls."""
    r0, r1 = results[0][flavor], results[1][flavor]
    assert r0["engine_calls"] == r1["engine_calls"] == len(r0["engine"]) == len(r1["engine"])
    for rank, report in enumerate((r0, r1)):
        assert sum(report["engine"]) == sum(_made(row) for row in rows_by_rank[rank])
    # lockstep: round k batches every agent still making its k-th call
    assert r0["engine_calls"] == max(_made(row) for rows in rows_by_rank.values() for row in rows)


def _check_samples(report, rows, flavor, *, skip=()):
    """Every sample but those in `skip` ended by its agent's return, with its calls as turns."""
    assert "error" not in report, report.get("error")
    for i, (sample, row) in enumerate(zip(report["samples"], rows, strict=True)):
        if i in skip:
            continue
        assert sample["status"] == "stopped" and sample["reward"] == float(row["calls"])
        assert sample["client"] == ("AsyncOpenAI" if flavor == "async" else "OpenAI")
        if row["calls"]:
            _check_turns(sample, report["sampled"], row["calls"])
        else:
            _check_no_calls(sample)


def test_idle_rank_and_busy_rank_make_the_same_engine_calls(tiny_path):
    rows = {0: [_row(f"r0 q{i}", 0) for i in range(3)], 1: [_row(f"r1 q{i}", 3) for i in range(3)]}
    results = run_ranks(_rollouts, 2, str(tiny_path), rows, "raise", None, timeout=240)
    for flavor in AGENTS:
        for rank in (0, 1):
            _check_samples(results[rank][flavor], rows[rank], flavor)
        _check_equal_calls(results, flavor, rows)
        assert results[0][flavor]["engine"] == [0, 0, 0] and results[1][flavor]["engine"] == [3, 3, 3]


def test_call_counts_differ_within_a_rank(tiny_path):
    rows = {
        0: [_row("r0 a", 0), _row("r0 b", 2), _row("r0 c", 0)],
        1: [_row(f"r1 q{n}", n) for n in (1, 2, 4)],
    }
    results = run_ranks(_rollouts, 2, str(tiny_path), rows, "raise", None, timeout=240)
    for flavor in AGENTS:
        for rank in (0, 1):
            _check_samples(results[rank][flavor], rows[rank], flavor)
        _check_equal_calls(results, flavor, rows)
        assert results[0][flavor]["engine"] == [1, 1, 0, 0] and results[1][flavor]["engine"] == [3, 2, 1, 1]


FAILING = {
    0: [_row("r0 a", 0), _row("r0 b", 1)],
    1: [_row("r1 a", 3), _row("r1 b", 3, fail_after=2), _row("r1 c", 3)],
}


def test_an_agent_raising_on_rank_1_fails_both_ranks_with_its_message(tiny_path):
    results = run_ranks(_rollouts, 2, str(tiny_path), FAILING, "raise", None, timeout=240)
    for flavor in AGENTS:
        errors = [results[rank][flavor].get("error") for rank in (0, 1)]
        assert errors[0] is not None and errors[1] is not None, (flavor, errors)
        for error in errors:  # rank 0 learns rank 1's error through the vote
            assert error.startswith("RolloutValueError: rollout failed on 1 rank(s): rank 1: ValueError: ")
            assert f"{UNIQUE} after call 2" in error
        assert errors[0] == errors[1]
        # the rollout stopped in the round the agent raised: no third call was made
        assert len(results[0][flavor]["engine"]) == len(results[1][flavor]["engine"]) == 2


def test_an_agent_raising_under_skip_fails_only_its_sample(tiny_path):
    results = run_ranks(_rollouts, 2, str(tiny_path), FAILING, "skip", None, timeout=240)
    for flavor in AGENTS:
        _check_samples(results[0][flavor], FAILING[0], flavor)
        _check_samples(results[1][flavor], FAILING[1], flavor, skip={1})
        _check_equal_calls(results, flavor, FAILING)
        failed = results[1][flavor]["samples"][1]
        assert failed["status"] == "failed"
        assert failed["reason"] == f"agent: ValueError: {UNIQUE} after call 2"
        assert failed["reward"] is None
        _check_turns(failed, results[1][flavor]["sampled"], 2)  # its answered calls are kept


HANGING = {
    0: [_row("r0 a", 2), _row("r0 b", 1)],
    1: [_row("r1 a", 3, hang_after=0), _row("r1 b", 3, hang_after=1), _row("r1 c", 3)],
}


def test_a_hanging_agent_times_out_and_both_ranks_finish(tiny_path):
    results = run_ranks(_rollouts, 2, str(tiny_path), HANGING, "raise", STEP_TIMEOUT_S, timeout=240)
    for flavor in AGENTS:
        r0, r1 = results[0][flavor], results[1][flavor]
        assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
        assert r0["engine_calls"] == r1["engine_calls"] == len(r0["engine"]) == len(r1["engine"]) == 3
        assert sum(r0["engine"]) == 3 and sum(r1["engine"]) == 1 + 3
        for sample, row in zip(r0["samples"], HANGING[0], strict=True):
            assert sample["status"] == "stopped"
            _check_turns(sample, r0["sampled"], row["calls"])
        never, once, fine = r1["samples"]
        for sample in (never, once):
            assert sample["status"] == "timeout" and sample["reward"] is None
            assert sample["reason"] == f"timeout: agent made no call for {STEP_TIMEOUT_S:g} s"
        _check_no_calls(never)
        _check_turns(once, r1["sampled"], 1)
        assert fine["status"] == "stopped"
        _check_turns(fine, r1["sampled"], 3)


def test_a_timed_out_agent_calling_late_is_refused(tiny_path):
    rows = {
        0: [{"prompt": "r0 a", "kind": "once"}],
        1: [{"prompt": "r1 late", "kind": "late"}, {"prompt": "r1 steady", "kind": "steady"}],
    }
    results = run_ranks(_rollouts, 2, str(tiny_path), rows, "raise", STEP_TIMEOUT_S, LATE_AGENTS, timeout=240)
    for flavor in LATE_AGENTS:
        r0, r1 = results[0][flavor], results[1][flavor]
        assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
        late, steady = r1["samples"]
        assert late["status"] == "timeout" and late["calls"] == 0
        _check_no_calls(late)  # nothing the late call could have sampled reached its trajectory
        assert steady["status"] == "stopped" and steady["steady"] >= 1
        assert sum(r1["engine"]) == steady["steady"] and r0["engine_calls"] == r1["engine_calls"]
        if flavor == "sync":  # the thread outlived the time limit and called: refused
            assert r1["late"] is not None and r1["late"].startswith("409 ")
            assert "session_ended" in r1["late"] and "has ended (timeout: agent made no call" in r1["late"]
        else:  # the coroutine was cancelled at the time limit, before its call
            assert r1["late"] is None
