"""The rate sweep's runs (``loadtest/sweep/main.py``): the servers, started fresh and warmed up, then one
timed run per rate and policy, rates interleaved across policies, until a policy's rate is above
the latency bound, with progress lines.

A policy is the server's flags plus what each request asks for as ``max_tokens`` (its
reservation, ``loadtest/sweep/load.py``); every server otherwise gets the same flags, and policies
with the same flags share one server (paged, paged without prefix caching, and one contiguous
server for Orca Oracle, Pow2 and Max: three at once, about 2.5 GB of memory each with SmolLM2).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from dataclasses import dataclass

from loadtest.sweep.load import RESERVATIONS, RatePlan, Workload, arrival_times_s, max_tokens_for, prompt_ids, \
    run_rate
from loadtest.sweep.report import RateSummary, latency_bound, summarize, write_summaries, write_timeline
from loadtest.bench.servers import _get_json, start_server
from loadtest.bench.throughput import say


@dataclass(frozen=True)
class Policy:
    name: str
    label: str
    server_flags: tuple[str, ...]
    reservation: str  # what each request asks for as max_tokens (sweep_load.max_tokens_for)

    @property
    def kv_policy(self) -> str:
        return self.server_flags[self.server_flags.index("--kv-policy") + 1]


POLICIES = {p.name: p for p in (
    Policy("paged", "paged", ("--kv-policy", "paged"), "exact"),
    Policy("paged-no-prefix-caching", "paged, no prefix caching", ("--kv-policy", "paged", "--no-prefix-caching"),
           "exact"),
    Policy("contiguous", "contiguous, reserves prompt + output (Orca Oracle)", ("--kv-policy", "contiguous"), "exact"),
    Policy("contiguous-pow2", "contiguous, reserves prompt + 2^k >= output (Orca Pow2)", ("--kv-policy", "contiguous"),
           "pow2"),
    Policy("contiguous-max", "contiguous, reserves the whole context (Orca Max)", ("--kv-policy", "contiguous"), "max"),
)}
assert all(p.reservation in RESERVATIONS for p in POLICIES.values())
WARM_UP_PROMPT_TOKENS, WARM_UP_OUTPUT_TOKENS = 24, 8
LATE_SEND_WARNING_S = 0.1


def num_requests_at(args, rate_req_s: float) -> int:
    if args.num_requests is not None:
        return args.num_requests
    return max(args.min_requests, round(rate_req_s * args.duration_s))


def server_flags(args, policy: Policy, context: int) -> list[str]:
    flags = [*policy.server_flags, "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs),
             "--max-model-len", str(context)]
    return flags + (["--model", args.model] if args.model else []) + args.server_flags.split()


def make_plan(url: str, model: str, workload: Workload, policy: Policy, args, rate_req_s: float) -> RatePlan:
    n = num_requests_at(args, rate_req_s)
    return RatePlan(
        url=url, model=model, prompts=prompt_ids(workload, n, args.seed, rate_req_s, args.shared_prefix_tokens),
        arrivals_s=arrival_times_s(workload, n, rate_req_s), num_output_tokens=workload.num_output_tokens[:n],
        max_tokens=[max_tokens_for(policy.reservation, p, o, workload.max_model_len)
                    for p, o in zip(workload.num_prompt_tokens[:n], workload.num_output_tokens[:n])],
        client_stops=policy.reservation != "exact", sample_interval_s=args.sample_interval_s)


def warm_up(url: str, model: str, workload: Workload, args) -> None:
    """Two rounds of four concurrent short requests (with the shared prefix, so its cached path
    compiles too); the kernels compile on first use, and that must not land in a timed run."""
    prefix = prompt_ids(workload, 1, args.seed, -1.0, args.shared_prefix_tokens)[0][:args.shared_prefix_tokens]
    num_prompt = min(workload.max_model_len - WARM_UP_OUTPUT_TOKENS, len(prefix) + WARM_UP_PROMPT_TOKENS)
    num_output = min(WARM_UP_OUTPUT_TOKENS, workload.max_model_len - num_prompt)
    for round_idx in range(2):
        prompts = [(prefix + [1000 + 97 * round_idx + 13 * i + j for j in range(WARM_UP_PROMPT_TOKENS)])[:num_prompt]
                   for i in range(4)]
        plan = RatePlan(url, model, prompts, [0.0] * 4, [num_output] * 4, [num_output] * 4, client_stops=round_idx == 1)
        asyncio.run(run_rate(plan, lambda plan, t: None))
        failed = [r.error for r in plan.records if not r.ok]
        if failed:
            raise SystemExit(f"warm-up request failed: {failed[0]}")


def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until the server holds no request (an aborted stream can outlive its client by a step)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = _get_json(f"{url}/health")
        if not health.get("num_running") and not health.get("num_waiting"):
            return
        time.sleep(0.05)  # an aborted stream ends within a step or two
    raise SystemExit(f"the server still holds requests {timeout_s:.0f} s after a run: see its log")


def progress_printer(policy: str, rate_req_s: float, position: str):
    def progress(plan: RatePlan, elapsed_s: float) -> None:
        done = sum(r.ok for r in plan.records)
        sent = sum(r.sent_s is not None for r in plan.records)
        last = plan.samples[-1] if plan.samples else None
        server = (f"server: {last.num_running} running, {last.num_waiting} waiting, "
                  f"{last.num_blocks_used}/{last.num_blocks_total} KV blocks" if last else "")
        say(f"  [{policy} {rate_req_s:g} req/s, rate {position}] {done}/{len(plan.records)} done, "
            f"{sent - done} in flight; {server} ({elapsed_s:.0f} s)")
    return progress


@dataclass
class Server:
    """One running ``pagedserve serve``, shared by the policies whose server flags are equal (the
    three contiguous reservations differ only in what their requests ask for)."""

    name: str  # the first policy that uses it
    proc: subprocess.Popen
    url: str
    model: str


def start_servers(args, policies: list[Policy], workload: Workload) -> dict[tuple[str, ...], Server]:
    """One warmed-up server per distinct set of server flags, started one after the other; the
    caller stops them (``stop_server``), also when this raises."""
    servers: dict[tuple[str, ...], Server] = {}
    try:
        for policy in policies:
            if policy.server_flags in servers:
                continue
            flags = server_flags(args, policy, workload.max_model_len)
            say(f"[{policy.name}] starting pagedserve serve {' '.join(flags)}")
            proc, url = start_server(flags, os.path.join(args.out, f"server-{policy.name}.log"))
            server = servers[policy.server_flags] = Server(policy.name, proc, url, "")  # stopped if what follows fails
            server.model = _get_json(f"{url}/v1/models")["data"][0]["id"]
            t0 = time.monotonic()
            warm_up(url, server.model, workload, args)
            say(f"[{policy.name}] warmed up ({time.monotonic() - t0:.0f} s)")
    except BaseException:
        for server in servers.values():
            stop_server(server.proc)
        raise
    return servers


def run_sweep(args, workload: Workload, summaries: list[RateSummary], timeline: list,
              bound: list[float | None]) -> None:
    """Every policy at every rate, interleaved: each rate, lowest first, runs under each policy in
    ``--policies`` order, so a change in the machine's other load falls on all policies alike rather
    than on one. A policy above the bound skips its higher rates. Appends to ``summaries`` and
    ``timeline`` (the CSV files are rewritten after each run, policy by policy); sets ``bound[0]``
    after the reference policy's first rate."""
    policies = [POLICIES[n] for n in args.policy_list]
    servers = start_servers(args, policies, workload)
    try:
        active = list(policies)
        for i, rate in enumerate(args.rate_list):
            for policy in list(active):
                server = servers[policy.server_flags]
                wait_idle(server.url)
                plan = make_plan(server.url, server.model, workload, policy, args, rate)
                summary = run_one_rate(plan, policy.name, rate, f"{i + 1}/{len(args.rate_list)}", args.rate_timeout_s)
                summaries.append(summary)
                timeline.extend((policy.name, rate, s) for s in plan.samples)
                order = {n: k for k, n in enumerate(args.policy_list)}
                summaries.sort(key=lambda s: (order[s.policy], s.rate_req_s))
                write_summaries(os.path.join(args.out, "summary.csv"), summaries)
                write_timeline(os.path.join(args.out, "timeline.csv"), timeline)
                if bound[0] is None:
                    bound[0] = latency_bound(summaries, args.policy_list[0], args.latency_bound_factor)
                    say(f"latency bound: {args.latency_bound_factor:g} x {policy.name} at {rate:g} req/s "
                        f"= {bound[0]:.3f} s/token")
                if summary.normalized_latency_s_per_token > bound[0] and not args.run_all_rates:
                    say(f"[{policy.name}] above the bound: higher rates skipped (--run-all-rates runs them)")
                    active.remove(policy)
    finally:
        for server in servers.values():
            stop_server(server.proc)


def run_one_rate(plan: RatePlan, policy: str, rate_req_s: float, position: str, timeout_s: float) -> RateSummary:
    """One timed run, with progress lines and a closing line; its summary."""
    say(f"[{policy}] rate {rate_req_s:g} req/s ({position}): {len(plan.prompts)} requests over "
        f"{plan.arrivals_s[-1]:.0f} s")
    t0 = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(run_rate(plan, progress_printer(policy, rate_req_s, position)), timeout_s))
    except asyncio.TimeoutError:
        say(f"[{policy}] rate {rate_req_s:g}: not finished after --rate-timeout-s {timeout_s:.0f}")
    s = summarize(policy, rate_req_s, plan.records, plan.samples, os.getloadavg()[0])
    say(f"[{policy}] rate {rate_req_s:g}: normalized latency {s.normalized_latency_s_per_token:.3f} s/token, "
        f"{s.throughput_req_s:.2f} req/s, {s.arriving_output_tokens_s:.0f} output tok/s while arriving, "
        f"TTFT p50 {s.ttft_p50_s:.2f} s, mean running {s.mean_running:.1f}, {s.num_failed} failed "
        f"({time.monotonic() - t0:.0f} s; load average {s.load_avg_1m:.1f})")
    if s.max_send_lag_s > LATE_SEND_WARNING_S:
        say(f"[{policy}] rate {rate_req_s:g}: a request left the client {s.max_send_lag_s:.2f} s after its arrival "
            f"time (the client fell behind; latencies are measured from the send)")
    errors = [r.error or "unfinished" for r in plan.records if not r.ok]
    if errors:
        say(f"[{policy}] rate {rate_req_s:g}: {len(errors)} failed; the first: {errors[0]}")
    return s


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
