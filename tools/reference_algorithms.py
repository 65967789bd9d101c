"""Reference values of verl's RL algorithms for fixed inputs, written as a JSON test fixture.

Runs inside a throwaway virtual environment holding verl (never a dependency of Loong); make one
and run this with ``tools/reference_algorithms.sh``. The fixture stores the inputs and verl's
outputs, so ``packages/loong-train/tests/test_reference_algorithms.py`` needs nothing but the JSON:

- advantages: GRPO (unbiased std, and without std: Dr. GRPO), RLOO, REINFORCE++ and
  REINFORCE++ with baseline, from outcome rewards of groups (every group of at least two);
- policy losses: PPO with an asymmetric clip, with and without the dual clip, in every
  aggregation mode; GSPO; CISPO; each loss and its gradient with respect to the current logprobs;
- KL estimators: k1, k2, k3 (verl's ``kl``, ``mse``, ``low_var_kl``).

Inputs are float64 from a seeded generator; lengths vary per row so length-weighting shows.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from verl.trainer.ppo import core_algos as ca
from verl.workers.config.actor import ActorConfig

ROWS, WIDTH = 8, 7
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _inputs(gen: torch.Generator) -> dict:
    lengths = [7, 3, 5, 1, 6, 2, 4, 7]
    mask = torch.zeros(ROWS, WIDTH, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    old = -torch.rand(ROWS, WIDTH, generator=gen, dtype=torch.float64) * 3
    new = old + (torch.rand(ROWS, WIDTH, generator=gen, dtype=torch.float64) - 0.5) * 0.8  # ratios 0.67..1.5
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


def _advantages(x: dict) -> dict:
    mask, rewards = x["mask"], x["rewards"]
    groups = [0, 0, 0, 1, 1, 1, 1, 2]
    groups[-1] = 0  # every group has at least two episodes (verl gives a lone episode A = its reward)
    index = np.array([str(g) for g in groups], dtype=object)
    scores = torch.zeros_like(mask)
    for i, n in enumerate(x["lengths"]):
        scores[i, n - 1] = rewards[i]  # an outcome reward sits on the last response token
    first = lambda a: a[:, 0].tolist()  # noqa: E731 (every token of a row carries its A)
    out = {"groups": groups}
    out["grpo_unbiased"] = first(ca.compute_grpo_outcome_advantage(scores, mask, index, 1e-6, True)[0])
    out["grpo_no_std"] = first(ca.compute_grpo_outcome_advantage(scores, mask, index, 1e-6, False)[0])
    out["rloo"] = first(ca.compute_rloo_outcome_advantage(scores, mask, index, 1e-6)[0])

    class Gamma:  # REINFORCE++ reads config.gamma
        gamma = 1.0

    rpp = ca.compute_reinforce_plus_plus_outcome_advantage(scores, mask, config=Gamma())[0]
    out["reinforce++_tokens"] = rpp.tolist()
    base = ca.compute_reinforce_plus_plus_baseline_outcome_advantage(scores, mask, index, 1e-6)[0]
    out["reinforce++-baseline_tokens"] = base.tolist()
    return out


def _loss(fn, x: dict, agg: str, **clip) -> dict:
    config = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_torch_compile=False, **clip
    )
    new = x["new"].clone().requires_grad_(True)
    loss, metrics = fn(x["old"], new, x["adv"], x["mask"], loss_agg_mode=agg, config=config)
    loss.backward()
    return {"loss": float(loss.detach()), "grad": new.grad.tolist(), "clipfrac": metrics["actor/pg_clipfrac"]}


def main(out: Path) -> None:
    torch.manual_seed(0)
    x = _inputs(torch.Generator().manual_seed(20251201))
    ppo = {}
    for agg in AGG_MODES:
        ppo[agg] = {
            "clip_high": _loss(ca.compute_policy_loss_vanilla, x, agg, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1e9),
            "dual_clip": _loss(ca.compute_policy_loss_vanilla, x, agg, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.5),
        }  # fmt: skip
    gspo = _loss(
        ca.compute_policy_loss_gspo, x, "seq-mean-token-mean", clip_ratio_low=0.03, clip_ratio_high=0.04
    )
    cispo = _loss(ca.compute_policy_loss_cispo, x, "token-mean", clip_ratio_low=0.1, clip_ratio_high=0.15)
    kl = {k: ca.kl_penalty(x["new"], x["ref"], k).tolist() for k in ("kl", "mse", "low_var_kl")}
    fixture = {
        "about": "verl's algorithms on fixed float64 inputs: tools/reference_algorithms.sh regenerates it",
        "versions": {p: version(p) for p in ("verl", "torch", "numpy")},
        "inputs": {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in x.items()},
        "advantages": _advantages(x),
        "ppo": ppo,
        "ppo_clip": {"low": 0.2, "high": 0.28, "dual": 1.5, "norm_length": WIDTH},
        "gspo": gspo | {"clip": [0.03, 0.04]},
        "cispo": cispo | {"clip": [0.1, 0.15]},
        "kl": kl,
    }
    out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
