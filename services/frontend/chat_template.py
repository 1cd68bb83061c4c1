"""``--chat-template``: the Jinja chat template ``/v1/chat/completions`` renders messages with, in
place of the tokenizer's own (or where it has none, as OPT's tokenizer), taken as vLLM's flag of the
same name takes it: a file's path, or the template itself on one line (its ``\\n`` and other
escapes decoded). Checked when the flags are read, so that a missing file or a template Jinja
cannot parse stops the server at start with one line, not every chat request later."""

from __future__ import annotations

import codecs
import os

_JINJA_MARKS = ("{{", "{%", "{#")


def resolve_chat_template(value: str | None) -> str | None:
    """The template ``value`` names (a file) or is (inline); None for None. Raises ``ValueError``."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError("--chat-template must not be empty")
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template: cannot read {value}: {getattr(exc, 'strerror', None) or exc}") from None
    elif any(mark in value for mark in _JINJA_MARKS):
        try:
            template = codecs.decode(value, "unicode_escape")
        except UnicodeDecodeError as exc:
            raise ValueError(f"--chat-template: a bad escape in the inline template: {exc.reason}") from None
    else:
        raise ValueError(f"--chat-template {value}: no such file (an inline template holds Jinja tags: "
                         "{{ ... }} or {% ... %})")
    check_chat_template(template)
    return template


def check_chat_template(template: str) -> None:
    """Raise ``ValueError`` (one line) unless Jinja parses ``template`` as transformers will render it:
    sandboxed, with the loop controls (``{% break %}``, ``{% continue %}``) and the
    ``{% generation %}`` block that transformers' chat templates may use. Only the syntax is
    checked here; filters and names are looked up when a request renders it."""
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):  # transformers' {% generation %} ... {% endgeneration %}, parsed only
        tags = {"generation"}

        def parse(self, parser) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols", GenerationBlock]).parse(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: not a valid Jinja template: {exc.message} (line {exc.lineno})") from None
