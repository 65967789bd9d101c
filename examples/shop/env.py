"""A shop assistant: a multi-turn environment with a tool, written as a user would for Loong.

One instance per episode (``task = "env"``). ``reset`` gets the data row (``{"item": "fig",
"shelf": {"fig": 4, ...}}``) and asks how many of the item are left; the model looks it up with the
``stock`` tool (a method, so it sees this episode's shelf), then answers. ``step`` scores the
answer: 1 for the shelf's count, else 0. Loong runs the tool calls and keeps the tokens.
"""

from loong_agentflow import StepResult


class Shop:
    def __init__(self) -> None:
        self.shelf: dict[str, int] = {}
        self.item = ""

    def reset(self, row: dict) -> list[dict[str, str]]:
        self.shelf, self.item = dict(row["shelf"]), row["item"]
        return [{"role": "user", "content": f"How many {self.item} are left?"}]

    def tools(self) -> list:
        return [self.stock]

    def stock(self, item: str) -> int:
        """How many of an item are on the shelf.

        Args:
            item: the item's name, e.g. "fig"
        """
        if item not in self.shelf:
            raise KeyError(f"no {item!r} on this shelf (there are: {', '.join(self.shelf)})")
        return self.shelf[item]

    def step(self, action: str) -> StepResult:
        return StepResult(reward=float(action.strip() == str(self.shelf[self.item])), done=True)
