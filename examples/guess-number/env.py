"""Guess the number: a multi-turn environment a user writes for Loong (``task = "env"``).

One instance per episode. ``reset`` gets the data row (``{"secret": 7}``) and returns the prompt;
``step`` gets each assistant turn and answers "higher" or "lower" until the guess is right (reward
1) or the episode runs out of turns (``rollout.max_turns``). A turn that is not a number gets a
reminder, not an error: the environment decides what a bad action costs.
"""

from loong_agentflow import StepResult


class GuessNumber:
    def __init__(self, low: int = 1, high: int = 9) -> None:
        self.low, self.high, self.secret = low, high, 0

    def reset(self, row: dict) -> list[dict[str, str]]:
        self.secret = int(row["secret"])
        ask = f"Guess my number from {self.low} to {self.high}. Answer with the number only."
        return [{"role": "user", "content": ask}]

    def step(self, action: str) -> StepResult:
        guess = action.strip()
        if not guess.isdigit():
            return StepResult(observations=[{"role": "user", "content": "Answer with a number only."}])
        if int(guess) == self.secret:
            return StepResult(reward=1.0, done=True)
        hint = "higher" if int(guess) < self.secret else "lower"
        return StepResult(observations=[{"role": "user", "content": hint}])

    def close(self) -> None:
        pass
