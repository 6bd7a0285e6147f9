"""The fault-injection matrix, run under torchrun on 2 ranks (tests/test_fault_matrix.py drives it).

    torchrun --nproc_per_node=2 tests/fault_matrix_job.py --backend megatron --tp 1 --out cases.jsonl

Each case trains a fresh `GRPOTrainer` (on one backend built once) for 2 steps of a tiny task,
with one piece of user code raising on one rank only, at one step: a training rollout's
environment, an evaluation rollout's environment, a reward function, the task's `success_of`,
a tool, or a scheduler hook, at the first step or a later one. Every rank records how its run
ended (the `WorldFailure` message, or the records of a run that went on) and when; rank 0
writes one JSON line per case. A case that left a rank waiting in a collective never writes
its line: the driving test's deadline turns that into a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a script

from interlens_mcore import ChatFormat, Environment, Message, MultiTurnScheduler, distributed  # noqa: E402
from interlens_mcore.grpo.loss.config import LossConfig  # noqa: E402
from interlens_mcore.grpo.rewards import environment_reward  # noqa: E402
from interlens_mcore.rollout.rollouter import RolloutConfig  # noqa: E402
from interlens_mcore.tasks import TaskSource  # noqa: E402
from interlens_mcore.tools.environment import ToolEnvironment  # noqa: E402
from interlens_mcore.tools.parser import ParsedCalls, ToolCall  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fault_tools, for the tool workers too
from fault_tools import lookup  # noqa: E402

STAGES = ("env", "eval_env", "reward", "success", "tool", "scheduler")
# a tool's failure is the policy's to read (an error line, counted), so that run goes on
GOES_ON = ("tool",)
# a reward function's failure fails the samples it raised for (each scored alone), and the run goes on
ISOLATED = ("reward",)
STEPS = 2


class InjectedFault(RuntimeError):
    pass


@dataclass
class Fault:
    """Raises at `stage` on rank `rank`, in the first (step 0) or a later step of its phase."""

    stage: str
    rank: int
    when: str  # "first" | "later"
    phase: tuple[str, int] = ("train", 0)  # set by the task source: ("train" | "eval", step)
    fired_at: float | None = None
    fired: int = 0
    tool_errors: int = 0  # error lines the policy read, as the ToolEnvironment counted them

    def hit(self, stage: str) -> None:
        kind, step = self.phase
        wanted = "eval" if self.stage == "eval_env" else "train"
        first = step == 0
        if stage != self.stage or distributed.rank() != self.rank or kind != wanted:
            return
        if first != (self.when == "first"):
            return
        self.fired += 1
        self.fired_at = self.fired_at or time.time()
        raise InjectedFault(f"injected fault: {stage} on rank {self.rank} at {kind} step {step}")


class Judge(Environment):
    name = "judge"

    def __init__(self, fault: Fault):
        self.fault = fault

    def respond(self, conv):
        self.fault.hit("env")
        self.fault.hit("eval_env")
        self.fault.tool_errors += conv.infos.get("tool_errors", 0)
        conv.infos["success"] = float(any(c.isdigit() for c in conv.messages[-1].content))
        conv.request_stop("judged")
        return "thanks"

    def reward(self, conv):
        return conv.infos.get("success", 0.0)


class EveryReplyCalls:
    """A parser that reads every reply as one call of `lookup` (the tiny policy writes no tags);
    where the fault strikes, the call asks the tool (in its worker process) to raise."""

    stop: tuple[str, ...] = ()

    def __init__(self, fault: Fault):
        self.fault = fault

    def parse(self, text: str) -> ParsedCalls:
        try:
            self.fault.hit("tool")
            fail = False
        except InjectedFault:
            fail = True
        return ParsedCalls(calls=(ToolCall(name="lookup", arguments={"query": text[:8], "fail": fail}),))


@dataclass(frozen=True)
class SayNumber:
    fault: Fault
    tools: bool = False
    max_turns: int = 4

    def prompt(self):
        return [Message(speaker="user", content="say a number")]

    def lineup(self, seat):
        judge = Judge(self.fault)
        if not self.tools:
            return [seat("policy"), judge]
        parser = EveryReplyCalls(self.fault)
        return [seat("policy"), ToolEnvironment([lookup], inner=judge, parser=parser, max_calls=1)]


class Hooked(MultiTurnScheduler):
    """Two turns; its `on_turn_end` hook is where the fault strikes."""

    def __init__(self, fault: Fault, tokenizer):
        super().__init__(chat=ChatFormat(tokenizer), max_turns=2)
        self.fault = fault

    async def on_turn_end(self, request, response_choice, current_turn):
        self.fault.hit("scheduler")
        return {"rollout_infos": {"reward": float(any(c.isdigit() for c in response_choice.text))}}

    def step(self, request, response_choice, current_turn):
        return {"infer_request": self.reply(request, response_choice, "go on")}


class Faulty(TaskSource):
    name = "faulty"

    def __init__(self, fault: Fault, tokenizer):
        self.fault, self.tokenizer = fault, tokenizer
        self.tools = fault.stage == "tool"

    def rows(self, n, *, seed):
        if self.fault.stage == "scheduler":
            return [[{"role": "user", "content": "say a number"}] for _ in range(n)]
        return [SayNumber(self.fault, tools=self.tools) for _ in range(n)]

    def eval_rows(self, n, *, seed):
        if self.fault.stage == "scheduler":
            return []  # evaluation plays lineups; the scheduler rows are trained only
        return [SayNumber(self.fault, tools=self.tools) for _ in range(n)]

    def scheduler(self):
        return Hooked(self.fault, self.tokenizer) if self.fault.stage == "scheduler" else None

    def run(self, rollouter, rows, step):
        self.fault.phase = ("train", step)
        return super().run(rollouter, rows, step)

    def evaluate(self, rollouter, rows, step):
        self.fault.phase = ("eval", step)
        return super().evaluate(rollouter, rows, step)

    def success_of(self, trajectory):
        self.fault.hit("success")
        return super().success_of(trajectory)


def reward_of(fault: Fault):
    def short(trajectories, rows):
        fault.hit("reward")
        return [float(len(t.infos.get("completion", "")) <= 3) for t in trajectories]

    return short


def cases() -> list[tuple[str, int, str]]:
    return [(s, r, w) for s in STAGES for r in (0, 1) for w in ("first", "later")]


def run_case(backend, groups, tokenizer, fault: Fault, out: Path) -> dict:
    from trainers import GRPOTrainer, TrainerConfig

    config = TrainerConfig(
        steps=STEPS,
        batch_size=4,
        eval_every=STEPS,  # before the first step and after the last
        eval_size=2,
        save_every=100,
        log_completions_every=1,
        output_dir=str(out),
        collective_timeout_s=120,
    )
    trainer = GRPOTrainer(
        backend=backend,
        tasks=Faulty(fault, tokenizer),
        groups=groups,
        tokenizer=tokenizer,
        config=config,
        # fail fast, as the matrix checks (the default "skip" would end only the failing samples:
        # tests/multiproc/test_sample_errors_dist.py); the reward stage keeps the default, whose
        # raising function fails just the samples it raised for
        rollout_config=RolloutConfig(
            num_generations=2,
            max_new_tokens=2,
            on_sample_error="skip" if fault.stage in ISOLATED else "raise",
        ),
        loss_config=LossConfig(beta=0.0),
        rewards=[environment_reward, reward_of(fault)],
    )
    try:
        records = trainer.train()
        outcome = {"ended": "ran", "steps": [r["step"] for r in records]}
    except distributed.WorldFailure as exc:
        outcome = {"ended": "failed", "message": str(exc)}
    timing = {"ended_at": time.time(), "fired_at": fault.fired_at}
    return {**outcome, **timing, "fired": fault.fired, "tool_errors": fault.tool_errors}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="megatron", choices=["megatron", "deepspeed"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--zero-stage", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=None, help="run the cases of this stage only")
    opts = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from interlens_mcore.assets import ensure_tiny_model
    from trainers import BackendConfig, TrainerConfig, build_backend

    torch.set_num_threads(1)
    distributed.init_distributed(timeout_s=120)
    assets = Path(os.environ.get("INTERLENS_ASSETS") or Path(opts.out).parent / "assets")
    path = ensure_tiny_model(assets / "tiny-qwen2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    backend, groups = build_backend(
        BackendConfig(backend=opts.backend, tp=opts.tp, zero_stage=opts.zero_stage),
        TrainerConfig(batch_size=4, collective_timeout_s=120),
        model_path=path,
        tokenizer=tokenizer,
        temperature=1.0,
        reference=False,
        trajectories_per_rank=4,
        micro_batch_size=0,
    )
    root = Path(opts.out).parent / f"runs-{opts.backend}-tp{opts.tp}"
    with open(opts.out, "w") as sink:
        for i, (stage, rank, when) in enumerate(cases()):
            if opts.only and stage != opts.only:
                continue
            fault = Fault(stage, rank, when)
            mine = run_case(backend, groups, tokenizer, fault, root / f"case{i:02d}")
            # every rank ended this case at the same check (or ran it through): aligned again
            every = distributed.all_gather_object(mine)
            if distributed.rank() == 0:
                line = {"stage": stage, "rank": rank, "when": when, "ranks": every}
                sink.write(json.dumps(line) + "\n")
                sink.flush()
    distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
