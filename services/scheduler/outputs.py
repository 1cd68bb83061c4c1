"""What the scheduler tells the frontend: one sampled row of a step, and the ``RequestOutput``s built
from sequences (a choice's delta, a request's error, best_of's merged samples)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shared.messages import RequestOutput, StepResult

from .sequence import ErrorKind, FinishReason, Sequence


@dataclass(frozen=True)
class Sample:
    """Row ``row`` of a ``StepResult``: a sequence's sampled token and, when the step carries them,
    its logprob and the most likely tokens (as many as any sequence of the step asked for)."""

    token_id: int
    logprob: float | None = None
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    @classmethod
    def from_result(cls, result: StepResult, row: int) -> "Sample":
        token_id = int(result.token_ids[row])
        if len(result.logprobs) <= row:
            return cls(token_id)
        return cls(token_id, float(result.logprobs[row]), tuple(result.top_token_ids[row].tolist()),
                   tuple(result.top_logprobs[row].tolist()))


def delta(seq: Sequence, sample: Sample | None = None) -> RequestOutput:
    """The tokens of ``seq`` not yet sent, marking them sent. When ``sample`` (the last of them)
    carries logprobs and the sequence's sampling asked for some, the delta carries that token's."""
    new = seq.output_token_ids[seq.num_output_sent:]
    seq.num_output_sent = len(seq.output_token_ids)
    out = RequestOutput(
        request_id=seq.request_id, choice_idx=seq.choice_idx, new_token_ids=new,
        finish_reason=None if seq.finish_reason is None else seq.finish_reason.value,
        num_prompt_tokens=seq.num_prompt_tokens, num_preemptions=seq.num_preemptions,
        num_cached_tokens=seq.num_cached_tokens,
    )
    num_top = seq.sampling.logprobs
    if num_top is not None and sample is not None and sample.logprob is not None:
        out.logprobs.append(sample.logprob)
        out.top_token_ids.append(list(sample.top_token_ids[:num_top]))
        out.top_logprobs.append(list(sample.top_logprobs[:num_top]))
    return out


def error_output(request_id: str, message: str, kind: ErrorKind = ErrorKind.REQUEST) -> RequestOutput:
    """The one and last output of a request that failed (``kind``: whose fault it is)."""
    return RequestOutput(request_id, 0, [], finish_reason=FinishReason.ERROR.value, error=message,
                         request_finished=True, error_kind=kind.value)


def merged(deltas: list[RequestOutput], choice_idx: int, keep_logprobs: bool) -> RequestOutput:
    """One delta holding everything a held-back sequence produced, as choice ``choice_idx``."""
    last = deltas[-1]
    out = dataclasses.replace(last, choice_idx=choice_idx, new_token_ids=[], logprobs=[], top_token_ids=[],
                              top_logprobs=[])
    for d in deltas:
        out.new_token_ids += d.new_token_ids
        if keep_logprobs:
            out.logprobs += d.logprobs
            out.top_token_ids += d.top_token_ids
            out.top_logprobs += d.top_logprobs
    return out
