"""Chat templates: a conversation rendered to prompt text by the model's own Jinja template.

Templates come from model files, so they are untrusted code: they run in jinja2's immutable
sandbox, with the environment transformers gives them (trim_blocks, lstrip_blocks, loop
controls, a ``tojson`` that does not escape HTML, ``raise_exception`` and ``strftime_now``), so
that the same template renders the same text here and in transformers.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRejection(jinja2.exceptions.TemplateError):
    """Raised by a template's own ``raise_exception(message)``: the conversation is not one it accepts."""


def _raise_exception(message):
    raise TemplateRejection(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes <, >, & and ' for HTML; prompts need the characters themselves.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string):
    return datetime.now().strftime(format_string)


def compile_chat_template(template: str) -> jinja2.Template:
    """The template compiled in the sandbox; a syntax error is a ValueError naming the line."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ValueError(f"the chat template does not parse (line {error.lineno}): {error.message}") from error


def check_messages(messages) -> list[dict]:
    """A conversation is a non-empty list of dicts whose "role" and "content" are strings (other
    keys are passed through to the template); a ValueError names the first message that is not."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{'role': str, 'content': str}} dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty; a conversation needs at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {index} is a {type(message).__name__}, not a dict with 'role' and 'content'")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"message {index} has no {key!r} key; every message needs 'role' and 'content'")
            if not isinstance(message[key], str):
                raise ValueError(f"message {index} has a {key!r} of type {type(message[key]).__name__}; "
                                 f"it must be a str")
    return [dict(message) for message in messages]


def render_chat(template: jinja2.Template | None, messages, *, model_name: str, add_generation_prompt: bool = True,
                bos_token: str | None = None, eos_token: str | None = None, **kwargs) -> str:
    """The prompt text for ``messages``. ``template`` None (the model has none), a bad conversation,
    or one the template rejects through ``raise_exception`` is a ValueError saying which."""
    if template is None:
        raise ValueError(f"model {model_name} has no chat template; pass a prompt (text or token ids) instead "
                         f"of chat messages")
    messages = check_messages(messages)
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                               eos_token=eos_token, **kwargs)
    except TemplateRejection as error:
        raise ValueError(f"the chat template of {model_name} rejects this conversation: {error.message}") from error
    except jinja2.exceptions.TemplateError as error:
        raise ValueError(f"the chat template of {model_name} failed to render: {error}") from error
