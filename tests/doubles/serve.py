"""Start ``pagedserve serve`` as a user would, for the whole-server tests: a free port, a process
whose log and socket directory are in a test folder, the wait for /health, a clean stop; the tiny
random Llama those servers load; and the process tree they start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagedserve serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)  # ready is seen at once: every server start in the suite waits here
    raise TimeoutError("server not healthy in time")


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_server(tmp_root, *flags: str, dev: bool = False):
    """``pagedserve serve --port <free> flags``; with ``dev``, as the README's quick start says:
    ``./dev serve`` from the checkout (its setup step, then the console script it installed)."""
    port = free_port()
    log = open(tmp_root / "serve.log", "w")
    env = {**os.environ, "TMPDIR": str(tmp_root)}
    command = [os.path.join(ROOT, "dev"), "serve"] if dev else [sys.executable, "-m", "services.cli", "serve"]
    proc = subprocess.Popen([*command, "--port", str(port), *flags], env=env, stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT if dev else None)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def children_of(pid: int) -> dict[int, str]:
    """Child pid -> its pagedserve service name, read from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == pid and b"services.cli" in argv:
            out[int(entry)] = argv[argv.index(b"services.cli") + 1].decode()
    return out


def openai_client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def save_tiny_model(tmp_path_factory, **config):
    """A tiny random Llama with SmolLM2's tokenizer, saved as a model directory; returns its path.
    ``config`` overrides ``tiny_llama``'s configuration (heads, sizes)."""
    from tests.doubles.fake_scheduler import cached_tokenizer
    from tests.doubles.engine import tiny_llama

    tokenizer = cached_tokenizer()
    model_dir = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(**{"vocab_size": len(tokenizer), "max_position_embeddings": 256, **config}).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tiny_server(tmp_path_factory, label: str, *flags: str, model_dir):
    """Start ``pagedserve serve`` on the model saved in ``model_dir`` (the ``tiny_model_dir``
    fixture); yields its URL. A generator for module-scoped fixtures: the server is stopped when it
    resumes. Its log and its socket directory are in ``tmp_path_factory``'s ``label`` folder.
    """
    proc, url = start_server(tmp_path_factory.mktemp(label), "--model", str(model_dir), *flags)
    yield url
    stop(proc)
