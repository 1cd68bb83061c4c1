"""Request lengths shaped like the PagedAttention paper's two traces, and prompts of a given length.

The paper (Kwon et al., 2023, Fig. 11) samples from ShareGPT (long conversations: 161 input and
338 output tokens on average, long-tailed) and Alpaca (short instructions: 19 input and 58 output
tokens on average). We draw each length from a log-normal with the paper's mean (``sigma`` sets the
tail: wide for ShareGPT, narrow for Alpaca's inputs), then clip the pair to the model's context:
the prompt plus the chat template's ``overhead_tokens`` plus the output fit in ``max_model_len``.
Prompts are random common English words, each a single token for Llama-family tokenizers
(SmolLM2's included), so a prompt of ``n`` words is about ``n`` tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Tokens a chat template adds around one user message (SmolLM2's adds 30, with its system prompt).
CHAT_OVERHEAD_TOKENS = 64

_WORDS = tuple("""
the of and to in is was for on that with as by at from his her it an are were which this be or has
had not but their they one its also after first new two who been have more other time into all when
year there would during people over most made only world some these many city years state may up
him three can where used then about could century later under part out team than school both between
since national before while american war well known called area several found south north through
however including house such because life government west east season series university number
road early last music work members million general high four water family being group back film
best long major just even against same five great
""".split())


@dataclass(frozen=True)
class LengthDistribution:
    name: str
    mean_input_tokens: float
    mean_output_tokens: float
    sigma_input: float  # of the underlying normal: the log-normal's spread
    sigma_output: float

    def sample(self, rng: random.Random, max_model_len: int,
               overhead_tokens: int = CHAT_OVERHEAD_TOKENS) -> tuple[int, int]:
        """``(num_input_tokens, num_output_tokens)``, each at least 1, whose sum plus
        ``overhead_tokens`` stays within ``max_model_len``."""
        budget = max_model_len - overhead_tokens
        if budget < 2:
            raise ValueError(f"max_model_len {max_model_len} leaves no room after {overhead_tokens} template tokens")
        num_input = _lognormal_int(rng, self.mean_input_tokens, self.sigma_input, budget - 1)
        num_output = _lognormal_int(rng, self.mean_output_tokens, self.sigma_output, budget - num_input)
        return num_input, num_output


# sigma: ShareGPT's lengths span two orders of magnitude; Alpaca's instructions are short and even.
DATASETS = {
    "sharegpt": LengthDistribution("sharegpt", 161.31, 337.99, sigma_input=1.0, sigma_output=0.8),
    "alpaca": LengthDistribution("alpaca", 19.31, 58.45, sigma_input=0.5, sigma_output=0.8),
}


def _lognormal_int(rng: random.Random, mean: float, sigma: float, high: int) -> int:
    """A log-normal draw with mean ``mean``, rounded and clipped to ``[1, high]``."""
    mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, sigma))] = exp(mu + sigma^2 / 2)
    return int(min(high, max(1, round(rng.lognormvariate(mu, sigma)))))


def prompt_text(rng: random.Random, num_tokens: int) -> str:
    """About ``num_tokens`` tokens of random words (one token each)."""
    return " ".join(rng.choice(_WORDS) for _ in range(num_tokens))
