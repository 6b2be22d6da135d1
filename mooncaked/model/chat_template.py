"""Chat templates: Hugging Face-compatible jinja2 rendering of a message list into a prompt string.

1. Compile once (`ChatTemplate(source, bos_token=..., eos_token=...)`) in a sandboxed, immutable jinja2
   environment configured as transformers does (trim_blocks, lstrip_blocks, loop controls, `{% generation %}`).
2. `render(messages, add_generation_prompt=True)` exposes the globals templates expect: `messages`,
   `add_generation_prompt`, `bos_token`, `eos_token`, `tools`, `raise_exception`, `strftime_now`, and the
   `tojson` filter that does not escape non-ASCII.
3. The rendered text is tokenized with `add_special_tokens=False` (the template writes its own specials).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML without a default system prompt: the template of random test models.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template rejected the messages (raise_exception) or failed to render; the message says why."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers in some templates) renders its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled template; immutable and shareable."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationBlock, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        _check_messages(messages)
        context = dict(extra)
        context.update(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                       tools=None if tools is None else [dict(t) for t in tools],
                       bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            return str(self._template.render(**context))
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not messages:
        raise ChatTemplateError("messages must contain at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{index}] must be an object with a string 'role'")
