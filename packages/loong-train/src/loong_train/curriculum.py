"""The prompt curriculum (the ``[curriculum]`` table): prompts the policy keeps solving, or keeps
failing, leave the draw, and come back after a cool-down or by chance.

A prompt is its chat messages (:func:`prompt_key`: the same question drawn twice is one prompt,
whatever else its item carries; an item without messages, an environment's row, is its whole
item). Every group the run finishes (trained or dropped by dynamic sampling; not one lost and
issued again) is one observation of its prompt:

- *solved* when every trainable episode scored ``>= solved``, *failed* when every one scored
  ``<= failed``, *mixed* otherwise (a group with no trainable episode is no observation);
- a prompt's streak counts its consecutive solved (or failed) groups; a mixed group, or one of
  the other kind, starts it again;
- while its streak is ``after`` solved groups or more the prompt *rests* as solved (``after``
  failed: as hopeless), counted from the draw at which its last group was observed; a group that
  breaks the streak (of a prompt drawn while resting) wakes it.

The draw (:class:`~loong_train.source.GroupSource`) walks the task stream as before and passes
over a resting prompt, unless ``cooldown`` groups were drawn since it began resting (it returns
for good: it leaves again only after another ``after`` groups of one kind). A seeded coin of
``return_prob``, flipped once per draw, makes that draw take the stream's next item whatever its
state: resting prompts come back in proportion to how common they are, and at most a
``return_prob`` share of the draws goes to them (one so drawn stays resting: a group that keeps
its streak restarts its rest, one that breaks it wakes it).

Passing over costs what the stream costs to produce an item (a reasoning-gym item: about 40 us,
measured), so a draw passes over at most ``max_skips`` items (and never more than there are
resting prompts, when every prompt the stream still offers rests): then it takes the item at hand
anyway (``forced``). A task the policy masters never blocks the run, nor makes a draw scan the
stream; with dynamic sampling such groups are dropped and the run ends as finished
(:mod:`loong_train.pipeline`).

Everything here is pure Python, deterministic given the outcomes and the seed; the statistics,
the coin's state and the counters are part of a checkpoint (:meth:`Curriculum.state_dict`).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

__all__ = ["Curriculum", "CurriculumConfig", "Outcome", "prompt_key"]

Outcome = Literal["solved", "failed", "mixed"]


class CurriculumConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[curriculum]`` table (this module's docstring says what each key does).

    ``enabled``; ``after`` (consecutive groups of one kind before a prompt rests); ``solved`` and
    ``failed`` (reward thresholds; ``solved = inf`` keeps solved prompts in the draw; ``failed``
    is ``-inf`` unless set, so hopeless prompts stay: resting them after one all-failed group
    cost held-out success on tiny-reasoning, 0.62 against 0.75, since the policy still learns
    many of them); ``cooldown`` (groups drawn before a resting prompt returns; 0: never by
    time); ``return_prob`` (the share of draws that take the stream's next item, resting or
    not); ``max_skips`` (items one draw may pass over)."""

    enabled: bool = False
    after: int = 1
    solved: float = 1.0
    failed: float = float("-inf")
    cooldown: int = 0
    return_prob: float = 0.05
    max_skips: int = 64

    def __post_init__(self) -> None:
        if self.max_skips < 0:
            raise ValueError(f"max_skips must be >= 0 items passed over per draw, got {self.max_skips}")
        if self.after < 1:
            raise ValueError(f"after must be >= 1 (groups in a row before a prompt rests), got {self.after}")
        if self.cooldown < 0:
            raise ValueError(f"cooldown must be >= 0 groups drawn (0: no cool-down), got {self.cooldown}")
        if not 0.0 <= self.return_prob <= 1.0:
            raise ValueError(f"return_prob must be in [0, 1], got {self.return_prob}")
        if math.isnan(self.solved) or math.isnan(self.failed) or self.failed >= self.solved:
            raise ValueError(
                f"failed ({self.failed}) must be below solved ({self.solved}): a group cannot be both"
            )


def prompt_key(item: dict[str, Any]) -> str:
    """The curriculum's name for an item's prompt: a hash of its chat messages, or of the whole
    item when it has none (an environment's row, whose prompt its ``reset`` writes)."""
    what = item.get("messages") or item
    text = json.dumps(what, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@dataclass(slots=True)
class _Prompt:
    streak: int = 0  # > 0: solved groups in a row; < 0: failed groups in a row
    resting: Literal["", "solved", "hopeless"] = ""
    since: int = 0  # groups drawn when it began resting


class Curriculum:
    """Per-prompt outcome statistics and the rule that says whether the draw takes a prompt."""

    def __init__(self, config: CurriculumConfig, seed: int) -> None:
        self.config = config
        self.coin = random.Random(seed)
        self.prompts: dict[str, _Prompt] = {}
        self.resting = 0  # prompts resting now
        self.skipped = self.returned = self.forced = 0  # draws, cumulative

    def outcome(self, rewards: Sequence[float]) -> Outcome | None:
        """What a group whose trainable episodes scored ``rewards`` says of its prompt."""
        if not rewards:
            return None
        if min(rewards) >= self.config.solved:
            return "solved"
        if max(rewards) <= self.config.failed:
            return "failed"
        return "mixed"

    def observe(self, key: str, rewards: Sequence[float], drawn: int) -> Outcome | None:
        """Count one finished group of prompt ``key`` (``drawn``: groups drawn so far)."""
        if (outcome := self.outcome(rewards)) is None:
            return None
        p = self.prompts.setdefault(key, _Prompt())
        if outcome == "solved":
            p.streak = max(p.streak, 0) + 1
        elif outcome == "failed":
            p.streak = min(p.streak, 0) - 1
        else:
            p.streak = 0
        if abs(p.streak) >= self.config.after:
            self.resting += not p.resting
            p.resting, p.since = ("solved" if p.streak > 0 else "hopeless"), drawn
        elif p.resting:  # drawn while resting (by the coin), and its streak broke
            self._wake(p)
        return outcome

    def takes_any(self) -> bool:
        """The coin, flipped once per draw: whether this draw takes the next item, resting or not."""
        return bool(self.config.return_prob) and self.coin.random() < self.config.return_prob

    def admits(self, key: str, drawn: int, passed: int, any_item: bool = False) -> bool:
        """Whether the draw takes prompt ``key`` now (``drawn``: groups drawn so far; ``passed``:
        items passed over in a row just before this one; ``any_item``: the draw's coin came up)."""
        p = self.prompts.get(key)
        if p is None or not p.resting:
            return True
        if self.config.cooldown and drawn - p.since >= self.config.cooldown:
            self._wake(p)
            p.streak = 0  # back for good: it rests again only after another `after` groups
            self.returned += 1
            return True
        if any_item:
            self.returned += 1
            return True
        if passed >= min(self.resting, self.config.max_skips):  # nearly every prompt offered rests
            self.forced += 1
            return True
        self.skipped += 1
        return False

    def _wake(self, p: _Prompt) -> None:
        p.resting = ""
        self.resting -= 1

    def counts(self) -> dict[str, int]:
        """Prompts seen, by state now, and the draw's cumulative counters."""
        solved = sum(1 for p in self.prompts.values() if p.resting == "solved")
        return {
            "prompts_active": len(self.prompts) - self.resting,
            "prompts_solved": solved,
            "prompts_hopeless": self.resting - solved,
            "prompts_skipped": self.skipped,
            "prompts_returned": self.returned,
            "prompts_forced": self.forced,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "prompts": {k: [p.streak, p.resting, p.since] for k, p in self.prompts.items()},
            "coin": _coin_state(self.coin.getstate()),
            "counters": [self.skipped, self.returned, self.forced],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts = {
            k: _Prompt(streak, resting, since) for k, (streak, resting, since) in state["prompts"].items()
        }
        self.resting = sum(1 for p in self.prompts.values() if p.resting)
        version, internal, gauss = state["coin"]
        self.coin.setstate((version, tuple(internal), gauss))
        self.skipped, self.returned, self.forced = state["counters"]


def _coin_state(state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]
