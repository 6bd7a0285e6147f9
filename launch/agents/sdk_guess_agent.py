"""Guess-a-number written with the OpenAI Agents SDK, trained with `--agent`.

    torchrun --nproc-per-node 2 launch/train_grpo.py --agent launch/agents/sdk_guess_agent.py:play

The SDK's agent answers each guess through its chat-completions model, pointed at this rank's
endpoint; the conversation goes on as the SDK documents it, `result.to_input_list()` plus the next
user message. The rows are `--task guess`'s games (the default) and the reward is the task's own.
"""

import re

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

from interlens_mcore.tasks.guess import game_reward, game_state

set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI's servers


async def play(client, game):
    agent = Agent(
        name="guesser",
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        model_settings=ModelSettings(max_tokens=8),
    )
    history = [{"role": "user", "content": f"guess the number between {game.low} and {game.high}"}]
    guesses: list[int | None] = []
    for _ in range(game.max_guesses):
        result = await Runner.run(agent, history, max_turns=1)
        found = re.search(r"-?\d+", str(result.final_output))
        guesses.append(int(found.group()) if found else None)
        state = game_state(game, guesses)
        if state.solved_at is not None:
            break
        hint = "higher" if (guesses[-1] or 0) < game.secret else "lower"
        reply = {"role": "user", "content": f"{hint}: between {state.low} and {state.high}"}
        history = result.to_input_list() + [reply]
    return {"reward": game_reward(game, state), "success": float(state.solved_at is not None)}
