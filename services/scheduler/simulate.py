"""``pagedserve simulate``: replay a request stream through the scheduler and block manager alone.

No model: every scheduled sequence gets one token per step, and a request stops (EOS) once it has
produced its answer length. The same stream runs under ``--kv-policy paged`` and ``contiguous``
(each request reserving ``--max-model-len`` slots, as the paper's memory simulator does), and the
command prints steps to finish, mean slot utilization, peak concurrency and preemptions. With
``--html PATH`` it also writes a page that replays both runs step by step (``services.replay_page``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from shared.messages import AddRequest, SamplingParams, Step, StepResult

from .block_manager import BlockManager
from .contiguous import ContiguousBlockManager
from .scheduler import Scheduler, SchedulerConfig

EOS, FILLER = 0, 1
# Ten illustrative (prompt, answer) lengths: 342 tokens in all, more than the 256 slots.
DEFAULT_REQUESTS = "10:22,6:30,14:12,8:40,12:18,5:26,16:20,9:34,7:14,11:28"


def parse_requests(text: str) -> list[tuple[int, int]]:
    """``"10:22,6:30"`` -> ``[(10, 22), (6, 30)]`` (prompt tokens, answer tokens)."""
    pairs = []
    for item in text.split(","):
        try:
            prompt, answer = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"--requests: {item!r} is not PROMPT:ANSWER") from None
        if prompt <= 0 or answer <= 0:
            raise ValueError(f"--requests: {item!r} needs positive lengths")
        pairs.append((prompt, answer))
    return pairs


def simulate(requests: list[tuple[int, int]], num_slots: int, block_size: int, max_model_len: int,
             kv_policy: str, max_steps: int = 100_000,
             observe: Callable[[Scheduler], None] | None = None) -> dict[str, float]:
    """Run the stream to completion; returns steps, mean utilization, peak running, preemptions.
    ``observe(scheduler)`` is called once the requests are queued and after every step."""
    if num_slots % block_size:
        raise ValueError(f"--num-slots {num_slots} is not a multiple of --block-size {block_size}")
    manager = ContiguousBlockManager if kv_policy == "contiguous" else BlockManager
    blocks = manager(num_slots // block_size, block_size, watermark=0.0, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=len(requests), max_num_batched_tokens=max_model_len * len(requests),
                                      max_model_len=max_model_len, kv_policy=kv_policy), blocks)
    answer_len = {}
    for i, (prompt, answer) in enumerate(requests):
        if prompt + answer > max_model_len:
            raise ValueError(f"request {i}: {prompt} + {answer} tokens exceed --max-model-len {max_model_len}")
        rid = f"r{i}"
        answer_len[rid] = answer
        params = SamplingParams(temperature=0.0, max_tokens=max_model_len - prompt, eos_token_ids=[EOS])
        sched.add_request(AddRequest(rid, np.full(prompt, FILLER, np.int32), params, float(i)))
        errors = sched.take_outputs()
        if errors:
            raise ValueError(errors[0].error)
    steps = 0
    if observe is not None:
        observe(sched)
    while sched.has_work():
        step = sched.schedule()
        if step is None:
            raise RuntimeError("the stream cannot make progress in this pool")
        sched.update(_one_token_each(sched, step, answer_len))
        sched.take_outputs()  # the answers themselves do not matter here
        blocks.check_integrity()
        if observe is not None:
            observe(sched)
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"no finish after {max_steps} steps")
    return {
        "steps": steps,
        "mean_utilization": sched.stats.mean_utilization,
        "max_running": sched.stats.max_num_running,
        "preemptions": sched.stats.num_preemptions,
    }


def _one_token_each(sched: Scheduler, step: Step, answer_len: dict[str, int]) -> StepResult:
    seq_ids = step.seq_ids[step.sample_mask]
    by_id = {s.seq_id: s for group in sched.groups.values() for s in group.seqs}
    tokens = [EOS if len(by_id[int(i)].output_token_ids) + 1 >= answer_len[by_id[int(i)].request_id] else FILLER
              for i in seq_ids]
    return StepResult(step.step_id, seq_ids, np.array(tokens, np.int64))


def worked_example(prompt: int = 100, answer: int = 200, reservation: int = 2048, page: int = 16) -> str:
    """The seed's arithmetic: one request under a max-length reservation versus 16-token pages."""
    used = prompt + answer
    pages = -(-used // page)
    return (
        f"worked example: a {prompt}-token prompt with a {answer}-token answer uses {used} slots.\n"
        f"  reserved {reservation}: {reservation - used} slots wasted "
        f"({(reservation - used) / reservation:.0%} of the reservation)\n"
        f"  {page}-token pages on demand: {pages} pages ({pages * page} slots), "
        f"{pages * page - used} slots wasted"
    )


def run_simulate(args) -> int:
    requests = parse_requests(args.requests)
    print(f"{len(requests)} requests (prompt:answer) {args.requests}")
    print(f"pool: {args.num_slots} slots; paged: {args.block_size}-slot blocks on demand; "
          f"contiguous: a {args.max_model_len}-slot reservation per request\n")
    results = {p: simulate(requests, args.num_slots, args.block_size, args.max_model_len, p)
               for p in ("contiguous", "paged")}
    print(f"{'policy':12}{'steps':>8}{'mean utilization':>19}{'max running':>14}{'preemptions':>14}")
    for policy, r in results.items():
        print(f"{policy:12}{r['steps']:>8}{r['mean_utilization']:>19.1%}{r['max_running']:>14}{r['preemptions']:>14}")
    c, p = results["contiguous"], results["paged"]
    print(f"\npaged / contiguous: {c['steps'] / p['steps']:.2f}x fewer steps, "
          f"{p['mean_utilization'] / c['mean_utilization']:.2f}x utilization, "
          f"{p['max_running'] / c['max_running']:.2f}x sequences in flight\n")
    print(worked_example())
    return 0


def add_simulate_arguments(parser) -> None:
    parser.add_argument("--requests", default=DEFAULT_REQUESTS, help="PROMPT:ANSWER lengths, comma-separated")
    parser.add_argument("--num-slots", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=64, help="the contiguous reservation")
    parser.add_argument("--html", default=None, metavar="PATH",
                        help="also write a self-contained page replaying both runs step by step")
