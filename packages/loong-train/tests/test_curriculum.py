"""The prompt curriculum: its skip and return rules against hand-worked sequences of group
outcomes, the draw it makes of a task stream, and a checkpoint's round trip through msgpack
(what ``controller_state.msgpack`` does to it). End to end, with a resumed run: test_resume.py."""

import itertools
import random

import msgspec
import pytest

from loong_core.records import EpisodeStatus, Trajectory
from loong_train.config import load_recipe
from loong_train.curriculum import Curriculum, CurriculumConfig, prompt_key
from loong_train.source import GroupSource

SOLVED, FAILED, MIXED = [1.0, 1.0], [0.0, 0.0], [0.0, 1.0]


def test_a_prompt_rests_after_k_groups_of_one_kind_and_returns_after_the_cooldown():
    c = Curriculum(CurriculumConfig(enabled=True, failed=0.0, after=2, cooldown=5, return_prob=0.0), seed=0)
    # hand-worked: (outcome observed at `drawn`, then what a draw at `drawn` decides)
    assert c.observe("a", SOLVED, drawn=1) == "solved" and c.admits("a", 1, 0)  # streak 1 < 2
    assert c.observe("a", MIXED, drawn=2) == "mixed" and c.admits("a", 2, 0)  # streak broken
    c.observe("a", SOLVED, drawn=3)
    c.observe("a", SOLVED, drawn=4)  # two in a row: rests as solved, since draw 4
    assert c.counts()["prompts_solved"] == 1 and c.counts()["prompts_active"] == 0
    assert not c.admits("a", drawn=8, passed=0)  # 4 draws into a cool-down of 5
    assert c.admits("a", drawn=9, passed=0)  # 5: back for good, its streak forgotten
    assert c.counts() == {
        "prompts_active": 1,
        "prompts_solved": 0,
        "prompts_hopeless": 0,
        "prompts_skipped": 1,
        "prompts_returned": 1,
        "prompts_forced": 0,
    }
    c.observe("a", SOLVED, drawn=10)
    assert c.admits("a", 10, 0)  # one solved group after returning: not yet `after`
    c.observe("a", FAILED, drawn=11)
    c.observe("a", FAILED, drawn=12)  # two failed in a row: hopeless
    assert c.counts()["prompts_hopeless"] == 1 and not c.admits("a", 13, 0)


def test_failed_below_its_threshold_and_an_empty_group_are_not_observations():
    c = Curriculum(CurriculumConfig(enabled=True, solved=0.9, failed=0.2), seed=0)
    assert c.outcome([0.95, 1.0]) == "solved"
    assert c.outcome([0.2, 0.1]) == "failed"
    assert c.outcome([0.95, 0.5]) == "mixed"
    assert c.observe("a", [], drawn=0) is None and not c.prompts  # no trainable episode
    keep_hopeless = Curriculum(CurriculumConfig(enabled=True), seed=0)
    keep_hopeless.observe("a", FAILED, drawn=0)
    assert keep_hopeless.admits("a", 1, 0) and keep_hopeless.counts()["prompts_hopeless"] == 0


def test_the_coin_draws_a_resting_prompt_as_an_independent_seeded_coin_says():
    c = Curriculum(CurriculumConfig(enabled=True, return_prob=0.3), seed=7)
    for key in ("a", "b"):
        c.observe(key, SOLVED, drawn=0)
    coin = random.Random(7)
    for drawn in range(200):
        assert c.admits("a", drawn, passed=0, any_item=c.takes_any()) == (coin.random() < 0.3)
    assert c.counts()["prompts_returned"] + c.counts()["prompts_skipped"] == 200
    # drawn by the coin, still resting: a solved group restarts its rest, a mixed one wakes it
    c.observe("a", SOLVED, drawn=200)
    assert c.prompts["a"].resting == "solved" and c.prompts["a"].since == 200
    c.observe("a", MIXED, drawn=201)
    assert c.prompts["a"].resting == "" and c.counts()["prompts_active"] == 1 and c.resting == 1


def test_when_every_prompt_offered_rests_the_draw_takes_one_anyway():
    c = Curriculum(CurriculumConfig(enabled=True, failed=0.0, return_prob=0.0), seed=0)
    for key in ("a", "b", "c"):
        c.observe(key, FAILED, drawn=0)
    assert not c.admits("a", 3, passed=2)
    assert c.admits("a", 3, passed=3)  # passed over as many in a row as there are resting prompts
    assert c.counts()["prompts_forced"] == 1
    capped = Curriculum(CurriculumConfig(enabled=True, failed=0.0, return_prob=0.0, max_skips=2), seed=0)
    for key in ("a", "b", "c"):
        capped.observe(key, FAILED, drawn=0)
    assert not capped.admits("a", 3, passed=1) and capped.admits("a", 3, passed=2)  # the cap


def _group(group_id: str, rewards: list[float]) -> list[Trajectory]:
    return [
        Trajectory(sample_id=f"{group_id}-{j}", group_id=group_id, spans=[], reward=r)
        for j, r in enumerate(rewards)
    ]


def _items(n: int) -> itertools.cycle:
    return itertools.cycle([{"messages": [{"role": "user", "content": f"q{i}"}], "n": i} for i in range(n)])


def test_the_source_passes_over_resting_prompts_of_a_cycling_stream():
    """Four prompts cycling; q1 solved and q2 hopeless after one group each (after = 1)."""
    curriculum = Curriculum(CurriculumConfig(enabled=True, failed=0.0, return_prob=0.0), seed=0)
    source = GroupSource(_items(4), group_size=2, curriculum=curriculum)
    first = [source.next_group() for _ in range(4)]
    for group_id, rewards in zip(first, [MIXED, SOLVED, FAILED, MIXED], strict=True):
        assert source.observe(group_id, _group(group_id, rewards)) is not None
    source.release(first)
    drawn = [source.issued[source.next_group()]["n"] for _ in range(4)]
    assert drawn == [0, 3, 0, 3]  # q1 and q2 skipped on every cycle
    assert source.count == 8 and source.pulled == 12
    assert curriculum.counts()["prompts_skipped"] == 4


def test_a_prompt_is_its_messages_or_else_its_whole_item():
    question = [{"role": "user", "content": "q"}]
    assert prompt_key({"messages": question, "id": "a"}) == prompt_key({"messages": question, "id": "b"})
    env_rows = [{"id": f"r{i}", "messages": [], "row": {"seed": i}} for i in range(2)]  # env items
    assert prompt_key(env_rows[0]) != prompt_key(env_rows[1])


def test_a_failed_episode_is_no_evidence_and_a_black_box_episode_counts_once():
    curriculum = Curriculum(CurriculumConfig(enabled=True), seed=0)
    source = GroupSource(_items(2), group_size=3, curriculum=curriculum)
    g = source.next_group()
    rows = [
        Trajectory(sample_id=f"{g}-0", group_id=g, spans=[], reward=1.0),
        Trajectory(sample_id=f"{g}-1", group_id=g, spans=[], reward=0.0, status=EpisodeStatus.FAILED),
        # two rows of one black-box episode (one per model turn), its reward on both
        Trajectory(sample_id=f"{g}-2.0", group_id=g, spans=[], reward=1.0, info={"episode": f"{g}-2"}),
        Trajectory(sample_id=f"{g}-2.1", group_id=g, spans=[], reward=1.0, info={"episode": f"{g}-2"}),
    ]
    assert source.observe(g, rows) == "solved"
    assert curriculum.prompts[prompt_key(source.issued[g])].streak == 1


def test_a_restored_source_draws_exactly_what_the_uninterrupted_one_draws():
    """Outcomes fed by a fixed rule (prompt n: solved when n % 3 == 0, failed when n % 3 == 1),
    a coin of 0.4 and a cool-down of 9: the source restored from a msgpack round trip of its state
    at group 20 draws the same 40 next prompts, with the same counts."""
    config = CurriculumConfig(enabled=True, failed=0.0, return_prob=0.4, cooldown=9)

    def new_source() -> GroupSource:
        return GroupSource(_items(7), group_size=2, seed=3, curriculum=Curriculum(config, seed=3))

    def step(source: GroupSource) -> int:
        g = source.next_group()
        n = source.issued[g]["n"]
        rewards = SOLVED if n % 3 == 0 else FAILED if n % 3 == 1 else MIXED
        source.observe(g, _group(g, rewards))
        source.release([g])
        return n

    whole = new_source()
    [step(whole) for _ in range(20)]
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(whole.state_dict()))
    restored = new_source()
    restored.load_state_dict(state)
    assert [step(restored) for _ in range(40)] == [step(whole) for _ in range(40)]
    assert restored.curriculum.counts() == whole.curriculum.counts()
    assert whole.curriculum.counts()["prompts_skipped"] > 0
    assert whole.curriculum.counts()["prompts_returned"] > 0
    assert (restored.count, restored.pulled) == (whole.count, whole.pulled)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("curriculum.after=0", "after must be >= 1"),
        ("curriculum.return_prob=1.5", "return_prob must be in [0, 1]"),
        ("curriculum.failed=1.0", "failed (1.0) must be below solved (1.0)"),
        ("curriculum.cooldown=-1", "cooldown must be >= 0"),
        ("curriculum.max_skips=-1", "max_skips must be >= 0"),
        ("curriculum.rest=3", "rest"),
    ],
)
def test_a_bad_curriculum_table_is_refused_with_what_was_expected(override, message):
    with pytest.raises(Exception, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_recipe("tiny-calc-agent", [override])
