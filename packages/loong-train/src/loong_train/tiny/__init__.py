"""The tiny world of the shipped CPU recipes, one implementation behind Loong's seams.

- :mod:`calc`, :mod:`calc_domains`: the calculator tasks (:class:`~loong_train.tasks.Task`s);
- :mod:`calc_agent`: the calc task's black-box agent, an ``openai``-SDK program;
- :mod:`tokenizer`: a character-level tokenizer with a ChatML chat template, built locally;
- :mod:`warmstart`: a random-init tiny Qwen3 built from the recipe's sizes, warm-started on the
  task's demonstrations until its sampled success reaches a target (cached);
- :mod:`teachers`: the tiny OPD recipe's domain teachers, made with the same warm start (cached).

Nothing outside this package imports the calc tasks: recipes name them (``task = "calc"``).
"""
