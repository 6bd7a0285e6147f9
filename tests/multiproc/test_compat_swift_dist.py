"""An ms-swift scheduler on two gloo ranks: ranks that need different numbers of turns, three
GRPO steps on the compat trajectories, and one rank's scheduler failing both ranks at once."""

from __future__ import annotations

import torch
from support.dist import run_ranks

SCHEDULER_TURNS = {0: 1, 1: 3}  # rank -> turns its rows ask for: the ranks must keep voting


def _scheduler_and_rows(rank: int):
    from interlens_mcore.compat.swift import MultiTurnScheduler

    class Countdown(MultiTurnScheduler):
        """Runs `data_dict["turns"]` turns; rewards a reply by the parity of its ids' sum."""

        async def on_turn_end(self, infer_request, response_choice, current_turn):
            return {"rollout_infos": {"reward": float(sum(response_choice.token_ids) % 2)}}

        def check_finished(self, infer_request, response_choice, current_turn):
            return current_turn >= infer_request.data_dict["turns"]

        def step(self, infer_request, response_choice, current_turn):
            if infer_request.data_dict.get("fail_at") == current_turn:
                raise TimeoutError("tool server timed out")
            infer_request.messages.append({"role": "user", "content": f"turn {current_turn + 1}"})
            return {"infer_request": infer_request}

    turns = SCHEDULER_TURNS[rank]
    rows = [
        {"messages": [{"role": "user", "content": f"rank {rank} row {i}"}], "turns": turns} for i in range(2)
    ]
    return Countdown(), rows


def _train_then_fail(rank, world_size, tiny_path):
    # one pair of processes for both scenarios: starting them costs more than either
    return _train(rank, tiny_path), _fail(rank, tiny_path)


def _train(rank, tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import distributed
    from interlens_mcore.compat.swift import SwiftTaskSource
    from interlens_mcore.engines.base import SamplingParams
    from interlens_mcore.engines.hf import HFEngine
    from interlens_mcore.engines.sampler import mix_seed
    from interlens_mcore.grpo.advantages import group_advantages
    from interlens_mcore.grpo.batch import build_batch
    from interlens_mcore.grpo.logprobs import token_logprobs
    from interlens_mcore.grpo.loss.config import LossConfig
    from interlens_mcore.grpo.loss.objective import grpo_loss
    from interlens_mcore.grpo.rewards import environment_reward

    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(tiny_path),
        AutoTokenizer.from_pretrained(tiny_path),
    )
    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    scheduler, rows = _scheduler_and_rows(rank)
    task = SwiftTaskSource(scheduler, rows)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sampling = SamplingParams(max_new_tokens=4)
    start = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    report = {"turns": [], "checksums": [], "first_step_gap": None, "losses": []}
    for step in range(3):
        kwargs = dict(num_generations=2, engine=HFEngine(model, tokenizer), tokenizer=tokenizer,
                      sampling=sampling, seed=mix_seed(7, step))  # fmt: skip
        trajectories = task.rollout(rows, gather_fn=groups.gather_fn(), rank=groups.rollout_rank, **kwargs)
        if step == 0:  # the same rows alone on one process give the same samples
            alone = task.rollout(rows, rank=rank, **kwargs)
            report["same_as_alone"] = [t.token_ids for t in alone] == [t.token_ids for t in trajectories]
        report["turns"].append([t.infos.turns for t in trajectories])
        rewards = environment_reward(trajectories, rows)
        advantages, _ = group_advantages(rewards, [t.group for t in trajectories])
        batch = build_batch(trajectories, advantages, layout="padded", pad_id=int(tokenizer.eos_token_id))
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=(batch.sample_ids >= 0).long(),
            position_ids=batch.position_ids,
        ).logits
        logprobs = token_logprobs(logits, batch.targets)  # [N, T]
        if step == 0:  # the trainer scores exactly the tokens the engine sampled, under the same weights
            mask = batch.loss_mask
            report["first_step_gap"] = float((logprobs.detach() - batch.rollout_logprobs)[mask].abs().max())
        counts = torch.tensor([float(batch.loss_mask.sum()), float(len(trajectories))])
        distributed.all_reduce(counts, "sum")
        loss, _ = grpo_loss(
            logprobs, loss_mask=batch.loss_mask, advantages=batch.advantages,
            rollout_logprobs=batch.rollout_logprobs, logprobs_complete=batch.logprobs_complete,
            sample_ids=batch.sample_ids, segment_ids=batch.segment_ids,
            config=LossConfig(beta=0.0), num_tokens=counts[0], num_sequences=counts[1],
        )  # fmt: skip
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                distributed.all_reduce(p.grad, "sum")
        optimizer.step()
        report["losses"].append(float(loss.detach()))
        report["checksums"].append(float(sum(p.detach().double().sum() for p in model.parameters())))
    now = torch.cat([p.detach().flatten() for p in model.parameters()])
    report["moved"] = float((now - start).abs().max())
    return report


def _fail(rank, tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import distributed
    from interlens_mcore.compat.swift import run
    from interlens_mcore.engines.base import SamplingParams
    from interlens_mcore.engines.hf import HFEngine
    from interlens_mcore.rollout.multiturn import MultiTurnError

    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(tiny_path),
        AutoTokenizer.from_pretrained(tiny_path),
    )
    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    scheduler, rows = _scheduler_and_rows(rank)
    if rank == 1:
        rows[1]["fail_at"] = 2
    try:
        run(rows, scheduler, HFEngine(model, tokenizer), tokenizer, SamplingParams(max_new_tokens=3),
            gather_fn=groups.gather_fn(), rank=rank)  # fmt: skip
    except TimeoutError as exc:
        return ("TimeoutError", "\n".join(exc.__notes__))
    except MultiTurnError as exc:
        return ("MultiTurnError", str(exc))
    return ("no error", "")


def test_two_ranks_train_three_steps_and_fail_together(tiny_path):
    results = run_ranks(_train_then_fail, 2, tiny_path, timeout=300)
    reports = [r[0] for r in results]
    for rank, report in enumerate(reports):
        turns = SCHEDULER_TURNS[rank]
        assert report["turns"] == [[turns] * 4] * 3  # 2 rows x 2 generations, every step
        assert report["same_as_alone"]
        assert report["first_step_gap"] < 1e-4
        assert all(torch.isfinite(torch.tensor(report["losses"])))
        assert report["moved"] > 0
    assert reports[0]["checksums"] == reports[1]["checksums"]  # one model: gradients summed over ranks
    # rank 1's scheduler raises at turn 2: its own error there, the group's on rank 0, no hang
    (kind0, text0), (kind1, text1) = [r[1] for r in results]
    assert kind0 == "MultiTurnError" and "rank 1: TimeoutError: tool server timed out" in text0
    assert kind1 == "TimeoutError" and "Countdown.step for request 0-3 (index 3, turn 2)" in text1
