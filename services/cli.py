"""The ``pagedserve`` command: ``serve`` (all three services) or one service on its own."""

from __future__ import annotations

import argparse
import os
import sys

from shared.cpu_threads import set_thread_env

set_thread_env()  # before torch or numba is imported anywhere below

from shared.endpoints import Endpoints  # noqa: E402


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


def _add_keys_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where to write public/<role>.key and private/<role>.key_secret for the scheduler, "
                        "the frontend and the executor (ZeroMQ certificate files; secrets mode 0600)")
    p.add_argument("--force", action="store_true", help="overwrite keys already in DIR")


def build_parser() -> argparse.ArgumentParser:
    from services.command_flags import CHILD_FLAGS, GROUP_FLAGS, SERVE_FLAGS, add_command_flags

    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start frontend, scheduler and executor, and supervise them")
    add_command_flags(serve, SERVE_FLAGS)
    from shared.zmq_auth import add_curve_argument  # imports zmq, which `health` must not

    add_curve_argument(serve.add_argument_group("ZeroMQ security"), serve=True)

    sched = sub.add_parser("scheduler", help="the scheduler process alone")
    add_command_flags(sched, CHILD_FLAGS["scheduler"] + GROUP_FLAGS["scheduler"])
    sched.add_argument("--supervisor-endpoint", default=None,
                       help="ZMQ endpoint of a supervisor to tell about lost executors, so that it replaces "
                            "them (default: $PAGEDSERVE_SUPERVISOR_ENDPOINT; pagedserve serve sets it)")
    _add_endpoint_arguments(sched, Endpoints.names())
    add_curve_argument(sched)

    ex = sub.add_parser("executor", help="one executor process alone")
    add_command_flags(ex, CHILD_FLAGS["executor"] + GROUP_FLAGS["executor"])
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
        from services.command_flags import CHILD_FLAGS, GROUP_FLAGS, given_values
        from shared.zmq_auth import curve_dir

        if args.command == "scheduler":
            from services.scheduler.main import SchedulerProcessConfig, run_scheduler

            run_scheduler(SchedulerProcessConfig(
                endpoints=_endpoints(args), zmq_curve=curve_dir(args),
                supervisor_endpoint=args.supervisor_endpoint or os.environ.get("PAGEDSERVE_SUPERVISOR_ENDPOINT"),
                **given_values(args, CHILD_FLAGS["scheduler"] + GROUP_FLAGS["scheduler"]),
            ))
        elif args.command == "executor":
            from shared.cpu_threads import prepare_openmp

            prepare_openmp()  # before the flags' checks import torch
            from services.executor.main import ExecutorConfig, run_executor

            step, result = _endpoint_pair(args)
            return run_executor(ExecutorConfig(
                endpoints=Endpoints(request="", step=step, result=result), zmq_curve=curve_dir(args),
                **given_values(args, CHILD_FLAGS["executor"] + GROUP_FLAGS["executor"]),
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
