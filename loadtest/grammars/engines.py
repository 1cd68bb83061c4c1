"""The guide engines compared, behind one small interface: ``compile(kind, spec)`` (kind ``json``,
``regex`` or ``grammar``; raises when the engine cannot), ``matcher(compiled)``, ``fill(matchers)``
(each one's mask for the next token, in the engine's own form, the timed part), ``allowed(masks, i)``
(the i-th as a boolean array over the vocabulary), ``accept(matcher, token)`` and
``accepting(matcher)``. Every engine runs on one thread: the executor's cores belong to the model."""

from __future__ import annotations

import json
from typing import Any

import numpy as np


def unpack(bitmask: np.ndarray, row: int, size: int) -> np.ndarray:
    """Row ``row`` of a 32-bit little-endian token bitmask as booleans."""
    return np.unpackbits(np.ascontiguousarray(bitmask[row]).view(np.uint8), bitorder="little")[:size].astype(bool)


class XGrammar:
    """xgrammar (vLLM's and SGLang's default): ``GrammarCompiler`` and ``GrammarMatcher``."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr, self.size = xgr, vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "json":
            return self._compiler.compile_json_schema(json.dumps(spec), any_whitespace=True)
        if kind == "regex":
            return self._compiler.compile_regex(spec)
        return self._compiler.compile_grammar(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)

    def fill(self, matchers: list) -> np.ndarray:
        bitmask = np.zeros((len(matchers), (self.size + 31) // 32), np.int32)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask

    def allowed(self, masks: np.ndarray, i: int) -> np.ndarray:
        return unpack(masks, i, self.size)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


class LLGuidance:
    """llguidance (vLLM's ``guidance`` backend): ``LLMatcher`` over Lark, regex or JSON schema."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.lln, self.size = llguidance, llguidance.numpy, vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, kind: str, spec: Any) -> Any:
        matcher = self.llg.LLMatcher
        if kind == "json":
            grammar = matcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": True})
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(spec)
        else:
            grammar = self.llg.grammar_from("gbnf", spec)
        is_error, messages = matcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise ValueError(messages[0])
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self._tokenizer, compiled)

    def fill(self, matchers: list) -> np.ndarray:
        bitmask = np.zeros((len(matchers), (self.size + 31) // 32), np.int32)
        self.lln.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return bitmask

    def allowed(self, masks: np.ndarray, i: int) -> np.ndarray:
        return unpack(masks, i, self.size)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token)) and not matcher.is_error()

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_accepting())


class OutlinesCore:
    """outlines-core (Outlines' and vLLM's former backend): a regex (JSON schemas through
    ``build_regex_from_schema``) compiled to a token-level DFA ``Index`` ahead of time."""

    name = "outlines-core"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import outlines_core

        from services.executor.guided import vocabulary_of

        self.oc, self.size = outlines_core, vocab_size
        llg_tokenizer = vocabulary_of(tokenizer, vocab_size)  # each token's bytes, as llguidance reads them
        vocab: dict[bytes, list[int]] = {}
        for token in range(vocab_size):
            data = llg_tokenizer.decode_bytes([token])
            if data and not llg_tokenizer.is_special_token(token):  # special tokens have no bytes
                vocab.setdefault(data, []).append(token)
        self._vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, vocab)

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "grammar":
            raise ValueError("no context-free grammars")
        regex = (self.oc.json_schema.build_regex_from_schema(json.dumps(spec), r"[\n\t ]{0,32}") if kind == "json"
                 else spec)  # the whitespace the other engines allow
        return self.oc.Index(regex, self._vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matchers: list) -> list:
        return [np.asarray(m.get_tokens(), np.int64) for m in matchers]

    def allowed(self, masks: list, i: int) -> np.ndarray:
        allowed = np.zeros(self.size + 1, bool)
        allowed[masks[i]] = True
        return allowed[:self.size]

    def accept(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token)
        except Exception:  # noqa: BLE001 - outlines-core raises ValueError-like errors for refused tokens
            return False
        return True

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_finished())


class Executor:
    """pagedserve's executor (``services.executor.guided.GuidedSequences``): a matcher per sequence
    fed its new tokens from the sequence's history, the masks of a step filled together
    (``masks``: ``fill_next_token_bitmask_par`` over torch's threads) and turned into the token sets
    the sampler applies. ``executor-alone``: each row through ``mask``, one after another (the
    executor before the batched path)."""

    name = "executor"
    together = True

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        from services.executor.guided import GuidedSequences, vocabulary_of
        from services.executor.histories import TokenHistories

        self.size, self.eos = vocab_size, [tokenizer.eos_token_id]
        vocabulary = vocabulary_of(tokenizer, vocab_size)
        self.histories = TokenHistories()
        self.guided = GuidedSequences(self.histories, lambda: vocabulary)
        self._next_id = 0
        self._outputs: dict[int, list[int]] = {}

    def compile(self, kind: str, spec: Any) -> Any:
        from shared.structured import compile_guide

        key = {"json": "json_schema", "regex": "regex", "grammar": "grammar"}[kind]
        text = json.dumps({key: spec})
        compile_guide(text)
        return text

    def matcher(self, compiled: Any) -> Any:
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._outputs[seq_id] = []
        self._record(seq_id)
        self.guided.add(seq_id, compiled)
        return seq_id

    def _record(self, seq_id: int) -> None:
        from shared.messages import NewSequence, SamplingParams

        self.histories.add(NewSequence(seq_id=seq_id, request_id=str(seq_id), num_prompt_tokens=0,
                                       token_ids=np.asarray(self._outputs[seq_id], np.int32), sampling=SamplingParams()))

    def fill(self, matchers: list) -> list:
        if self.together:
            return self.guided.masks([(seq_id, self.eos) for seq_id in matchers])
        return [self.guided.mask(seq_id, self.eos) for seq_id in matchers]

    def allowed(self, masks: list, i: int) -> np.ndarray:
        return masks[i].as_mask(self.size)

    def accept(self, matcher: Any, token: int) -> bool:
        self._outputs[matcher].append(token)
        self._record(matcher)
        return True

    def accepting(self, matcher: Any) -> bool:
        return bool(self.guided._matcher(self.guided._seqs[matcher], matcher).is_accepting())


class ExecutorAlone(Executor):
    name = "executor-alone"
    together = False


ENGINES = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines": OutlinesCore, "executor": Executor,
           "executor-alone": ExecutorAlone}
