"""Train backends: ``torch`` (CPU or one GPU) and ``megatron`` (megatron-core, TP/PP/DP; extra ``[megatron]``)."""
