"""One failing sample on rank 1 of two gloo ranks, with on_sample_error="skip": neither rank hangs
or fails, rank 1's sample ends FAILED with its cause, and every other sample (rank 0's all, and
rank 1's others) is what the same rollout gives when nothing fails. Both drivers: lineups through
`co_step` and an ms-swift scheduler through compat.swift (`run_multi_turn` below it)."""

from __future__ import annotations

from support.dist import run_ranks

TURNS = {0: 1, 1: 3}  # rank -> turns its samples take: the ranks keep voting after the failure


def _scheduler(fail: bool):
    from interlens_mcore.compat.swift import MultiTurnScheduler

    class Countdown(MultiTurnScheduler):
        """Runs `data_dict["turns"]` turns; with `fail`, its step raises for the row marked bad."""

        def check_finished(self, infer_request, response_choice, current_turn):
            return current_turn >= infer_request.data_dict["turns"]

        def step(self, infer_request, response_choice, current_turn):
            if fail and infer_request.data_dict.get("bad"):
                raise ValueError("step() refused this reply")
            infer_request.messages.append({"role": "user", "content": f"turn {current_turn + 1}"})
            return {"infer_request": infer_request}

    return Countdown()


def _lineups(rank, tok, engine, fail: bool):
    from interlens_mcore import Conversation, Environment, MaxTurns, Message, Policy, SamplingParams

    class Env(Environment):
        name = "env"

        def respond(self, conv):
            if fail and conv.id == "r1-c1":
                raise RuntimeError("the environment fell over")
            return "go on"

    pol = Policy("agent", engine, tok, SamplingParams(max_new_tokens=3))
    return [
        Conversation(
            [pol, Env()],
            [Message(speaker="user", content=f"rank {rank} row {i}")],
            run_until=MaxTurns(2 * TURNS[rank]),
            id=f"r{rank}-c{i}",
        )
        for i in range(3)
    ]


def _both_drivers(rank, world_size, tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import co_step, distributed
    from interlens_mcore.compat.swift import run
    from interlens_mcore.engines.base import SamplingParams
    from interlens_mcore.engines.hf import HFEngine

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_path), AutoTokenizer.from_pretrained(tiny_path)
    engine = HFEngine(model, tok)
    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    report = {}
    for fail in (True, False):  # with the failure on rank 1, then the same rollout with none
        convs = _lineups(rank, tok, engine, fail)
        co_step(convs, group_seed=5, gather_fn=groups.gather_fn(), rank=rank, on_sample_error="skip")
        rows = [
            {"messages": [{"role": "user", "content": f"rank {rank} row {i}"}], "turns": TURNS[rank],
             "bad": rank == 1 and i == 1}
            for i in range(3)
        ]  # fmt: skip
        outs = run(rows, _scheduler(fail), engine, tok, SamplingParams(max_new_tokens=3), seed=5,
                   gather_fn=groups.gather_fn(), rank=rank, on_sample_error="skip")  # fmt: skip
        report[fail] = {
            "lineups": [(c.status.value, c.stop_reason, c.trajectories()[0].token_ids) for c in convs],
            "swift": [
                (o.status.value, o.to_trajectory().infos.stop_reason, o.to_trajectory().token_ids)
                for o in outs
            ],  # fmt: skip
        }
    return report


def test_one_failing_sample_on_rank_1_fails_only_itself(tiny_path):
    results = run_ranks(_both_drivers, 2, tiny_path, timeout=300)  # a hang is a TimeoutError here
    for rank, report in enumerate(results):
        failed, clean = report[True], report[False]
        for driver in ("lineups", "swift"):
            bad = {1} if rank == 1 else set()
            for i, (with_failure, without) in enumerate(zip(failed[driver], clean[driver], strict=True)):
                if i in bad:
                    continue
                assert with_failure == without, (rank, driver, i)  # the same sample, as if none failed
            assert all(status != "failed" for status, _, _ in clean[driver])
        if rank == 1:
            lineup = failed["lineups"][1]
            assert lineup[:2] == ("failed", "environment: RuntimeError: the environment fell over")
            assert failed["swift"][1][:2] == ("failed", "scheduler: ValueError: step() refused this reply")
        else:
            assert all(status != "failed" for status, _, _ in failed["lineups"] + failed["swift"])
