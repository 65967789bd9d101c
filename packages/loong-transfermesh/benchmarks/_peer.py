"""A benchmark peer process: holds its own copy of the model's tensors and receives updates.

Driven over stdin/stdout by ``bench_transfer.py``: it prints ``ready`` once set up, then for each
line ``go VERSION`` it receives that version into its tensors and prints ``done VERSION``.

    python _peer.py SPEC.json CASE [ARG ...]

Cases: ``shm NAME MODE``, ``tcp ADDRESS``, ``gloo_flat|gloo_per_tensor RANK WORLD PORT``.
For gloo, rank 0 is the sender: on ``go`` it broadcasts its tensors instead of receiving.
"""

from __future__ import annotations

import json
import sys

import torch

torch.set_num_threads(1)


def tensors(spec_path: str, fill: float) -> dict[str, torch.Tensor]:
    with open(spec_path) as f:
        spec = json.load(f)
    return {name: torch.full(shape, fill, dtype=getattr(torch, dtype)) for name, shape, dtype in spec}


def receiver(case: str, args: list[str], targets: dict[str, torch.Tensor]):
    if case == "shm":
        from loong_transfermesh import ShmReceiver

        r = ShmReceiver(args[0], mode=args[1])
        params = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in targets.items()}
        return lambda version: r.apply(params, version=version)
    if case == "tcp":
        from loong_transfermesh import TcpReceiver

        r = TcpReceiver(args[0], mode=args[1])
        targets = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in targets.items()}
        return lambda version: r.apply(targets, version=version)
    import torch.distributed as dist

    rank, world, port = int(args[0]), int(args[1]), int(args[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if case == "gloo_flat":
        total = sum(t.numel() * t.element_size() for t in targets.values())
        flat = torch.zeros(total, dtype=torch.uint8)  # touched once, reused
        return lambda version: dist.broadcast(flat, src=0)

    def per_tensor(version: int) -> None:
        for t in targets.values():
            dist.broadcast(t, src=0)

    return per_tensor


def main() -> None:
    spec_path, case, *args = sys.argv[1:]
    targets = tensors(spec_path, fill=0.0)
    step = receiver(case, args, targets)
    print("ready", flush=True)
    for line in sys.stdin:
        version = int(line.split()[1])
        step(version)
        print(f"done {version}", flush=True)


if __name__ == "__main__":
    main()
