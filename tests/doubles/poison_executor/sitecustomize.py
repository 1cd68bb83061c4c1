"""Fault injection for ``tests/system/test_server_faults.py`` (a test double, never used by the product).

A server started with this directory on ``PYTHONPATH`` runs unchanged, except that its executor
processes die (SIGKILL, sent to themselves) whenever a step runs a sequence whose *prompt* holds
``POISON_TOKEN_ID``: a request that crashes the executor every time, as a kernel bug triggered by
one input would. Python imports ``sitecustomize`` at every interpreter start; this one only adds an
import hook that wraps ``ModelRunner.execute`` when (and if) ``services.executor.runner`` is loaded,
so the launcher, the scheduler and the frontend never load anything more.
"""

from __future__ import annotations

import importlib.abc
import os
import signal
import sys

POISON_TOKEN_ID = 49151  # the last id of SmolLM2's tokenizer (the tiny test models use it)
_TARGET = "services.executor.runner"


def _poison(runner_class) -> None:
    execute = runner_class.execute
    poisoned: set[int] = set()  # seq ids whose prompt holds the poison, in this process

    def poisoned_execute(self, step):
        for new in step.new_seqs:
            if POISON_TOKEN_ID in new.token_ids[: new.num_prompt_tokens].tolist():
                poisoned.add(new.seq_id)
        if poisoned.intersection(step.seq_ids.tolist()):
            os.kill(os.getpid(), signal.SIGKILL)
        return execute(self, step)

    runner_class.execute = poisoned_execute


class _PoisonFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _poison(module.ModelRunner)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PoisonFinder())
