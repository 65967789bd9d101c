"""The Megatron train backend (megatron-core; extra ``loong-train[megatron]``): :mod:`backend` (one
SPMD rank), :mod:`driver` (rank 0 driving spawned followers, what the trainer holds), :mod:`weights`
(Hugging Face <-> megatron-core shards), :mod:`cpu` (running megatron-core on CPU under gloo)."""
