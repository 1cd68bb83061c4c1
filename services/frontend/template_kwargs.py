"""Chat's ``chat_template_kwargs`` (vLLM's field): more variables for the chat template, as
``{"enable_thinking": false}`` for Qwen3. An object; names the template already gets from the
request or from transformers (the messages, the tools, the generation prompt, the special tokens)
or that are ``apply_chat_template``'s own arguments are refused, as a 400 naming the field."""

from __future__ import annotations

from typing import Any

from services.frontend.errors import bad_request, json_type
from services.frontend.field_kinds import Custom

# the template's own variables (transformers' render) and apply_chat_template's own arguments
RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "processor_kwargs", "bos_token", "eos_token", "unk_token",
    "sep_token", "pad_token", "cls_token", "mask_token", "additional_special_tokens",
})


def read_template_kwargs(name: str, value: Any) -> dict[str, Any]:
    """``value`` checked: a JSON object whose keys the template does not already take."""
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object of variables for the chat template, got a JSON "
                          f"{json_type(value)}", name)
    taken = sorted(RESERVED & set(value))
    if taken:
        raise bad_request(f"{name} must not set {', '.join(taken)}: the chat template gets "
                          f"{'it' if len(taken) == 1 else 'them'} from the request or the tokenizer", name)
    return value


TEMPLATE_KWARGS = Custom(read_template_kwargs, {
    "type": "object", "description": "More variables for the chat template (vLLM's), as {\"enable_thinking\": "
                                     "false}; not the ones it gets already (messages, tools, "
                                     "add_generation_prompt, the special tokens...)."})
