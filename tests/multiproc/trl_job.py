"""One rank of `test_trl_dist.py`: launch/trl_grpo.py's trainer (TRL's GRPOTrainer, our rollout_func).

    torchrun --nproc_per_node=2 tests/multiproc/trl_job.py MODEL OUT {train|raise}

train: rank 0 plays one guess a game, rank 1 three (2 against 6 conversation turns), 3 steps;
every rank writes OUT/rank-R.json with what TRL's loss received against what our rollouts
returned. raise: rank 1's game master raises at its first reply.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))
from trl_grpo import build_trainer  # noqa: E402

from interlens_mcore import Environment  # noqa: E402
from interlens_mcore.tasks import GuessTasks  # noqa: E402
from interlens_mcore.tasks.guess import GuessNumberTask, guess_tasks  # noqa: E402

MESSAGE = "the game master broke on purpose"


class Broken(Environment):
    name = "game"

    def respond(self, conv):
        raise RuntimeError(MESSAGE)


@dataclass(frozen=True, kw_only=True)
class BrokenTask(GuessNumberTask):
    def environment(self):
        return Broken()


class BrokenGuess(GuessTasks):
    def rows(self, n, *, seed):
        return [BrokenTask(**vars(t)) for t in guess_tasks(n, seed=seed)]


def main(model: str, out: Path, mode: str) -> None:
    rank = int(os.environ["RANK"])  # torchrun's
    if mode == "raise":
        source = BrokenGuess() if rank == 1 else GuessTasks()
    else:
        source = GuessTasks(max_guesses=1 if rank == 0 else 3)
    trainer = build_trainer(source, model=model, output_dir=str(out / "trl"), use_cpu=True)
    rollouts, seen = trainer.rollout_func, []
    returned: list[dict] = []

    def rollout_func(prompts, t):
        fields = rollouts(prompts, t)
        returned.append(fields)
        return fields

    trainer.rollout_func = rollout_func
    compute_loss = trainer.compute_loss

    def spy(model_, inputs, *args, **kwargs):
        # what TRL's loss runs on, against what the rollout function returned this step
        ours = returned[-1]
        mask = inputs["tool_mask"]  # TRL's name for env_mask  # [B, C]
        ids, logps = inputs["completion_ids"], inputs["sampling_per_token_logps"]  # [B, C]
        # TRL shuffles a generation batch before it cuts it into steps: compare as multisets
        lens = inputs["completion_mask"].sum(1).tolist()
        theirs = sorted(
            (p[pm.bool()].tolist(), c[:n].tolist(), m[:n].tolist())
            for p, pm, c, m, n in zip(inputs["prompt_ids"], inputs["prompt_mask"], ids, mask, lens)
        )
        mine = sorted(zip(ours["prompt_ids"], ours["completion_ids"], ours["env_mask"]))
        step = {"same": theirs == [tuple(x) for x in mine], "samples": len(theirs)}
        # the policy's own logprobs of the same tokens, recomputed by a full forward
        net = trainer.accelerator.unwrap_model(model_)
        full = torch.cat([inputs["prompt_ids"], ids], 1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            was = net.training
            net.eval()
            pos = (att.cumsum(1) - 1).clamp(min=0)
            logits = net(input_ids=full, attention_mask=att, position_ids=pos).logits.float()
            net.train(was)
        p = inputs["prompt_ids"].shape[1]
        lp = torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        keep = (mask * inputs["completion_mask"]).bool()
        step["logprob_diff"] = float((lp - logps)[keep].abs().max())
        step["turns"] = ours["turns"]
        seen.append(step)
        return compute_loss(model_, inputs, *args, **kwargs)

    trainer.compute_loss = spy
    trainer.train()
    (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "steps": seen}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
