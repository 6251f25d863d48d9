"""A data-parallel training script written the way PyTorch's DDP tutorials write them
(init_process_group from the environment, DistributedSampler, DistributedDataParallel,
torch.save checkpoints by rank 0), runnable under `torchrun` and as a ductile
`runtime = "torchrun"` job alike. It uses the `ductile` module when it is installed (progress,
planned drains); without it, it runs the same.

    torchrun --nproc-per-node=4 ddp_train.py --steps 200 --ckpt-dir /tmp/ckpt
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:
    import ductile
except ImportError:  # not installed: run as a plain torchrun script
    ductile = None


def dataset(n, dim, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def weights_sha256(model):
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def save(path, model, opt, step):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--samples", type=int, default=4800)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--step-log", default=None, help="rank 0 appends 'time pid world step loss' per step")
    p.add_argument("--sha-out", default=None, help="rank 0 writes the final weights' sha256 here")
    p.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (cuda:LOCAL_RANK)")
    p.add_argument("--env-out", default=None, help="rank 0 writes its environment's names here (JSON)")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-at-step", type=int, default=-1)
    args = p.parse_args()

    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and args.env_out:
        with open(args.env_out, "w") as f:
            json.dump(sorted(os.environ), f)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ckpt_dir = args.ckpt_dir
    if ckpt_dir is None and ductile is not None and (ductile.checkpoint_url() or "").startswith("file://"):
        ckpt_dir = ductile.checkpoint_url()[len("file://"):]
    path = os.path.join(ckpt_dir, "checkpoint.pt") if ckpt_dir else None
    step = 0
    if path and os.path.exists(path):
        state = torch.load(path, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        if rank == 0:
            print(f"resumed from step {step} at world size {world}", flush=True)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    ds = dataset(args.samples, args.dim, seed=1)
    per_rank = args.global_batch // world
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    per_epoch = len(sampler) // per_rank
    loss_fn = nn.MSELoss()

    def batches(epoch, skip):
        sampler.set_epoch(epoch)
        it = iter(DataLoader(ds, batch_size=per_rank, sampler=sampler, drop_last=True))
        for _ in range(skip):
            next(it)
        return it

    epoch, it = step // per_epoch, batches(step // per_epoch, step % per_epoch)
    while step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            it = batches(epoch, 0)
            continue
        if rank == args.fail_rank and step == args.fail_at_step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            raise ValueError(f"injected failure on rank {rank} at step {step}")
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        step += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if ductile is not None:
            ductile.report(step=step, loss=loss.item(), samples=per_rank * world)
        if rank == 0 and args.step_log:
            with open(args.step_log, "a") as f:
                f.write(f"{time.time():.6f} {os.getpid()} {world} {step} {loss.item():.6f}\n")
        preempted = ductile is not None and ductile.preempted()
        if path and rank == 0 and (step % args.ckpt_every == 0 or preempted or step == args.steps):
            save(path, model, opt, step)
            if preempted and hasattr(ductile, "saved"):
                # the change of the world need not wait out its notice
                ductile.saved(step)
    if rank == 0:
        sha = weights_sha256(model)
        print(f"done: step {step}, world {world}, weights sha256 {sha}", flush=True)
        if args.sha_out:
            with open(args.sha_out, "w") as f:
                f.write(sha + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
