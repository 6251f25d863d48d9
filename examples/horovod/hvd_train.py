"""A PyTorch training script written as Horovod's examples write one: `hvd.init()`,
`hvd.DistributedOptimizer`, `hvd.broadcast_parameters`, rank 0 saving a checkpoint every few
steps and every rank loading it at start. Run it under `horovodrun --gloo -np 2 python
hvd_train.py ...`, or as a ductile `runtime = "horovod"` job (ductile gives each generation's
workers what horovodrun's gloo launcher gives them, and restarts the world on a change).

A small regression network on seeded synthetic batches: every step's global batch is the same
at any world size (each rank takes its share by `hvd.rank()`/`hvd.size()`), so a run that
changes size trains on the same samples step by step. With `ductile` importable it reports each
step (`ductile.report`), and saves on a planned change's notice (`ductile.preempted()`, agreed
by all ranks with one `hvd.allreduce`) at once and then at every step until the world is
replaced; outside ductile those are no-ops.

    horovodrun --gloo -np 2 python hvd_train.py --ckpt-dir /tmp/hvd --steps 200
"""

import argparse
import hashlib
import os
import time

import horovod.torch as hvd
import torch

try:
    import ductile
except ImportError:  # outside ductile: no reports, no notices
    ductile = None


def batch(step, global_batch, rank, size):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, 16, generator=g)
    y = x.sum(dim=1, keepdim=True) * 0.5 + 0.1 * torch.randn(global_batch, 1, generator=g)
    share = global_batch // size
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--step-log", default=None)
    a = p.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if a.global_batch % size:
        raise ValueError(f"--global-batch {a.global_batch} does not split over {size} ranks")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(a.ckpt_dir, "ckpt.pt")
    start = 0
    if os.path.exists(path):
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from step {start} at world size {size}", flush=True)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

    def save(step):
        if rank == 0:
            tmp = path + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, path)

    noticed = False
    for step in range(start, a.steps):
        x, y = batch(step, a.global_batch, rank, size)
        opt.zero_grad()
        # the mean over the global batch: each rank's share of it, summed by the optimizer's
        # all-reduce (Horovod averages: scale back by the size)
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") / a.global_batch * size
        loss.backward()
        opt.step()
        done = step + 1
        if rank == 0:
            if ductile:
                ductile.report(done, loss=loss.item() / size, samples=a.global_batch)
            if a.step_log:
                with open(a.step_log, "a") as f:
                    f.write(f"{time.time()} {os.getpid()} {size} {done}\n")
        # once noticed, every step is saved until the world is replaced (SIGTERM)
        if done % a.ckpt_every == 0 or done == a.steps or noticed:
            save(done)
        elif ductile and not noticed:
            flag = torch.tensor([1.0 if ductile.preempted() else 0.0])
            if hvd.allreduce(flag, op=hvd.Sum).item() > 0:
                noticed = True
                save(done)
                if rank == 0:
                    ductile.saved(done)
        if a.step_sleep:
            time.sleep(a.step_sleep)
    if rank == 0:
        digest = hashlib.sha256()
        for v in model.state_dict().values():
            digest.update(v.detach().numpy().tobytes())
        print(f"done: step {a.steps}, world {size}, sha256 {digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
