"""The RL math: :mod:`losses` (GRPO advantages, the clipped policy loss and its train-inference
corrections, batch packing), :mod:`opd` (on-policy distillation advantages from teachers) and
:mod:`config` (their ``[loss]`` and ``[opd]`` tables)."""
