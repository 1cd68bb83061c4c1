"""Copy a sampled token's logprobs from a ``StepResult`` row into the frontend's delta."""

from __future__ import annotations

from shared.messages import RequestOutput, StepResult


def attach_logprobs(delta: RequestOutput, result: StepResult, row: int, num_top: int | None) -> None:
    """Give ``delta`` (whose last new token was sampled in ``result`` row ``row``) that token's
    logprob and its ``num_top`` most likely alternatives. Nothing when the request asked for no
    logprobs (``num_top`` None) or the result carries none."""
    if num_top is None or len(result.logprobs) <= row:
        return
    delta.logprobs.append(float(result.logprobs[row]))
    delta.top_token_ids.append(result.top_token_ids[row, :num_top].tolist())
    delta.top_logprobs.append(result.top_logprobs[row, :num_top].tolist())
