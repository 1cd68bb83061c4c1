"""Test doubles for the frontend: a fake scheduler on real ZMQ sockets and a frontend in a thread.

Not used by the service itself; tests (and anyone load-testing the frontend alone) import it.
"""

from __future__ import annotations

import asyncio
import functools
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import uvloop
import zmq

from services.frontend.config import FrontendConfig
from services.frontend.main import FrontendServer
from services.frontend.served_model import ServedModel
from shared.endpoints import Endpoints
from shared.messages import AbortRequest, AddRequest, EngineStats, KvWatch, RequestOutput, RequestOutputs, decode, encode
from shared.model_source import eos_token_ids, load_tokenizer, resolve_model

# What the fake model "generates": multi-byte characters split across byte-level tokens on purpose.
REPLY_TEXT = (
    "Hello there! Paged attention 🚀 keeps the KV cache in blocks — 東京 and café. STOP here, then more text."
)
ERROR_MARKER = "[[error]]"  # a prompt containing this gets finish_reason "error"
SLOW_MARKER = "[[slow]]"  # a prompt containing this gets one token per 20 ms until max_tokens
MALFORMED_MARKER = "[[malformed]]"  # a prompt containing this gets an undecodable RequestOutputs frame
HOLD_MARKER = "[[hold]]"  # a prompt containing this gets no output at all until it is aborted
FEW_BEAMS_MARKER = "[[fewbeams]]"  # with use_beam_search: only one hypothesis comes back, whatever n
SAY_PATTERN = re.compile(r"\[\[say\]\](.*?)\[\[/say\]\]", re.S)  # [[say]]TEXT[[/say]]: every choice says TEXT


def fake_logprob(token_id: int) -> float:
    """The logprob the fake scheduler reports for ``token_id``."""
    return -((token_id % 7) + 1) / 8


def fake_rank(token_id: int) -> int:
    """The rank the fake scheduler reports for prompt token ``token_id``."""
    return token_id % 3 + 1


@functools.cache
def cached_tokenizer() -> Any:
    """The default model's tokenizer, loaded once per process (it takes seconds)."""
    return load_tokenizer(resolve_model(None))


def default_served_model(max_model_len: int = 8192, name: str | None = None) -> ServedModel:
    tokenizer = cached_tokenizer()
    return ServedModel(name or resolve_model(None).name, tokenizer, max_model_len, eos_token_ids(tokenizer, None))


@dataclass
class _Choice:
    token_ids: list[int]
    finish_reason: str
    next_idx: int = 0

    @property
    def done(self) -> bool:
        return self.next_idx >= len(self.token_ids)


@dataclass
class _Active:
    request: AddRequest
    choices: list[_Choice]
    interval_s: float
    held: bool = False  # best_of / beam search: everything in one burst, renumbered by ``order``
    order: list[int] = field(default_factory=list)
    next_time: float = 0.0
    sent_first: bool = False


@dataclass
class FakeScheduler:
    """Binds the scheduler's ROUTER endpoint and answers each ``AddRequest`` deterministically, to
    the frontend that sent it (several frontends may share one fake; stats go to all of them).

    The reply is ``REPLY_TEXT``'s tokens then the first EOS id (finish "stop"), cut to
    ``max_tokens`` (finish "length"); ``tokens_per_output`` tokens per ``RequestOutput``. With
    ``sampling.logprobs = k`` each token gets the logprob ``fake_logprob(token)`` and the top list
    ``[token, token + 1, ...]`` (k long) with logprobs ``fake_logprob(token) - rank``. With
    ``sampling.prompt_logprobs = k`` the request's first output carries each prompt token's (after
    the first) ``fake_logprob(token)``, rank ``fake_rank(token)`` and top list ``[token + 1, ...]``
    (k long) with logprobs ``fake_logprob(token) - rank``. ``max_tokens`` 0 gets one output per
    choice, with no token and finish "length". It sends
    ``EngineStats(ready=self.ready)`` every 50 ms and records every ``AddRequest`` and
    ``AbortRequest`` (and each ``KvWatch``'s ``on`` in ``kv_watches``; a test sends the snapshots
    itself with ``send_raw``); an aborted request gets no more outputs. A request's last output is marked
    ``request_finished``, as the real scheduler marks it.

    Several choices, shaped like the real scheduler's: with ``n`` each choice ``c`` replies
    ``choice_token_ids(c)`` (then EOS, cut to max_tokens), their outputs interleaved. With
    ``best_of > n`` the samples are those of choices ``0 .. best_of-1``; nothing is sent until the
    end, then the last ``n`` samples (``best_of - 1`` first: the fake's "most likely") in one output
    each, renumbered ``0 .. n-1``, with logprobs only if the request asked for them. With
    ``use_beam_search`` the hypotheses are choices ``0 .. n-1`` (only one with
    ``FEW_BEAMS_MARKER``), sent at the end in one output each, without logprobs. A prompt holding
    ``[[say]]TEXT[[/say]]`` (``SAY_PATTERN``) gets TEXT's tokens in every choice instead of the reply
    (the last such TEXT where the prompt holds several: a conversation's latest turn).
    """

    endpoints: Endpoints
    tokenizer: Any
    tokens_per_output: int = 3
    ready: bool = True
    epoch: int = 0  # a fake started where another stood gives a new one: the frontend sees a restart
    added: list[AddRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    kv_watches: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reply_token_ids = list(self.tokenizer.encode(REPLY_TEXT))
        self._choice_ids: dict[int, list[int]] = {0: self.reply_token_ids}
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.bind(self.endpoints.request)
        self._frontends: set[bytes] = set()  # identities of the connected frontends
        self._owners: dict[str, bytes] = {}  # request id -> the frontend that sent it
        self._active: dict[str, _Active] = {}
        self._raw_frames: list[bytes] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-scheduler", daemon=True)

    def start(self) -> "FakeScheduler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._router.close(linger=0)
        self._context.term()

    def send_raw(self, frame: bytes) -> None:
        """Queue an arbitrary frame for every frontend (sent from the fake's own thread)."""
        with self._changed:
            self._raw_frames.append(frame)

    def wait_for(self, predicate, timeout: float = 30.0) -> bool:
        """Wait until ``predicate(self)`` holds (checked after each received message). The default
        timeout only guards against a hang: a loaded machine may take seconds."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout)

    def choice_token_ids(self, choice_idx: int) -> list[int]:
        """What choice ``choice_idx`` says before EOS: the reply, after ``"(c) "`` unless c is 0."""
        if choice_idx not in self._choice_ids:
            self._choice_ids[choice_idx] = list(self.tokenizer.encode(f"({choice_idx}) ")) + self.reply_token_ids
        return self._choice_ids[choice_idx]

    def expected_reply(self, max_tokens: int, eos_token_id: int, choice_idx: int = 0) -> tuple[list[int], str]:
        token_ids = self.choice_token_ids(choice_idx) + [eos_token_id]
        if len(token_ids) > max_tokens:
            return token_ids[:max_tokens], "length"
        return token_ids, "stop"

    # -------------------------------------------------------------- the fake's thread

    def _run(self) -> None:
        next_stats = 0.0
        while not self._stop.is_set():
            if self._router.poll(2 if self._active else 20):
                while self._router.poll(0):
                    self._receive(*self._router.recv_multipart())
            now = time.monotonic()
            with self._changed:
                frames, self._raw_frames = self._raw_frames, []
            for frame in frames:
                self._send(frame)
            for rid, active in list(self._active.items()):
                if now >= active.next_time:
                    self._emit(rid, active, now)
            if now >= next_stats:
                self._send(encode(EngineStats(len(self._active), 0, 100, 0, 0, 0, self.ready, epoch=self.epoch)))
                next_stats = now + 0.05

    def _receive(self, identity: bytes, frame: bytes) -> None:
        message = decode(frame)
        with self._changed:
            self._frontends.add(identity)
            if isinstance(message, AddRequest):
                self._owners[message.request_id] = identity
                self.added.append(message)
                self._active[message.request_id] = self._plan(message)
            elif isinstance(message, AbortRequest):
                self.aborted.append(message.request_id)
                self._active.pop(message.request_id, None)
            elif isinstance(message, KvWatch):
                self.kv_watches.append(message.on)
            self._changed.notify_all()

    def _plan(self, request: AddRequest) -> _Active:
        prompt = self.tokenizer.decode(request.prompt_token_ids.tolist())
        sampling = request.sampling
        max_tokens = sampling.max_tokens
        if ERROR_MARKER in prompt:
            return _Active(request, [_Choice([], "error")], 0.0)
        if MALFORMED_MARKER in prompt:
            return _Active(request, [_Choice([], "malformed")], 0.0)
        if HOLD_MARKER in prompt:
            return _Active(request, [_Choice([], "length")], 0.0, next_time=float("inf"))
        num_samples = sampling.n
        if sampling.best_of is not None and sampling.best_of > sampling.n and not sampling.use_beam_search:
            num_samples = sampling.best_of
        if SLOW_MARKER in prompt:
            choices = []
            for c in range(num_samples):
                ids = self.choice_token_ids(c)
                choices.append(_Choice((ids * (max_tokens // len(ids) + 1))[:max_tokens], "length"))
            interval = 0.02
        elif said := SAY_PATTERN.findall(prompt):  # the last one: a conversation's latest turn
            ids = list(self.tokenizer.encode(said[-1], add_special_tokens=False)) + [request.sampling.eos_token_ids[0]]
            finish = "length" if len(ids) > max_tokens else "stop"
            choices = [_Choice(ids[:max_tokens], finish) for _ in range(num_samples)]
            interval = 0.0
        else:
            eos = request.sampling.eos_token_ids[0]
            choices = [_Choice(*self.expected_reply(max_tokens, eos, c)) for c in range(num_samples)]
            interval = 0.0
        if sampling.use_beam_search:
            k = 1 if FEW_BEAMS_MARKER in prompt else sampling.n
            return _Active(request, choices, interval, held=True, order=list(range(k)))
        if num_samples > sampling.n:
            return _Active(request, choices, interval, held=True,
                           order=list(range(num_samples - 1, num_samples - 1 - sampling.n, -1)))
        return _Active(request, choices, interval)

    def _emit(self, rid: str, active: _Active, now: float) -> None:
        step = 1 if active.interval_s else self.tokens_per_output
        outputs = []
        for choice_idx, choice in enumerate(active.choices):
            if choice.done and choice.token_ids:
                continue
            new = choice.token_ids[choice.next_idx:choice.next_idx + step]
            choice.next_idx += len(new)
            if not active.held:
                outputs.append(self._output(rid, active, choice_idx, new, choice.finish_reason if choice.done else None))
        if active.held and all(c.done for c in active.choices):
            beam = active.request.sampling.use_beam_search
            for i, sample in enumerate(active.order):
                choice = active.choices[sample]
                outputs.append(self._output(rid, active, i, choice.token_ids, choice.finish_reason, not beam))
        active.next_time = now + active.interval_s
        if outputs and all(c.done for c in active.choices):
            outputs[-1].request_finished = True
        if active.choices[0].finish_reason == "malformed":  # an output of too few fields in its frame
            self._send(msgpack.packb([RequestOutputs.TAG, [[[rid, 0, "not a list"]]]]), rid)
        elif outputs:  # in one frame, as the scheduler sends a pass's outputs
            self._send(encode(RequestOutputs(outputs)), rid)
        if all(c.done for c in active.choices):
            del self._active[rid]

    def _output(self, rid: str, active: _Active, choice_idx: int, new: list[int], finish_reason: str | None,
                with_logprobs: bool = True) -> RequestOutput:
        output = RequestOutput(
            request_id=rid,
            choice_idx=choice_idx,
            new_token_ids=new,
            finish_reason=finish_reason,
            num_prompt_tokens=0 if active.sent_first else len(active.request.prompt_token_ids),
            error="simulated engine failure" if finish_reason == "error" else None,
            error_kind="engine" if finish_reason == "error" else None,
        )
        num_top = active.request.sampling.logprobs
        if num_top is not None and with_logprobs:
            output.logprobs = [fake_logprob(t) for t in new]
            output.top_token_ids = [[t + r for r in range(num_top)] for t in new]
            output.top_logprobs = [[fake_logprob(t) - r for r in range(num_top)] for t in new]
        num_prompt_top = active.request.sampling.prompt_logprobs
        if num_prompt_top is not None and not active.sent_first:
            prompt = active.request.prompt_token_ids.tolist()[1:]
            output.prompt_logprobs = [fake_logprob(t) for t in prompt]
            output.prompt_ranks = [fake_rank(t) for t in prompt]
            output.prompt_top_token_ids = [[t + 1 + r for r in range(num_prompt_top)] for t in prompt]
            output.prompt_top_logprobs = [[fake_logprob(t) - 1 - r for r in range(num_prompt_top)] for t in prompt]
        active.sent_first = True
        return output

    def _send(self, frame: bytes, request_id: str | None = None) -> None:
        """To the frontend that sent ``request_id``; to every frontend without one."""
        owner = self._owners.get(request_id) if request_id is not None else None
        for identity in [owner] if owner is not None else list(self._frontends):
            try:
                self._router.send_multipart([identity, frame], zmq.NOBLOCK)
            except zmq.Again:
                pass  # a frontend that cannot keep up: like the real scheduler, stats are resent anyway


class FrontendThread:
    """``FrontendServer`` on a uvloop event loop in a background thread (port 0: a free port)."""

    def __init__(
        self, model: ServedModel, endpoints: Endpoints, max_body_bytes: int | None = None,
        shutdown_grace_s: float = 5.0, **config: Any,
    ) -> None:
        """``config``: more ``FrontendConfig`` fields (``max_queue_len``, ``api_key``)."""
        self.shutdown_grace_s = shutdown_grace_s
        kwargs = {"max_body_bytes": max_body_bytes} if max_body_bytes else {}
        self.config = FrontendConfig(served_model_name=model.name, port=0, endpoints=endpoints, **kwargs, **config)
        self.model = model
        self.server: FrontendServer | None = None
        self.loop = uvloop.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="frontend", daemon=True)

    @property
    def base_url(self) -> str:
        assert self.server is not None and self.server.port is not None
        return f"http://127.0.0.1:{self.server.port}"

    def start(self) -> "FrontendThread":
        self._thread.start()
        if not self._started.wait(timeout=30):
            raise TimeoutError("the frontend did not start within 30 s")
        if self._error is not None:
            raise RuntimeError("the frontend failed to start") from self._error
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=15)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        finally:
            self.loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        try:
            self.server = FrontendServer(self.config, self.model, self.shutdown_grace_s)
            await self.server.start()
        except BaseException as exc:
            self._error = exc
            self._started.set()
            raise
        self._started.set()
        await self._stop.wait()
        await self.server.stop()
