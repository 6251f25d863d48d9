"""TorchFT's DDP example loop (torchft's train_ddp.py: a Manager, its Optimizer wrapper and
gloo), on a small model and synthetic data, for ductile's TorchFT lighthouse.

Each replica group is one process here. It asks the lighthouse named by TORCHFT_LIGHTHOUSE for
a quorum every step; a group that joins late heals from a live peer. Every committed step is
logged as one line, `--sha-out` gets the final weights' SHA-256.

By default the gradients are averaged with `manager.allreduce` and a step that fails is
dropped (torchft 0.2.0's DistributedDataParallel wrapper raises an AssertionError in the
survivors when a peer dies mid-all-reduce); `--ddp` uses that wrapper.

Without MASTER_ADDR/MASTER_PORT (a group started by hand, not by torchrun or ductile) the
process hosts its group's TCPStore itself.
"""

import argparse
import hashlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.http_transport import HTTPTransport

try:
    # under a ductile launcher: each commit feeds `dctl status`, the charts and stall detection
    import ductile
except ImportError:
    ductile = None


class AnnouncedHTTPTransport(HTTPTransport):
    """TorchFT's HTTP checkpoint transport (what a healing group fetches live state from),
    announced at `host` rather than at `socket.gethostname()`, which its peers may not resolve
    (a host without /etc/hosts or DNS for its own name): the group's store address, which its
    launcher already made reachable."""

    def __init__(self, host: str, timeout: timedelta) -> None:
        self._host = host  # before the server starts: it logs its address
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"http://{self._host}:{port}/checkpoint/"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--log", required=True, help="append one line per committed step ({group}: the group)"
    )
    p.add_argument("--sha-out", help="the final weights' SHA-256 ({group}: the group)")
    p.add_argument("--ddp", action="store_true", help="torchft's DistributedDataParallel")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument(
        "--device", default="cpu", help="cpu, or cuda (cuda:0 of what CUDA_VISIBLE_DEVICES shows)"
    )
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument(
        "--quorum-retries",
        type=int,
        default=0,
        help="the Manager's quorum_retries: a lighthouse call that broke (its replica died) is "
        "tried again, through `dctl torchft-relay` to another replica",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=5.0,
        help="the collectives' and the manager's timeout: a survivor blocked in an all-reduce "
        "with a peer that died waits this long before it drops the step",
    )
    a = p.parse_args()

    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    a.log = a.log.replace("{group}", str(group))
    if a.sha_out:
        a.sha_out = a.sha_out.replace("{group}", str(group))
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        own_store = None
    else:
        own_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store_addr, store_port, rank, world = "127.0.0.1", own_store.port, 0, 1

    torch.manual_seed(0)
    dev = torch.device(a.device)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(dev)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=a.timeout_s)),
        min_replica_size=a.min_replicas,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{group}",
        timeout=timedelta(seconds=a.timeout_s),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
        store_addr=store_addr,
        store_port=store_port,
        rank=rank,
        world_size=world,
        hostname=store_addr,
        quorum_retries=a.quorum_retries,
        checkpoint_transport=AnnouncedHTTPTransport(store_addr, timedelta(seconds=a.timeout_s)),
    )
    net = DistributedDataParallel(manager, model) if a.ddp else model
    opt = Optimizer(manager, inner)
    log = open(a.log, "a", buffering=1)
    last = manager.current_step()
    while manager.current_step() < a.steps:
        step = manager.current_step()
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 32, generator=g).to(dev)
        y = torch.randn(16, 8, generator=g).to(dev)
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        if not a.ddp:
            works = [manager.allreduce(q.grad) for q in model.parameters()]
            for w in works:
                w.wait()
        opt.step()
        now = manager.current_step()
        if now != last:
            log.write(
                f"{time.time():.6f} group={group} pid={os.getpid()} step={now} "
                f"quorum={manager._quorum_id} participants={manager.num_participants()} "
                f"healed={int(manager._healing)} loss={loss.item():.6f}\n"
            )
            last = now
            if ductile is not None:
                ductile.report(step=now, loss=loss.item(), samples=16 * manager.num_participants())
        if a.step_sleep:
            time.sleep(a.step_sleep)
    if a.sha_out:
        h = hashlib.sha256()
        for t in model.state_dict().values():
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        with open(a.sha_out, "w") as f:
            f.write(h.hexdigest() + "\n")
    manager.shutdown(wait=False)
    del own_store
    sys.exit(0)


if __name__ == "__main__":
    main()
