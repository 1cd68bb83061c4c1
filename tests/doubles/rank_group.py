"""Run a function as N rank processes and collect what each reports (tests of rank groups).

``RankGroup(target, world_size, *args)`` starts ``target(rank, world_size, report, *args)`` in one
process per rank (fork by default: fast, and the tiny models built in the test are inherited).
``report(dict)`` sends a msgpack message to the parent. An exception in ``target`` is reported as
``{"error": str, "error_type": name, "blamed_rank": exc.rank or None}`` and exits with code 1.
``make_communicator`` builds a connected communicator of any kind inside a rank process.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import signal
import socket
import time
import traceback

import msgpack


class RankGroup:
    def __init__(self, target, world_size: int, *args, method: str = "fork") -> None:
        ctx = multiprocessing.get_context(method)
        self.world_size = world_size
        self.messages: list[list[dict]] = [[] for _ in range(world_size)]
        self._pipes, self.procs = [], []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child_main, args=(target, rank, world_size, child_end, args), daemon=True)
            proc.start()
            child_end.close()
            self._pipes.append(parent_end)
            self.procs.append(proc)

    def _drain(self, rank: int, timeout_s: float = 0.0) -> bool:
        pipe = self._pipes[rank]
        got = False
        try:
            while pipe.poll(timeout_s):
                self.messages[rank].append(msgpack.unpackb(pipe.recv_bytes(), raw=False))
                got, timeout_s = True, 0.0
        except (EOFError, OSError):
            pass
        return got

    def wait_for(self, rank: int, key: str, timeout_s: float = 60.0) -> dict:
        """The first message from ``rank`` holding ``key`` (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for msg in self.messages[rank]:
                if key in msg:
                    return msg
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} sent no {key!r} in {timeout_s} s: {self.messages[rank]}")
            if not self._drain(rank, 0.05) and not self.procs[rank].is_alive():
                self._drain(rank)
                if not any(key in m for m in self.messages[rank]):
                    raise RuntimeError(f"rank {rank} exited ({self.procs[rank].exitcode}) without {key!r}: "
                                       f"{self.messages[rank]}")

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)

    def join(self, timeout_s: float = 60.0) -> list[int]:
        """Exit codes by rank; ranks still running after ``timeout_s`` are killed and reported hung."""
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(self.procs):
            while proc.is_alive() and time.monotonic() < deadline:
                self._drain(rank, 0.05)
                proc.join(0.01)
        hung = [rank for rank, proc in enumerate(self.procs) if proc.is_alive()]
        for rank in hung:
            self.kill(rank)
            self.procs[rank].join()
        for rank in range(self.world_size):
            self._drain(rank)
        if hung:
            raise TimeoutError(f"ranks {hung} still ran after {timeout_s} s: {self.messages}")
        return [proc.exitcode for proc in self.procs]


def _child_main(target, rank: int, world_size: int, pipe, args) -> None:
    def report(msg: dict) -> None:
        pipe.send_bytes(msgpack.packb(msg, use_bin_type=True))

    import torch

    torch.set_num_threads(1)
    try:
        target(rank, world_size, report, *args)
    except BaseException as exc:  # reported to the parent, which asserts on it
        report({"error": str(exc), "error_type": type(exc).__name__,
                "blamed_rank": getattr(exc, "rank", None), "traceback": traceback.format_exc()})
        pipe.close()
        os._exit(1)
    pipe.close()
    os._exit(0)  # skip the inherited pytest atexit hooks


def new_group_id() -> str:
    return secrets.token_hex(6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_segments(group_id: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"psv-{group_id}-"))


def make_communicator(kind: str, rank: int, world_size: int, spec: dict):
    """A connected communicator of ``kind`` (shm, cuda_ipc or torch) through ``open_group``.

    ``spec``: group_id and store_path (shm, cuda_ipc), port (torch); optional device, slot_bytes,
    timeout_s.
    """
    from services.executor.parallel.group import GroupConfig, open_group

    config = GroupConfig(rank, world_size, "torch" if kind == "torch" else "shm", group_id=spec.get("group_id"),
                         store_path=spec.get("store_path"), timeout_s=spec.get("timeout_s", 60.0),
                         dist_init_addr=f"127.0.0.1:{spec['port']}" if "port" in spec else None,
                         slot_bytes=spec.get("slot_bytes"))
    return open_group(config, spec.get("device", "cpu"))


def rank_input(rank: int, numel: int, dtype, seed: int):
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1000 + rank)).to(dtype)


_RTOL = {"float32": 1e-6, "bfloat16": 2**-7, "float16": 2**-10}


def sums_worker(rank: int, world_size: int, report, kind: str, spec: dict, cases, seed: int = 0) -> None:
    """For each (numel, dtype name): all_reduce and all_reduce_ against the sum over ranks."""
    import hashlib

    import torch

    comm = make_communicator(kind, rank, world_size, spec)
    device = torch.device(spec.get("device", "cpu"))
    for numel, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        inputs = [rank_input(r, numel, dtype, seed) for r in range(world_size)]
        mine = inputs[rank].to(device)
        got = comm.all_reduce(mine).cpu()
        in_place = mine.clone()
        returned = comm.all_reduce_(in_place)
        ordered = inputs[0].to(torch.float32, copy=True)
        for x in inputs[1:]:
            ordered += x.float()  # rank order, in float32: what the shared-memory sum does
        reference = torch.stack([x.float() for x in inputs]).sum(0)  # torch.sum over ranks
        report({"numel": numel, "dtype": dtype_name, "shape_ok": got.shape == mine.shape and got.dtype == dtype,
                "input_unchanged": torch.equal(mine.cpu(), inputs[rank]),
                "in_place_ok": returned is in_place and torch.equal(in_place.cpu(), got),
                "exact_rank_order": torch.equal(got, ordered.to(dtype)),
                "close": torch.allclose(got.float(), reference, rtol=_RTOL[dtype_name], atol=1e-5),
                "max_err": (got.float() - reference).abs().max().item(),
                "digest": hashlib.sha1(got.view(torch.uint8).numpy().tobytes()).hexdigest()})
    dst = world_size - 1
    part = (torch.arange(15, dtype=torch.float32).view(3, 5) + 100 * rank).to(device)
    gathered = comm.gather(part, dst=dst)
    expected = [torch.arange(15, dtype=torch.float32).view(3, 5) + 100 * r for r in range(world_size)]
    ok = gathered is None if rank != dst else all(torch.equal(g.cpu(), e) for g, e in zip(gathered, expected))
    comm.barrier()
    report({"gather_ok": bool(ok)})
    comm.close()


def check_sums(group: RankGroup, cases, exact: bool = True, timeout_s: float = 120) -> None:
    """Assert what ``sums_worker`` reported: sums close to torch.sum (``exact``: the rank-order
    float32 sum, bit for bit), in place and returning, gather, and the same bits on every rank."""
    assert group.join(timeout_s) == [0] * group.world_size, group.messages
    for rank, messages in enumerate(group.messages):
        results = [m for m in messages if "numel" in m]
        assert [(m["numel"], m["dtype"]) for m in results] == [tuple(c) for c in cases]
        for m in results:
            what = f"rank {rank}, {m['numel']} x {m['dtype']}"
            assert m["shape_ok"] and m["input_unchanged"] and m["in_place_ok"], what
            assert m["close"], f"{what}: max error {m['max_err']} against torch.sum"
            if exact:
                assert m["exact_rank_order"], f"{what}: not the float32 rank-order sum"
        assert any(m.get("gather_ok") for m in messages), f"rank {rank}: gather"
    for i in range(len(cases)):  # every rank holds the same bits
        assert len({[m for m in msgs if "numel" in m][i]["digest"] for msgs in group.messages}) == 1
