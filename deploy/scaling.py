"""The smoke's scaled-frontends step (issue 10 part 3): several frontends on one scheduler.

``compose up -d --scale frontend=N`` starts N frontend containers, each publishing its port 8000 on
its own host port of the range ``PAGEDSERVE_PORT_RANGE`` (Docker takes the first free port of the
range for each container). Greedy answers from the one frontend are taken first; then concurrent
greedy requests go round-robin to every frontend's port, and each must come back complete with
exactly the one-frontend text: a request whose outputs went to the wrong frontend would hang (the
client's timeout) or come back with another prompt's text.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

PROMPTS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Count from one to ten.",
    "Write one sentence about the sea.",
)
MAX_TOKENS = 32
SCALED_PORTS_CHECK = "scaled frontends each published on a port of their own on 127.0.0.1"
SCALED_ANSWERS_CHECK = "concurrent greedy requests over the scaled frontends equal one-frontend answers"
REQUEST_TIMEOUT_S = 600.0


def greedy(port: int, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    """The streamed greedy chat answer (temperature 0) of the frontend published on ``port``."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                    timeout=REQUEST_TIMEOUT_S)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}],
        temperature=0, max_tokens=max_tokens, stream=True,
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def _attempt(port: int, prompt: str) -> str:
    try:
        return greedy(port, prompt)
    except Exception as exc:  # noqa: BLE001 (what the client saw is the result)
        return f"<{type(exc).__name__}: {exc}>"


def concurrent_answers(ports: list[int], num_requests: int) -> list[tuple[int, str, str]]:
    """``num_requests`` greedy requests at once, request i to ``ports[i % len(ports)]`` with
    ``PROMPTS[(i // len(ports)) % len(PROMPTS)]`` (so that every frontend gets every prompt):
    ``(port, prompt, answer)`` each, in order."""
    jobs = [(ports[i % len(ports)], PROMPTS[(i // len(ports)) % len(PROMPTS)]) for i in range(num_requests)]
    with ThreadPoolExecutor(max_workers=num_requests) as pool:
        answers = list(pool.map(lambda job: _attempt(*job), jobs))
    return [(port, prompt, answer) for (port, prompt), answer in zip(jobs, answers)]


def check_scaled_frontends(report, project, services: tuple[str, ...], num_frontends: int, num_requests: int,
                           healthy_timeout_s: float) -> None:
    """Greedy references from the one frontend, scale to ``num_frontends``, ``num_requests``
    concurrent requests over all their ports, then back to one frontend."""
    [single_port] = project.host_ports("frontend")
    references = {prompt: _attempt(single_port, prompt) for prompt in PROMPTS}
    report.note(f"one frontend (port {single_port}), greedy references: {references}")
    start = time.monotonic()
    project.compose("up", "-d", "--no-recreate", "--scale", f"frontend={num_frontends}")
    project.wait_healthy(services, healthy_timeout_s)
    ports = project.host_ports("frontend")
    report.times_s[f"scale to {num_frontends} frontends (healthy)"] = time.monotonic() - start
    report.check(SCALED_PORTS_CHECK,
                 len(set(ports)) == num_frontends and all(p.startswith("127.0.0.1:")
                                                           for p in project.published_ports("frontend")),
                 f"{num_frontends} wanted, published: {project.published_ports('frontend')}")
    name = f"{num_requests} concurrent requests over {len(ports)} frontends"
    start = time.monotonic()
    results = concurrent_answers(ports, num_requests)
    report.times_s[name] = time.monotonic() - start
    references_ok = all(ref and not ref.startswith("<") for ref in references.values())
    wrong = [(port, prompt, answer) for port, prompt, answer in results if answer != references[prompt]]
    served = {port: sum(1 for p, _, _ in results if p == port) for port in ports}
    report.check(SCALED_ANSWERS_CHECK,
                 references_ok and len(ports) == num_frontends and not wrong,
                 f"requests per port {served}, {num_requests - len(wrong)} of {num_requests} identical to the "
                 f"one-frontend answers in {report.times_s[name]:.1f} s"
                 + (f"; differing: {wrong[:3]}" if wrong else "") + ("" if references_ok else "; no references"))
    project.compose("up", "-d", "--no-recreate", "--scale", "frontend=1")
    project.wait_healthy(services, healthy_timeout_s)
    report.note(f"scaled back to one frontend: {project.published_ports('frontend')}")
