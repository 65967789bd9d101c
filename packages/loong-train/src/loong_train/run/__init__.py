"""What a run leaves on disk: :mod:`writer` (metrics, ledger, trace, summary; a passive writer of what
the controller hands it), :mod:`checkpoint` (resumable state collected from each owner),
:mod:`plots` and :mod:`loggers` (TensorBoard, Weights & Biases)."""
