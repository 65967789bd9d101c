"""The Ray actors' classes: :mod:`rollout` (an engine plus the task's agents), :mod:`trainer` (a train
backend plus the weight sender) and :mod:`agent` (the black-box agent host and the ``[agent]`` table)."""
