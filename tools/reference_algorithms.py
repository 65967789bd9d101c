"""Reference values of verl's and TRL's RL algorithms for fixed inputs, written as JSON test fixtures.

Runs inside a throwaway virtual environment holding the library (never a dependency of Loong);
``tools/reference_algorithms.sh`` makes one per library and runs ``reference_algorithms.py
verl|trl OUT``. A fixture stores the inputs and the library's outputs, so
``packages/loong-train/tests/test_reference_algorithms.py`` needs nothing but the JSON.

verl (``verl.trainer.ppo.core_algos``):

- advantages: GRPO (unbiased std, and without std: Dr. GRPO), RLOO, REINFORCE++ and
  REINFORCE++ with baseline, from outcome rewards of groups (every group of at least two);
- policy losses: PPO with an asymmetric clip, with and without the dual clip, in every
  aggregation mode; GSPO; CISPO; each loss and its gradient with respect to the current logprobs;
- KL estimators: k1, k2, k3 (verl's ``kl``, ``mse``, ``low_var_kl``).

TRL (``GRPOTrainer._compute_loss``, run on the fixed logprobs in place of a model's; see
:func:`trl_fixture`):

- advantages: TRL's group statistics (``trl.trainer.utils.nanstd``, eps 1e-4), scaled and not (``scale_rewards``);
- policy losses and gradients for ``loss_type`` grpo, bnpo, dr_grpo and dapo with
  ``epsilon_high``, with and without ``delta`` (its two-sided clip); ``importance_sampling_level =
  "sequence"`` (GSPO); cispo.

Inputs are float64 from a seeded generator; lengths vary per row so length-weighting shows.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

ROWS, WIDTH = 8, 7
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _inputs(gen: torch.Generator) -> dict:
    lengths = [7, 3, 5, 1, 6, 2, 4, 7]
    mask = torch.zeros(ROWS, WIDTH, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    old = -torch.rand(ROWS, WIDTH, generator=gen, dtype=torch.float64) * 3
    new = old + (torch.rand(ROWS, WIDTH, generator=gen, dtype=torch.float64) - 0.5) * 1.2  # ratios 0.55..1.8
    adv = torch.randn(ROWS, 1, generator=gen, dtype=torch.float64).expand(ROWS, WIDTH).clone()
    ref = old + (torch.rand(ROWS, WIDTH, generator=gen, dtype=torch.float64) - 0.5) * 2
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.25, 0.75], dtype=torch.float64)
    return {
        "mask": mask,
        "old": old,
        "new": new,
        "adv": adv,
        "ref": ref,
        "rewards": rewards,
        "lengths": lengths,
    }


GROUPS = [
    0,
    0,
    0,
    1,
    1,
    1,
    1,
    0,
]  # every group has at least two episodes (verl gives a lone episode A = its reward)


def verl_fixture(x: dict) -> dict:
    from verl.trainer.ppo import core_algos as ca
    from verl.workers.config.actor import ActorConfig

    mask, rewards = x["mask"], x["rewards"]
    index = np.array([str(g) for g in GROUPS], dtype=object)
    scores = torch.zeros_like(mask)
    for i, n in enumerate(x["lengths"]):
        scores[i, n - 1] = rewards[i]  # an outcome reward sits on the last response token
    first = lambda a: a[:, 0].tolist()  # noqa: E731 (every token of a row carries its A)
    adv = {"groups": GROUPS}
    adv["grpo_unbiased"] = first(ca.compute_grpo_outcome_advantage(scores, mask, index, 1e-6, True)[0])
    adv["grpo_no_std"] = first(ca.compute_grpo_outcome_advantage(scores, mask, index, 1e-6, False)[0])
    adv["rloo"] = first(ca.compute_rloo_outcome_advantage(scores, mask, index, 1e-6)[0])

    class Gamma:  # REINFORCE++ reads config.gamma
        gamma = 1.0

    rpp = ca.compute_reinforce_plus_plus_outcome_advantage(scores, mask, config=Gamma())[0]
    adv["reinforce++_tokens"] = rpp.tolist()
    base = ca.compute_reinforce_plus_plus_baseline_outcome_advantage(scores, mask, index, 1e-6)[0]
    adv["reinforce++-baseline_tokens"] = base.tolist()

    def loss(fn, agg: str, **clip) -> dict:
        config = ActorConfig(
            strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_torch_compile=False, **clip
        )
        new = x["new"].clone().requires_grad_(True)
        value, metrics = fn(x["old"], new, x["adv"], x["mask"], loss_agg_mode=agg, config=config)
        value.backward()
        return {
            "loss": float(value.detach()),
            "grad": new.grad.tolist(),
            "clipfrac": metrics["actor/pg_clipfrac"],
        }

    vanilla = ca.compute_policy_loss_vanilla
    ppo = {
        agg: {
            "clip_high": loss(vanilla, agg, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1e9),
            "dual_clip": loss(vanilla, agg, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.5),
        }
        for agg in AGG_MODES
    }
    gspo = loss(ca.compute_policy_loss_gspo, "seq-mean-token-mean", clip_ratio_low=0.03, clip_ratio_high=0.04)
    cispo = loss(ca.compute_policy_loss_cispo, "token-mean", clip_ratio_low=0.1, clip_ratio_high=0.15)
    return {
        "about": "verl's algorithms on fixed float64 inputs: tools/reference_algorithms.sh regenerates it",
        "versions": {p: version(p) for p in ("verl", "torch", "numpy")},
        "inputs": _jsonable(x),
        "advantages": adv,
        "ppo": ppo,
        "ppo_clip": {"low": 0.2, "high": 0.28, "dual": 1.5, "norm_length": WIDTH},
        "gspo": gspo | {"clip": [0.03, 0.04]},
        "cispo": cispo | {"clip": [0.1, 0.15]},
        "kl": {k: ca.kl_penalty(x["new"], x["ref"], k).tolist() for k in ("kl", "mse", "low_var_kl")},
    }


def _trl_trainer(loss_type: str, level: str, eps: float, eps_high: float, delta: float | None):
    """The state ``GRPOTrainer._compute_loss`` reads, with the fixed logprobs as the model's output.

    Everything the method computes (ratios, clipping, aggregation) is TRL's own code; this object
    only answers its questions about the run: one process, no gradient accumulation, no KL, no
    vLLM correction, no entropy masking or bonus."""
    from collections import defaultdict
    from types import SimpleNamespace

    ident = lambda t, **_: t  # noqa: E731 (one process: gather and reduce return their input)
    return SimpleNamespace(
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_low=eps,
        epsilon_high=eps_high,
        beta=0.0,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        max_completion_length=WIDTH,
        current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(delta=delta, steps_per_generation=1, use_bias_correction_kl=False),
        accelerator=SimpleNamespace(
            num_processes=1, gather=ident, gather_for_metrics=ident, reduce=ident, sync_gradients=True
        ),
        _metrics=defaultdict(lambda: defaultdict(list)),
    )


def trl_fixture(x: dict) -> dict:
    from trl import GRPOTrainer
    from trl.trainer.utils import nanstd

    rewards, mask = x["rewards"], x["mask"]
    by_group = torch.stack([rewards[[i for i, g in enumerate(GROUPS) if g == k]] for k in (0, 1)])
    # TRL's grouped advantage (GRPOTrainer._generate_and_score_completions, "sum_then_normalize"):
    # rewards minus the group mean, divided by the group's nanstd (unbiased) + 1e-4, or not at all.
    mean = {k: float(by_group[k].mean()) for k in (0, 1)}
    std = {k: float(nanstd(by_group[k])) for k in (0, 1)}
    adv = {
        "groups": GROUPS,
        "eps": 1e-4,
        "group": [float((r - mean[g]) / (std[g] + 1e-4)) for r, g in zip(rewards, GROUPS, strict=True)],
        "none": [float(r - mean[g]) for r, g in zip(rewards, GROUPS, strict=True)],
    }

    def loss(
        loss_type: str, level: str = "token", eps: float = 0.2, eps_high: float = 0.28, delta=None
    ) -> dict:
        new = x["new"].clone().requires_grad_(True)
        trainer = _trl_trainer(loss_type, level, eps, eps_high, delta)
        trainer._get_per_token_logps_and_entropies = lambda *a, **k: (new, torch.zeros_like(new), None)
        inputs = {
            "prompt_ids": torch.zeros(ROWS, 1, dtype=torch.long),
            "prompt_mask": torch.ones(ROWS, 1, dtype=torch.long),
            "completion_ids": torch.zeros(ROWS, WIDTH, dtype=torch.long),
            "completion_mask": mask,
            "advantages": x["adv"][:, 0],
            "old_per_token_logps": x["old"],
            "num_items_in_batch": mask.sum(),
        }
        value = GRPOTrainer._compute_loss(trainer, None, inputs)
        value.backward()
        return {"loss": float(value.detach()), "grad": new.grad.tolist()}

    ppo = {
        kind: {
            "clip_high": loss(kind),
            "delta": loss(kind, delta=1.5),
        }
        for kind in ("grpo", "bnpo", "dr_grpo", "dapo")
    }
    return {
        "about": "TRL's GRPOTrainer on fixed float64 inputs: tools/reference_algorithms.sh regenerates it",
        "versions": {p: version(p) for p in ("trl", "torch", "numpy")},
        "inputs": _jsonable(x),
        "advantages": adv,
        "ppo": ppo,
        "ppo_clip": {"low": 0.2, "high": 0.28, "delta": 1.5, "max_completion_length": WIDTH},
        "gspo": loss("grpo", level="sequence", eps=0.03, eps_high=0.04) | {"clip": [0.03, 0.04]},
        "cispo": loss("cispo", eps_high=1.2) | {"cap": 1.2},
    }


def _jsonable(x: dict) -> dict:
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}


def main(library: str, out: Path) -> None:
    torch.manual_seed(0)
    x = _inputs(torch.Generator().manual_seed(20251201))
    fixture = {"verl": verl_fixture, "trl": trl_fixture}[library](x)
    out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("verl", "trl"):
        sys.exit("usage: reference_algorithms.py verl|trl OUT.json")
    main(sys.argv[1], Path(sys.argv[2]))
