"""The HF engine under DeepSpeed ZeRO-3: every forward gathers weights from both ranks, so
ranks with uneven turns finish only because of the vote (and the engine's lockstep steps)."""

import pytest
from support.dist import run_ranks

pytestmark = pytest.mark.slow  # ZeRO-3 gathers every weight over gloo; not a first path: the slow stage

pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra: pip install -e .[deepspeed]")


def _zero3_rollout(rank, world, tiny_path, use_vote):
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import (
        Conversation,
        Environment,
        HFEngine,
        MaxTurns,
        Policy,
        SamplingParams,
        co_step,
        distributed,
    )
    from interlens_mcore.rollout.vote import local_gather

    class Feedback(Environment):
        name = "env"

        def respond(self, conv):
            return "lower"

    tok = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # partition every tensor (the tiny model would otherwise stay whole on each rank)
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    engine_ds, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    groups = distributed.build_groups(rollout="data_parallel", vote_timeout_s=60)
    engine = HFEngine(engine_ds.module, tok, sync_group=groups.rollout)
    pol = Policy("agent", engine, tok, SamplingParams(max_new_tokens=2))
    turns = 1 if rank == 0 else 4  # every forward gathers each weight over gloo: few of them
    convs = [Conversation([pol, Feedback()], run_until=MaxTurns(turns), id=f"z{rank}{i}") for i in range(2)]
    gather = groups.gather_fn() if use_vote else local_gather
    co_step(convs, turns=None, gather_fn=gather, rank=groups.rollout_rank)
    # what a trainer does next: a forward that gathers the partitioned weights again
    engine.generate([])
    return [c.turns_taken for c in convs]


def test_zero3_uneven_turns_finish_with_the_vote(tiny_path):
    out = run_ranks(_zero3_rollout, 2, str(tiny_path), True, timeout=240)
    assert out == [[1, 1], [4, 4]]


def test_zero3_without_the_vote_hangs(tiny_path):
    # rank 0 leaves after 1 turn; rank 1's next forward waits for rank 0's weight shards
    with pytest.raises((TimeoutError, RuntimeError)) as info:
        run_ranks(_zero3_rollout, 2, str(tiny_path), False, timeout=60)
    if isinstance(info.value, RuntimeError):  # gloo may notice the peer left instead of hanging
        assert "rank 1" in str(info.value)


def _too_long_on_one_rank(rank, world, tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import (
        Conversation,
        HFEngine,
        MaxTurns,
        Message,
        Policy,
        RolloutError,
        SamplingParams,
        Scripted,
        co_step,
        distributed,
    )

    tok = AutoTokenizer.from_pretrained(tiny_path)
    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    engine = HFEngine(
        AutoModelForCausalLM.from_pretrained(tiny_path), tok, max_context=64, sync_group=groups.rollout
    )
    pol = Policy("policy", engine, tok, SamplingParams(max_new_tokens=4))
    text = "guess" if rank == 0 else "guess the number " * 40  # about 250 tokens on rank 1
    prompt = [Message(speaker="user", content=text)]
    conv = Conversation([pol, Scripted("env", ["ok"])], prompt, run_until=MaxTurns(3), id=f"c{rank}")
    try:
        co_step([conv], gather_fn=groups.gather_fn(), rank=groups.rollout_rank, engines=[engine])
    except RolloutError as err:
        return str(err)
    return f"{conv.status.value}: {conv.stop_reason}"


def test_a_prompt_too_long_on_one_rank_ends_that_conversation_alone(tiny_path):
    # rank 1's prompt overflows the context: its conversation ends TRUNCATED before any forward
    # (a rank that fed it to the lockstep engine would leave rank 0 waiting in the first
    # forward's all-reduce until the process group's timeout); rank 0's runs to its end
    first, second = run_ranks(_too_long_on_one_rank, 2, str(tiny_path), timeout=90)
    assert first.startswith("stopped") or first.startswith("max_turns"), first
    assert second.startswith("truncated: context: prompt of") and "fills" in second, second
