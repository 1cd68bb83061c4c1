"""Threads per step, chosen by timing: one thread, all of them or a power of two between, per
size of step.

A small step's matmuls are short and bound by memory; waking a second OpenMP thread for each of
them (where it sleeps between regions, ``shared/cpu_threads.py``) can cost more than it saves, and how much
depends on the machine and on what else runs on it. Measured with ``python -m loadtest.profile
--batches 1,4,8,16,32 --prefill 0 --num-threads T`` (SmolLM2, bf16, 2-core AMD EPYC Zen 5), ms per
decode step, 1 thread against 2: quiet, batch 1 14.2 / 15.8, batch 8 about 3 ms less on one
thread, batch 16 and up more on one; next to another process's tests (load average 2.5), one
thread was faster at every batch up to 32 (26.6 / 29.6 at 16, 40.8 / 46.3 at 32). No constant is
right everywhere, so the executor measures instead.

``ThreadTuner`` is the policy (no I/O, no clock: it is told each step's time). Steps are grouped by
their token count into powers of two (1, 2-3, 4-7, ...) up to ``max_tokens``; larger steps always
run on every thread (trying one thread on a long prefill chunk would cost too much). In each group
it first runs every candidate ``min_samples`` times in turn, the default (all threads) first, then the one with the lowest moving
average of its step times, and the other candidate every ``explore_every``-th step of the group
(every 4 x ``explore_every``-th while it is more than ``far_behind`` times slower), so that a
change of load (a neighbour starting or stopping) changes the choice.

Results do not depend on the choice where the tuner is used (``tuned_execute``'s caller enables
it): oneDNN's packed matmuls give the same bits on one or two threads (``tests/executor/test_thread_tuner.py``
checks SmolLM2's shapes in both dtypes), the Numba kernels split work by rows and size their
attention partitions by the process's thread count (``partition_threads``), not the step's.
``F.linear`` in float32 (the exactness mode) does not: its 7-row products differed between one
and two threads, so there the count stays fixed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class _Arm:
    samples: int = 0
    mean_ms: float = 0.0


@dataclass
class _Group:
    arms: dict[int, _Arm]
    steps: int = 0


@dataclass
class ThreadTuner:
    """Chooses a thread count per step from ``candidates`` (ascending; the last is the default)."""

    candidates: tuple[int, ...]
    max_tokens: int = 128  # steps with more tokens always use the largest candidate
    min_samples: int = 3  # steps each candidate runs in a group before the choice is by time
    explore_every: int = 16  # every n-th step of a group runs a candidate other than the best
    smoothing: float = 0.2  # weight of a new step time in a candidate's moving average
    far_behind: float = 1.25  # a runner-up this much slower than the best is explored 4x less often
    _groups: dict[int, _Group] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.candidates or list(self.candidates) != sorted(set(self.candidates)) or self.candidates[0] < 1:
            raise ValueError(f"thread candidates must be distinct, ascending and >= 1, got {self.candidates}")

    @staticmethod
    def group_of(num_tokens: int) -> int:
        """Steps of 1, 2-3, 4-7, 8-15, ... tokens share a group."""
        return max(1, num_tokens).bit_length()

    @classmethod
    def min_tokens_of(cls, num_tokens: int) -> int:
        """The smallest token count of ``num_tokens``'s group (what ``best`` is keyed by)."""
        return 1 << (cls.group_of(num_tokens) - 1)

    def choose(self, num_tokens: int) -> int:
        if num_tokens > self.max_tokens or len(self.candidates) == 1:
            return self.candidates[-1]
        group = self._groups.setdefault(self.group_of(num_tokens),
                                        _Group({c: _Arm() for c in self.candidates}))
        group.steps += 1
        untried = [c for c, arm in group.arms.items() if arm.samples < self.min_samples]
        if untried:  # the least-sampled first, so the candidates alternate while they learn;
            # among equals the largest: a group's first step (often a fresh request's prefill,
            # whose time is its time to first token) runs on the default count
            return min(reversed(untried), key=lambda c: group.arms[c].samples)
        ranked = sorted(group.arms, key=lambda c: group.arms[c].mean_ms)
        every = self.explore_every
        if group.arms[ranked[1]].mean_ms > self.far_behind * group.arms[ranked[0]].mean_ms:
            every *= 4  # a clear loser is checked less often: each check costs its whole gap
        if group.steps % every == 0:
            return ranked[1 + (group.steps // every) % (len(ranked) - 1)]
        return ranked[0]

    def observe(self, num_tokens: int, threads: int, elapsed_ms: float) -> None:
        """The step of ``num_tokens`` tokens ran on ``threads`` threads in ``elapsed_ms``."""
        group = self._groups.get(self.group_of(num_tokens))
        if num_tokens > self.max_tokens or group is None or threads not in group.arms:
            return
        arm = group.arms[threads]
        arm.mean_ms = elapsed_ms if arm.samples == 0 else (
            (1 - self.smoothing) * arm.mean_ms + self.smoothing * elapsed_ms)
        arm.samples += 1

    def best(self) -> dict[int, int]:
        """Per group (its smallest token count), the candidate a step would get now outside
        exploration; only groups whose candidates all ran ``min_samples`` times."""
        out = {}
        for key, group in sorted(self._groups.items()):
            if (choice := self._learned_choice(group)) is not None:
                out[1 << (key - 1)] = choice
        return out

    def best_for(self, num_tokens: int) -> int | None:
        """``best()`` of the group of ``num_tokens`` alone (the only one a step of that size can
        change); None while that group is still learning, or for a step larger than ``max_tokens``."""
        group = self._groups.get(self.group_of(num_tokens))
        return None if num_tokens > self.max_tokens or group is None else self._learned_choice(group)

    def _learned_choice(self, group: _Group) -> int | None:
        if any(arm.samples < self.min_samples for arm in group.arms.values()):
            return None
        return min(group.arms, key=lambda c: group.arms[c].mean_ms)


def tuned_execute(tuner: ThreadTuner, execute, step, num_tokens: int, set_threads):
    """``execute(step)`` on the thread count ``tuner`` chooses (given to ``set_threads`` first),
    timing it for the tuner; returns what ``execute`` returns."""
    threads = tuner.choose(num_tokens)
    set_threads(threads)
    start = time.perf_counter()
    result = execute(step)
    tuner.observe(num_tokens, threads, (time.perf_counter() - start) * 1e3)
    return result


def thread_tuner_for(runner, num_threads: int, world_size: int, enabled: bool = True
                     ) -> tuple[ThreadTuner | None, str]:
    """The tuner for this executor, or None, and why (for the log): only on one rank (the ranks of
    a group wait for each other, so one rank's time says little about its own threads), with more
    than one thread, and where the matmuls are oneDNN's or the Numba kernel's (their results do not
    depend on the thread count). Fixes the attention kernels' partitions to ``num_threads`` either way."""
    from .linear import linear_kernel_name

    backend = getattr(runner, "backend", None)
    if hasattr(backend, "partition_threads"):
        backend.partition_threads = num_threads
    if not enabled:
        return None, "--no-adaptive-threads"
    if num_threads <= 1 or world_size > 1:
        return None, f"{num_threads} thread(s), {world_size} rank(s): nothing to choose"
    if linear_kernel_name(runner.model) not in ("onednn", "numba"):
        return None, "matmuls on F.linear, whose results depend on the thread count"
    candidates = thread_ladder(num_threads)
    small_rows = hasattr(backend, "parallel_small_rows") and backend.parallel_small_rows(True)
    return ThreadTuner(candidates), (f"one of {', '.join(map(str, candidates))} threads per step, by time"
                                     + ("; row kernels parallel from a few rows" if small_rows else ""))


def thread_ladder(num_threads: int) -> tuple[int, ...]:
    """The counts tried: 1 and its doublings below ``num_threads``, then ``num_threads``."""
    ladder = [1]
    while ladder[-1] * 2 < num_threads:
        ladder.append(ladder[-1] * 2)
    return tuple(ladder + [num_threads]) if num_threads > 1 else (1,)


def step_runner(runner, num_threads: int, world_size: int, enabled: bool, log):
    """``runner.execute`` through a tuner where ``thread_tuner_for`` gives one (None otherwise),
    logging what it chose (every group's choice) whenever a group learns or changes its choice."""
    tuner, why = thread_tuner_for(runner, num_threads, world_size, enabled)
    log.info("threads per step", adaptive=tuner is not None, why=why)
    if tuner is None:
        return None
    import torch

    chosen: dict[int, int] = {}  # tuner.best() as last logged

    def run(step):
        num_tokens = len(step.input_token_ids)
        result = tuned_execute(tuner, runner.execute, step, num_tokens, torch.set_num_threads)
        best = tuner.best_for(num_tokens)  # only the group this step was timed in can have changed
        if best is not None and chosen.get(key := tuner.min_tokens_of(num_tokens)) != best:
            chosen[key] = best
            log.info("threads per step", by_min_tokens=dict(sorted(chosen.items())))
        return result

    return run
