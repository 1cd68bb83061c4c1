"""The offline engine: the scheduler and a model runner in one process, no sockets (vLLM's ``LLM``).

    from services.offline import LLM
    from shared.messages import SamplingParams

    llm = LLM()  # the embedded SmolLM2-135M-Instruct; or LLM(model="path/to/model-or.gguf")
    [out] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out.choices[0].text)

``EngineCore`` is the loop: requests in (``AddRequest``), one scheduler step and one model step per
``step()``, ``RequestOutput`` deltas out. ``LLM`` adds a tokenizer and ``generate``. A request runs
here exactly as it does behind the server's frontend: same scheduler, block manager, model runner
and sampler, so greedy outputs are the same token for token. With ``async_scheduling`` the loop
plans each step before it applies the result of the one before, as the scheduler process does
while its executors compute (nothing runs at the same time here: it is the same order of events).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from shared.hub_kernels import hide_hub_kernels

hide_hub_kernels()  # a script that imports LLM and then transformers' models: `kernels` is ours (shared/hub_kernels.py)

from services.executor.guided import vocabulary_of
from services.executor.loader import build_runner
from services.executor.runner import ModelRunner
from services.offline_options import SchedulingOptions, split_options
from services.offline_outputs import ChoiceOutput, Logprob, PromptOutput
from services.scheduler.block_manager import BlockManager
from services.scheduler.contiguous import ContiguousBlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.tiered import scheduler_class
from shared.messages import AddRequest, RequestOutput, SamplingParams, Step, StepResult
from shared import speculative
from shared.messages.sampling_rules import verify
from shared.model_source import eos_token_ids, load_tokenizer, resolve_model, resolve_tokenizer


# What a user of ``LLM`` imports from here, as from vLLM (the outputs are built in offline_outputs).
__all__ = ["LLM", "EngineCore", "SchedulingOptions", "PromptOutput", "ChoiceOutput", "Logprob"]


class EngineCore:
    """A ``Scheduler`` over ``runner``'s KV pool, stepping the runner directly."""

    def __init__(self, runner: ModelRunner, options: SchedulingOptions = SchedulingOptions()) -> None:
        self.runner = runner
        if options.kv_policy == "contiguous":
            self.blocks = ContiguousBlockManager(runner.num_blocks, runner.block_size, num_cpu_blocks=runner.num_cpu_blocks,
                                                 enable_prefix_caching=options.enable_prefix_caching)
        else:  # a model whose every layer has one sliding window: blocks that leave it are freed
            self.blocks = BlockManager(runner.num_blocks, runner.block_size, num_cpu_blocks=runner.num_cpu_blocks,
                                       enable_prefix_caching=options.enable_prefix_caching,
                                       sliding_window=runner.model.freeable_window)
        offload = runner.offload  # the KV offload tiers, if any: their books live with the blocks'
        scheduler_cls = Scheduler if offload is None else scheduler_class(
            self.blocks, offload.num_host_blocks, offload.num_disk_blocks, offload.startup_keys)
        self.scheduler = scheduler_cls(
            SchedulerConfig(options.max_num_seqs, options.max_num_batched_tokens, runner.max_model_len,
                            options.preemption_mode, options.kv_policy, speculative.parse(options.speculative_config)),
            self.blocks,
        )
        self.async_scheduling = options.async_scheduling
        from services.scheduler.migration_desk import MigrationDesk

        self.migrations = MigrationDesk(self.scheduler)  # live migration (``offline_replicas``); its directory set there
        self._unapplied: StepResult | None = None  # the result of the step before, with async scheduling

    def add_request(self, request: AddRequest) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._unapplied is not None

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns every output decided since the previous call.

        Raises ``RuntimeError`` if requests wait but nothing can be scheduled (it would never end)."""
        had_work = self.scheduler.has_work()
        self.migrations.take_ops()
        step = self.migrations.attach(self.scheduler.schedule())  # with async scheduling, before the step before is applied
        unapplied, self._unapplied = self._unapplied, None
        result = self.execute(step) if step is not None else None  # the process applies meanwhile
        if unapplied is not None:
            self._update(unapplied)
        if result is not None:
            if self.async_scheduling and self.scheduler.can_schedule_ahead() and not self.migrations.wants_pause:
                self._unapplied = result
            else:
                self._update(result)
        outputs = self.scheduler.take_outputs()
        if had_work and step is None and unapplied is None and not outputs:
            raise RuntimeError(f"the engine cannot make progress: {len(self.scheduler.waiting)} waiting, "
                               f"{self.blocks.num_free_blocks} of {self.blocks.num_blocks} KV blocks free")
        return outputs

    def _update(self, result: StepResult) -> None:
        self.scheduler.update(result)
        self.migrations.update(result)

    def execute(self, step: Step) -> StepResult:
        """Run one step on the model (a subclass may wrap it)."""
        return self.runner.execute(step)


class LLM:
    """Generate offline. ``model``: as ``--model`` (None: the embedded SmolLM2-135M-Instruct);
    ``tokenizer``: as ``--tokenizer`` (None: the model's).
    ``engine_kwargs``: the flags of ``RunnerOptions`` (``dtype``, ``device`` (default ``auto``: a GPU
    where torch sees one, where ``dtype`` ``auto`` is then a 16-bit type), ``num_kv_blocks``, ``block_size``...)
    and ``SchedulingOptions`` (``max_num_seqs``, ``preemption_mode``...), by their Python names."""

    def __init__(self, model: str | None = None, tokenizer: str | None = None, **engine_kwargs: Any) -> None:
        from services.executor.weights import load_hf_config, load_weights

        source = resolve_model(model)
        tokenizer_source = resolve_tokenizer(tokenizer, source)  # before the slow part: a bad path is one line
        runner_options, scheduling = split_options(engine_kwargs)
        hf_config = load_hf_config(source)
        from services.executor.device import resolve_device

        device_type = resolve_device(runner_options.device).type
        runner = build_runner(hf_config, load_weights(source, hf_config, runner_options.quantization, device_type)[0],
                              runner_options)
        tokenizer = load_tokenizer(tokenizer_source, "--tokenizer" if tokenizer is not None else "--model")
        from services.frontend.generation_defaults import read_generation_defaults

        # as vLLM's LLM: generate(prompts) without sampling params samples as the model recommends
        recommended = read_generation_defaults("auto", source.directory)
        self._start(EngineCore(runner, scheduling), tokenizer, eos_token_ids(tokenizer, source),
                    SamplingParams(**recommended))

    @classmethod
    def from_hf_model(cls, hf_model: Any, tokenizer: Any = None, eos_token_ids: list[int] | None = None,
                      **engine_kwargs: Any) -> "LLM":
        """An engine over an in-memory Hugging Face causal LM (its config and weights). Without a
        tokenizer, prompts must be token ids and outputs have no text. ``eos_token_ids`` default to
        the tokenizer's, else the model config's."""
        llm = cls.__new__(cls)
        runner_options, scheduling = split_options(engine_kwargs)
        runner = build_runner(hf_model.config, hf_model.state_dict(), runner_options)
        if eos_token_ids is None:
            eos = tokenizer.eos_token_id if tokenizer is not None else hf_model.config.eos_token_id
            eos_token_ids = [int(t) for t in (eos if isinstance(eos, list) else [eos]) if t is not None]
        llm._start(EngineCore(runner, scheduling), tokenizer, eos_token_ids)
        return llm

    def _start(self, engine: EngineCore, tokenizer: Any, eos_token_ids: list[int],
               default_params: SamplingParams | None = None) -> None:
        self.engine = engine
        # what a prompt given no SamplingParams gets: the model's generation_config.json
        # recommendations (``services/frontend/generation_defaults.py``) over SamplingParams()'s
        self.default_sampling_params = default_params or SamplingParams()
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        if tokenizer is not None:
            vocab_size = engine.runner.model.config.vocab_size
            engine.runner.sampler.guided.load_vocabulary = lambda: vocabulary_of(tokenizer, vocab_size)
        self._request_ids = itertools.count()

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[PromptOutput]:
        """Run every prompt (text, tokenized here, or token ids) to the end, batched together;
        returns one ``PromptOutput`` per prompt, in order. ``sampling_params``: one for all prompts
        or one each (default: ``default_sampling_params``, the model's recommendations). Raises ``ValueError`` if the engine refuses a
        prompt (too long for the model or the KV pool), and ``SamplingParamsError`` (a ``ValueError``) for
        parameters the rulebook refuses (``shared.messages.sampling_rules``), before any prompt is queued."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        all_ids = [self._token_ids(prompt) for prompt in prompts]  # every prompt checked before any is queued
        for p in params:  # add_request checks again; here before any is queued
            self._check(p or self.default_sampling_params)
        results: dict[str, PromptOutput] = {}
        for prompt, token_ids, p in zip(prompts, all_ids, params):
            results[self.add_request(token_ids, p)] = PromptOutput(prompt if isinstance(prompt, str) else None,
                                                                   token_ids)
        pending = set(results)
        try:
            while pending:
                for out in self.engine.step():
                    if out.error is not None:
                        raise ValueError(f"prompt {list(results).index(out.request_id)}: {out.error}")
                    results[out.request_id].add(out)
                    if out.request_finished:
                        pending.discard(out.request_id)
        finally:
            for request_id in pending:
                self.engine.abort_request(request_id)
        for result, p in zip(results.values(), params):
            if p is not None and p.prompt_logprobs is not None and result.prompt_logprobs is None:
                result.prompt_logprobs = [None] * len(result.prompt_token_ids)  # one token: nothing to score
            for choice in result.choices:
                choice.text = self._detokenize(choice.token_ids)
        return list(results.values())

    def embed(self, prompts: str | list[int] | Sequence[str | list[int]], pooling: str = "last") -> list[np.ndarray]:
        """Each prompt's embedding, as the server's /v1/embeddings makes it: the final hidden
        states pooled (``last`` token or ``mean``) and L2-normalized, float32, batched together."""
        outputs = self.generate(prompts, SamplingParams(max_tokens=0, pooling=pooling))
        return [(out.embedding / np.linalg.norm(out.embedding.astype(np.float64))).astype(np.float32)
                for out in outputs]

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[PromptOutput]:
        """``generate`` on conversations (one, a list of ``{"role", "content"}`` messages, or a list of
        them) rendered by the tokenizer's chat template, or by ``chat_template`` (Jinja text) in its
        place, as vLLM's ``LLM.chat``; the outputs' ``prompt`` is the rendered text. Raises
        ``ValueError`` when there is no template or it cannot render these messages."""
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer to apply a chat template with")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            try:
                prompts.append(self.tokenizer.apply_chat_template(
                    list(conversation), chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                    tokenize=False))
            except Exception as exc:  # a Jinja template may raise anything; no template is a ValueError
                raise ValueError(f"cannot apply the chat template: {type(exc).__name__}: {exc}") from None
        # the rendered text holds the template's special tokens: tokenized without adding any (as chat
        # requests are), never re-tokenized into another BOS
        outputs = self.generate([list(self.tokenizer.encode(p, add_special_tokens=False)) for p in prompts],
                                sampling_params)
        for out, text in zip(outputs, prompts):
            out.prompt = text
        return outputs

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> str:
        """Queue one prompt and return its request id; ``engine.step()`` runs it and returns its
        ``RequestOutput`` deltas (``generate`` does both)."""
        request_id = f"offline-{next(self._request_ids)}"
        params = sampling_params or self.default_sampling_params
        params = dataclasses.replace(params, eos_token_ids=list(params.eos_token_ids or self.eos_token_ids))
        self._check(params)
        self.engine.add_request(AddRequest(request_id, np.asarray(self._token_ids(prompt), np.int32), params,
                                           time.time()))
        return request_id

    def _check(self, params: SamplingParams) -> None:
        """The rulebook's checks (``sampling_rules.verify``, the HTTP frontend's too: a
        ``SamplingParamsError``, a ``ValueError``), and a tokenizer for a guided request (its
        tokens' bytes)."""
        verify(params)
        if params.guided is not None and self.tokenizer is None:
            raise ValueError("guided decoding needs a tokenizer (its tokens' bytes)")

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's ids, each one the model embeds (a ``ValueError`` names the first that is not:
        a tokenizer of another model may have more tokens than the model's vocabulary)."""
        if not isinstance(prompt, str):
            ids = [int(t) for t in prompt]
        elif self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer: give prompts as token ids")
        else:
            ids = list(self.tokenizer.encode(prompt))
        vocab = self.engine.runner.model.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is out of range [0, {vocab}) (the model's vocabulary)")
        return ids

    def _detokenize(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
