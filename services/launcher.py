"""``pagedserve serve``: start the scheduler, the executor ranks and the frontend, and supervise them
(``supervisor``), each with the flags of serve's command line it takes (``command_flags``).

Each service is its own process (``python -m services.cli <service> ...``, a ``children.Child``)
wired by ``ipc://`` sockets in a private directory. With ``-tp N`` there are N executor ranks
(``group_layout`` says which run on this host and with which flags). With ``-dp N`` there are N
replicas, each a scheduler and its executor ranks on sockets of their own, and one frontend that
routes requests among them (``data_parallel``); each replica's processes restart on their own
(its scheduler group "scheduler i", its ranks "executor i"), the others serving meanwhile.

A process that dies is started again, its cause logged (how it ended and its last error line) and
counted (``shared.restart_counts``). The executor ranks restart together, as a new group:
tensor-parallel ranks cannot go on without one of theirs, so when any rank ends the others are
stopped, the old group's shared-memory segments and handle store are removed, and every rank
starts again under a fresh group id (and a fresh local rendezvous port when serve chose the first).
A hung executor is found by the scheduler (missed heartbeats, an overdue step), which reports it on
the supervisor socket (``ProcessLost``): the launcher kills it, then restarts it as if it had died.
More than ``--max-restarts`` restarts of one process (the ranks count as one) within
``--restart-window-s`` (``restart_budget.RestartBudget``), or a configuration error (exit code 2), stops
everything, and ``serve`` exits non-zero naming the process and why; of several ranks that ended,
the one that failed first is named, not those that stopped because it did. On a host without the
scheduler (``--node-rank`` > 0), ranks that end cleanly were stopped by the scheduler: ``serve``
stops and exits 0. SIGTERM or Ctrl-C stops them all, removes the socket directory and any
shared-memory segment of the group.

``--zmq-curve DIR`` (or ``$PAGEDSERVE_ZMQ_CURVE``) hands every child the key directory in its
environment (``shared.zmq_auth``); ``--zmq-curve`` alone makes throw-away keys in the private
socket directory, which goes with it (one host only: across hosts every host needs the same keys).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading

import zmq

from services.children import stop_all
from services.command_flags import (  # noqa: F401  (the children's command lines, as before)
    executor_argv, frontend_argv, frontend_env, rank_argv, scheduler_argv,
)
from services.data_parallel import ReplicaPlan, data_parallel_size, longest_socket_name, plan_replicas
from services.executor.device import check_device_name
from services.frontend.chat_template import resolve_chat_template
from services.frontend.flags import HttpFlags
from services.frontend.generation_defaults import check_setting
from services.group_layout import GroupLayout, check_model_split
from services.supervisor import (  # noqa: F401  (build_groups and first_ended: as before)
    CONFIG_ERROR_EXIT_CODE, FOLLOWER_GRACE_S, Supervisor, build_groups as _build_groups, first_ended, log_group,
    remove_group_segments,
)
from shared.endpoints import make_private_socket_dir
from shared.logging import configure_logging
from shared.model_source import resolve_tokenizer
from shared.restart_counts import ENV_VAR as RESTARTS_ENV_VAR, restarts_path
from shared.zmq_auth import ENV_VAR as CURVE_ENV_VAR, EPHEMERAL, create_keys, curve_dir, load_keys


def serve(args) -> int:
    """Run the services until a signal or a failure that restarts cannot mend; returns the exit code."""
    sock_dir = make_private_socket_dir(longest_socket_name(data_parallel_size(args)))
    try:  # bad group flags, or heads that do not split: a one-line error before anything starts
        plans, curve = _check_and_plan(args, sock_dir)
    except BaseException:
        shutil.rmtree(sock_dir, ignore_errors=True)
        raise
    log = configure_logging("launcher")
    _log_start(plans, curve, sock_dir, log)
    supervisor_endpoint = f"ipc://{os.path.join(sock_dir, 'supervisor.sock')}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PAGEDSERVE_SUPERVISOR_ENDPOINT": supervisor_endpoint, RESTARTS_ENV_VAR: restarts_path(sock_dir),
           **({CURVE_ENV_VAR: curve} if curve else {})}
    env.setdefault("PAGEDSERVE_LOG_FORMAT", "console" if sys.stderr.isatty() else "json")
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum, _frame):
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    context = zmq.Context()
    reports = context.socket(zmq.PULL)
    reports.setsockopt(zmq.LINGER, 0)
    reports.bind(supervisor_endpoint)
    supervisor = Supervisor(args, plans, sock_dir, env, reports, log)
    code, failure = 0, None
    try:
        supervisor.start_all()
        code, failure = supervisor.run(stop)
    finally:
        if received:
            log.info("stopping", signal=received[0])
        stop_all(list(supervisor.children()))
        context.destroy(linger=0)
        shutil.rmtree(sock_dir, ignore_errors=True)
        for plan in supervisor.plans.values():
            remove_group_segments(plan.layout, log)
    if failure is not None:
        log.error("stopped", why=failure)
        print(f"pagedserve: {failure}; stopped the others", file=sys.stderr)
    return code


def _check_and_plan(args, sock_dir: str) -> tuple[list[ReplicaPlan], str | None]:
    """The replicas' plans and the CURVE key directory, every flag and file checked first
    (``ValueError`` naming the flag): nothing has started yet."""
    if getattr(args, "device", None) is not None:
        check_device_name(args.device)
    plans = plan_replicas(args, sock_dir)
    layout = plans[0].layout
    if layout.world_size > 1:
        check_model_split(args.model, layout.world_size)
    resolve_chat_template(getattr(args, "chat_template", None))  # the frontend reads it again
    check_setting(getattr(args, "generation_config", None) or HttpFlags().generation_config)
    if getattr(args, "tokenizer", None):
        resolve_tokenizer(args.tokenizer, None)
    return plans, zmq_curve_dir(args, layout, sock_dir)


def _log_start(plans: list[ReplicaPlan], curve: str | None, sock_dir: str, log) -> None:
    for plan in plans:
        log_group(plan, log)
    if len(plans) > 1:
        log.info("data-parallel replicas", num_replicas=len(plans), tensor_parallel_size=plans[0].layout.world_size,
                 num_threads_per_rank=plans[0].args.num_threads, seeds=[p.args.seed for p in plans])
    log.info("zmq security", mode="curve" if curve else "plain", key_dir=curve,
             ephemeral_keys=curve is not None and curve.startswith(sock_dir))


def zmq_curve_dir(args, layout: GroupLayout, sock_dir: str) -> str | None:
    """The CURVE key directory every child gets (None: plain ZeroMQ), its keys checked now: a
    missing one stops serve before anything starts. ``--zmq-curve`` alone: fresh keys in ``sock_dir``."""
    directory = curve_dir(args)
    if directory == EPHEMERAL:
        if layout.num_nodes > 1:
            raise ValueError(f"--zmq-curve needs a key directory with --nnodes {layout.num_nodes}: every host must "
                             "hold the same keys (make them once with `pagedserve keys --out DIR`, copy DIR)")
        directory = os.path.join(sock_dir, "zmq-curve")
        create_keys(directory)
    if directory:
        for role in ("scheduler", "frontend", "executor") if layout.runs_scheduler else ("executor",):
            load_keys(directory, role)
    return directory
