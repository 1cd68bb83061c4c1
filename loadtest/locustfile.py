"""Locust load test: users that stream chat completions, with the paper's request lengths.

    locust -f loadtest/locustfile.py --headless -u 16 -r 4 -t 60s --host http://127.0.0.1:8000 \\
        --dataset sharegpt --csv out --html out.html

Each user sends one streamed chat completion after another (a closed loop; raise ``-u`` for more
load). Prompt and output lengths come from ``--dataset`` (``sharegpt``: 161 input / 338 output
tokens on average, ``alpaca``: 19 / 58; ``loadtest/common/workloads.py``), clipped to the model's
context; ``max_tokens`` is the drawn output length and ``ignore_eos`` holds it. Locust's tables,
CSV and HTML report show, per dataset (response times in ms):

- ``POST chat [<dataset>]``: the HTTP request (time to the response headers). Failures are counted
  here: an HTTP error, an error event, a stream without ``[DONE]``, fewer tokens than asked.
- ``TTFT``: time to first token; ``ITL``: every gap between consecutive streamed chunks (inter-token
  latency); ``E2E``: end-to-end latency, whose size column is the request's output tokens.

Options besides Locust's own: ``--dataset``, ``--model`` (default: the server's first model),
``--max-model-len`` (default: the server's, from ``/v1/models``), ``--api-key`` (default:
``$PAGEDSERVE_API_KEY``), ``--length-seed``.
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import time

import gevent
import locust.stats
from locust import HttpUser, constant, events, task

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `locust -f` from anywhere

from loadtest.common.stream_timing import StreamTimes, read_stream  # noqa: E402
from loadtest.common.workloads import DATASETS, prompt_text  # noqa: E402

_user_numbers = itertools.count()


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="sharegpt", include_in_web_ui=True,
                        help="request length distribution: sharegpt (161/338 tokens) or alpaca (19/58)")
    parser.add_argument("--model", default="", include_in_web_ui=True,
                        help="model name to request (default: the server's first model)")
    parser.add_argument("--max-model-len", type=int, default=0, include_in_web_ui=True,
                        help="context length to clip requests to (default: the server's max_model_len)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY", ""), is_secret=True,
                        help="Bearer key for the API (default: $PAGEDSERVE_API_KEY)")
    parser.add_argument("--length-seed", type=int, default=0, include_in_web_ui=True,
                        help="seed of the request lengths and prompts (user i uses seed + i)")


_csv_prefix = ""  # --csv, from the init event


@events.init.add_listener
def _remember_csv_prefix(environment, **_kwargs) -> None:
    global _csv_prefix
    _csv_prefix = getattr(environment.parsed_options, "csv_prefix", None) or ""


@events.quit.add_listener
def _final_csv_write(**_kwargs) -> None:
    """Let Locust's CSV writer rewrite ``--csv``'s files once more before they are closed.

    The writer rewrites them once a second, and at exit Locust closes them without a last write
    (locust issues 1806 and 2299), so the streams that ended in the last second (with ``-t``, every
    stream that ran on into ``--stop-timeout``) were in the printed summary and the HTML report but
    not in the CSV. Every user has stopped when ``quit`` fires, so the writer's next tick, due within
    one interval, writes the final figures."""
    if _csv_prefix:
        gevent.sleep(locust.stats.CSV_STATS_INTERVAL_SEC * 1.5)


class ChatStreamUser(HttpUser):
    """Streams chat completions back to back and reports TTFT, ITL and E2E as request events."""

    wait_time = constant(0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.dataset = DATASETS[opts.dataset]
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.rng = random.Random(opts.length_seed + next(_user_numbers))
        self.model, self.max_model_len = opts.model, opts.max_model_len
        if not self.model or not self.max_model_len:
            card = self._first_model()
            self.model = self.model or card["id"]
            self.max_model_len = self.max_model_len or int(card.get("max_model_len") or 2048)

    def _first_model(self) -> dict:
        with self.client.get("/v1/models", headers=self.headers, name="GET /v1/models", catch_response=True) as resp:
            models = resp.json().get("data") if resp.ok else None
            if not models:
                resp.failure(f"/v1/models answered {resp.status_code} with no model: {resp.text[:200]}")
                raise RuntimeError("no model to load-test: give --model and --max-model-len")
            return models[0]

    @task
    def chat(self) -> None:
        num_input, num_output = self.dataset.sample(self.rng, self.max_model_len)
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt_text(self.rng, num_input)}],
            "max_tokens": num_output, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
        }
        start_s = time.perf_counter()
        with self.client.post("/v1/chat/completions", json=body, headers=self.headers, stream=True,
                              catch_response=True, name=f"chat [{self.dataset.name}]") as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:300]}")
                return
            times = read_stream(resp.iter_lines(), start_s)
            problem = times.problem(num_output)
            if problem:
                resp.failure(problem)
                return
            resp.success()
        self._report(times)

    def _report(self, times: StreamTimes) -> None:
        self._fire("TTFT", times.ttft_s)
        for itl_s in times.itls_s:
            self._fire("ITL", itl_s)
        self._fire("E2E", times.e2e_s, times.num_output_tokens or len(times.token_times_s))

    def _fire(self, request_type: str, seconds: float, response_length: int = 0) -> None:
        self.environment.events.request.fire(
            request_type=request_type, name=self.dataset.name, response_time=seconds * 1000.0,
            response_length=response_length, exception=None, context={},
        )
