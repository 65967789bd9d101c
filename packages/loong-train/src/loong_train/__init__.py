"""Loong Train: the single controller, rollout and train workers, engines, algorithms, recipes.

Heavy modules (torch, ray) load only when used: ``import loong_train`` is cheap.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
