"""What the frontend knows about the served model: its name, tokenizer, context length, EOS ids."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from services.frontend.config import FrontendConfig
from services.frontend.generation_defaults import max_tokens_limit, read_generation_defaults
from services.frontend.tool_parsers import auto_tool_parser
from services.frontend.input_limits import body_limit_bytes, longest_token_chars, max_prompt_chars
from shared.hf_config import load_hf_config, model_shape, read_config_json
from shared.model_source import ModelSource, eos_token_ids, load_tokenizer, resolve_model, resolve_tokenizer

log = structlog.get_logger()


@dataclass(frozen=True)
class ServedModel:
    """Everything a route needs about the model. ``tokenizer`` is a Hugging Face tokenizer;
    ``max_token_chars`` (measured from it when left 0) bounds the characters one token covers."""

    name: str
    tokenizer: Any
    max_model_len: int
    eos_token_ids: list[int]
    created: int = field(default_factory=lambda: int(time.time()))
    max_token_chars: int = 0
    # request field -> the model's recommended default (``generation_defaults``; {}: OpenAI's)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # rows of the model's embedding (its config's vocab_size; None: not known, as for a GGUF file)
    model_vocab_size: int | None = None
    # the most tokens any request generates (``generation_defaults.max_tokens_limit``; None: no limit)
    max_tokens_limit: int | None = None
    # --reasoning-parser (``reasoning``): chat's answers split into reasoning and content (None: not)
    reasoning_parser: str | None = None
    # the parser of tool_choice "auto" (``tool_parsers``; None: "auto" answers 400)
    tool_parser: str | None = None
    # how embedding requests pool (--pooling-type); the dimensions a Matryoshka model allows
    # (``matryoshka_dimensions``: empty, any; None: not a Matryoshka model, ``dimensions`` is a 400)
    pooling: str = "last"
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.max_token_chars:
            object.__setattr__(self, "max_token_chars", longest_token_chars(self.tokenizer))

    @property
    def vocab_size(self) -> int:
        """Token ids a request may hold: the tokenizer's, and no more than the model embeds (a
        ``--tokenizer`` of another model may have more; a model's padded vocabulary has more rows
        than its tokenizer has tokens)."""
        if self.model_vocab_size is None:
            return len(self.tokenizer)
        return min(len(self.tokenizer), self.model_vocab_size)

    @property
    def max_prompt_chars(self) -> int:
        """More characters than this cannot fit in ``max_model_len`` tokens (see ``input_limits``)."""
        return max_prompt_chars(self.max_model_len, self.max_token_chars)

    @property
    def body_limit_bytes(self) -> int:
        return body_limit_bytes(self.max_model_len, self.max_token_chars)


def model_max_len(source: ModelSource, config: Any = None) -> int:
    """``max_position_embeddings`` from the model's config (GGUF metadata for a .gguf file), read
    here unless the caller has ``config`` already."""
    config = load_hf_config(source) if config is None else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot find the context length in {source.directory}'s config; pass --max-model-len")


def load_served_model(config: FrontendConfig) -> ServedModel:
    """Resolve ``config.model``, load its tokenizer and settle the context length (slow: seconds)."""
    source = resolve_model(config.model, convert_gguf=False)  # the executors convert a GGUF file's weights
    model_vocab_size, hf_config, matryoshka = None, None, None
    if source.gguf_file is None:  # a broken config.json is one line, before the tokenizer trips on it
        config_json = read_config_json(source.directory)
        model_vocab_size = model_shape(config_json, f"--model {source.directory}").vocab_size
        matryoshka = matryoshka_dimensions(config_json)
    elif config.tokenizer is not None:  # a GGUF model with another tokenizer: its vocabulary bounds the ids
        hf_config = load_hf_config(source)  # (GGUF metadata: parsed once, for the context length too)
        model_vocab_size = model_shape(hf_config.to_dict(), f"--model {source.where}").vocab_size
    tokenizer_source = resolve_tokenizer(config.tokenizer, source)
    started = time.monotonic()
    log.info("loading tokenizer", model=source.name, directory=tokenizer_source.directory,
             gguf_file=tokenizer_source.gguf_file, from_flag=config.tokenizer is not None)
    tokenizer = load_tokenizer(tokenizer_source, "--tokenizer" if config.tokenizer is not None else "--model")
    log.info("tokenizer loaded", seconds=round(time.monotonic() - started, 2), vocab_size=len(tokenizer))
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template  # --chat-template: the one chat requests render with
    log.info("chat template", source="--chat-template" if config.chat_template is not None
             else "tokenizer" if getattr(tokenizer, "chat_template", None) else "none (chat requests answer 400)")
    tool_parser = auto_tool_parser(config.enable_auto_tool_choice, config.tool_call_parser,
                                   getattr(tokenizer, "chat_template", None))
    if tool_parser is not None:
        log.info('tool_choice "auto" enabled', tool_call_parser=tool_parser,
                 source="--tool-call-parser" if config.tool_call_parser else "the chat template")
    generation_defaults = read_generation_defaults(config.generation_config, source.directory)
    if generation_defaults:
        log.warning("sampling defaults from the model's generation config: requests that leave these out get "
                    "them (--generation-config vllm: OpenAI's defaults instead)", **generation_defaults)
    max_model_len = config.max_model_len
    if max_model_len is None:
        log.info("reading the model config for max_model_len")
        max_model_len = model_max_len(source, hf_config)
    return ServedModel(
        name=config.served_model_name or source.name,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids(tokenizer, source),
        generation_defaults=generation_defaults,
        model_vocab_size=model_vocab_size,
        max_tokens_limit=max_tokens_limit(config.generation_config, generation_defaults),
        reasoning_parser=config.reasoning_parser,
        tool_parser=tool_parser,
        pooling=config.pooling_type,
        matryoshka_dimensions=matryoshka,
    )


def matryoshka_dimensions(config_json: dict[str, Any]) -> tuple[int, ...] | None:
    """The dimensions a Matryoshka embedding model may be truncated to, as vLLM reads its config:
    ``matryoshka_dimensions`` (those), or ``is_matryoshka`` true (any); None: not one."""
    dims = config_json.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
        return tuple(dims)
    return () if config_json.get("is_matryoshka") is True else None
