"""Guess-a-number written as an agent against the OpenAI API, trained with `--agent`.

    torchrun --nproc-per-node 2 launch/train_grpo.py --agent launch/agents/guess_agent.py:play

The rows are those of `--task guess` (the default): each a `GuessNumberTask` with its secret.
The agent asks the policy for a guess, answers "higher" or "lower" with the range still open,
and returns the built-in task's reward for the game it played. The README shows this file's code.
"""

import re

from interlens_mcore.tasks.guess import game_reward, game_state


async def play(client, game):  # client: openai.AsyncOpenAI on this sample's session; game: a row
    messages = [{"role": "user", "content": f"guess the number between {game.low} and {game.high}"}]
    guesses = []
    for _ in range(game.max_guesses):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content
        found = re.search(r"-?\d+", text)
        guesses.append(int(found.group()) if found else None)
        state = game_state(game, guesses)
        if state.solved_at is not None:
            break
        hint = "higher" if (guesses[-1] or 0) < game.secret else "lower"
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": f"{hint}: between {state.low} and {state.high}"})
    return {"reward": game_reward(game, state), "success": float(state.solved_at is not None)}
