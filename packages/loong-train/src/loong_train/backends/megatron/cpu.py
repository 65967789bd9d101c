"""Run megatron-core on CPU (gloo) for tests: the few places where it assumes CUDA.

megatron-core 0.16 imports and initialises its parallel state on a CPU-only host, but some
code paths the Megatron backend uses reach for a GPU unconditionally. :func:`cpu_compat` is a
context manager that the backend enters around everything it asks of megatron-core (model
construction, forward/backward schedules); it does nothing when CUDA is available. Patches:

1. ``torch.cuda.current_device`` returns ``torch.device("cpu")`` while the context is active.
   Used as the ``device=`` of allocations in the global attention-score buffer
   (``parallel_state.GlobalMemoryBuffer``), tensor-parallel gathers (``tensor_parallel.mappings``)
   and the pipeline's receive buffers (``pipeline_parallel.p2p_communication``). Restored on exit.
2. A torch-function mode (:class:`_CudaToCpu`) maps an explicit ``device="cuda"`` of tensor
   factories to CPU and makes ``Tensor.cuda()`` the identity, while the context is active.
   Needed for the token counter the pipeline schedules allocate with ``device="cuda"``
   (``schedules.forward_backward_*``) and for ``weight.data.cuda()`` in
   ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings with PP > 1).
3. The model-parallel RNG tracker (``tensor_parallel.random``) keeps CUDA generator states and
   swaps them with ``torch.cuda.get_rng_state``/``set_rng_state``, which need a GPU; it is
   forked around every dropout (also at p = 0). :func:`cpu_compat` installs, once per process,
   a subclass that keeps CPU generator states instead, so ``model_parallel_cuda_manual_seed``
   and ``fork()`` work unchanged. This one stays installed (it is megatron-core's own global).

Everything else is avoided through configuration rather than patched: fused kernels off
(``masked_softmax_fusion``, ``bias_dropout_fusion``, ``bias_activation_fusion``,
``apply_rope_fusion``, ``gradient_accumulation_fusion``), ``use_cpu_initialization``,
``batch_p2p_sync = False`` (it calls ``torch.cuda.synchronize``), fixed sequence lengths in the
pipeline (variable ones exchange shapes and synchronise CUDA), and an explicit causal mask (the
default one is built with ``device="cuda"``). The optimizer is torch's AdamW on each rank's
shards rather than megatron-core's wrappers, whose gradient clipping asserts CUDA tensor types.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_compat"]


def _cpu_device() -> torch.device:
    return torch.device("cpu")


class _CudaToCpu(TorchFunctionMode):
    """Patch 2: ``device="cuda"`` in a call becomes CPU; ``Tensor.cuda()`` returns the tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _install_cpu_rng_tracker() -> None:
    """Patch 3: replace megatron-core's RNG tracker by one holding CPU generator states."""
    from megatron.core.tensor_parallel import random as mp_random

    if isinstance(mp_random._CUDA_RNG_STATE_TRACKER, _cpu_tracker_class()):
        return
    mp_random._CUDA_RNG_STATE_TRACKER = _cpu_tracker_class()()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


_TRACKER_CLASS: type | None = None


def _cpu_tracker_class() -> type:
    """Built lazily: megatron-core is imported only when the Megatron backend is used."""
    global _TRACKER_CLASS
    if _TRACKER_CLASS is None:
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

        class CpuRNGStatesTracker(CudaRNGStatesTracker):
            """Named RNG streams as CPU generator states; ``fork`` swaps the CPU default generator."""

            def add(self, name: str, seed: int) -> None:
                if seed in self.seeds_ or name in self.states_:
                    raise ValueError(f"rng stream {name!r} or seed {seed} already exists")
                self._is_initialized = True
                self.seeds_.add(seed)
                self.states_[name] = torch.Generator().manual_seed(seed).get_state()

            @contextlib.contextmanager
            def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
                outer = torch.get_rng_state()
                torch.set_rng_state(self.states_[name])
                try:
                    yield
                finally:
                    self.states_[name] = torch.get_rng_state()
                    torch.set_rng_state(outer)

        _TRACKER_CLASS = CpuRNGStatesTracker
    return _TRACKER_CLASS


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Patches 1-3 above while active; a no-op when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    _install_cpu_rng_tracker()
    saved = torch.cuda.current_device
    torch.cuda.current_device = _cpu_device
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device = saved
