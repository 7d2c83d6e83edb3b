"""A multi-turn game with an environment reward: guess a secret integer, told "higher" or "lower" each turn.

Reward: 1 - (turns used - 1) / max_turns when the secret is found, 0 when the turns run out; per-turn
rewards: 1 for the finding turn, else how much the turn's guess narrowed the range still open (0 for a
guess outside it or no number), so a binary search earns about 0.5 a turn.
"""

from __future__ import annotations

import re

from trinity.workflows.session import EpisodeLimit, Session
from trinity.workflows.types import Episode, Task

_INT = re.compile(r"-?\d+")


def feedback(guess: int | None, secret: int) -> str:
    if guess is None:
        return "Answer with one integer."
    if guess == secret:
        return "Correct!"
    return "Higher." if guess < secret else "Lower."


async def guess_number_workflow(task: Task, session: Session, *, max_new_tokens: int | None = None) -> Episode:
    """Task {"secret": 37, "low": 1, "high": 100} ("low"/"high" default 1 and 100)."""
    secret, low, high = int(task["secret"]), int(task.get("low", 1)), int(task.get("high", 100))
    messages = [{"role": "user", "content": f"I picked an integer from {low} to {high}. Guess it; after each "
                                            "guess I say higher or lower. Reply with the number only."}]
    open_low, open_high = low, high
    turn_rewards: list[float] = []
    try:
        while True:
            reply = await session.chat(messages, max_new_tokens=max_new_tokens)
            found = _INT.findall(reply.text)
            guess = int(found[-1]) if found else None
            if guess == secret:
                turn_rewards.append(1.0)
                used = len(session.turns)
                return session.finish(reward=1.0 - (used - 1) / session.limits.max_turns, turn_rewards=turn_rewards)
            width = open_high - open_low + 1
            if guess is not None and open_low <= guess <= open_high:
                open_low, open_high = (guess + 1, open_high) if guess < secret else (open_low, guess - 1)
            turn_rewards.append(1.0 - (open_high - open_low + 1) / width if width > 0 else 0.0)
            messages += [reply.message, {"role": "user", "content": feedback(guess, secret)}]
    except EpisodeLimit as e:
        return session.finish(reward=0.0, turn_rewards=turn_rewards, end=e.reason)


def write_tasks(path: str, n: int, seed: int = 0, low: int = 1, high: int = 100) -> None:
    """n tasks {"secret", "low", "high"} as jsonl (a workflow job's data.train_files)."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"secret": rng.randint(low, high), "low": low, "high": high}) + "\n")


if __name__ == "__main__":  # python -m trinity.workflows.guess_number tasks.jsonl [n] [high]
    import sys

    write_tasks(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 256,
                high=int(sys.argv[3]) if len(sys.argv) > 3 else 100)
