"""The Megatron train backend (megatron-core; extra ``loong-train[megatron]``): :mod:`backend` (one
SPMD rank), :mod:`model` (the megatron-core model of a Hugging Face config, and which configs it
covers), :mod:`batch` (a TrainBatch as padded tensors), :mod:`driver` (rank 0 driving spawned
followers, what the trainer holds; each rank's parallel state), :mod:`weights` (Hugging Face <->
megatron-core shards), :mod:`cpu` (running megatron-core on CPU under gloo)."""
