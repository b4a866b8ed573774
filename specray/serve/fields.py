"""Which request fields specray serves, which it accepts without acting on, and which it refuses.

No field is silently ignored: a field specray does not implement is a 400 naming it, unless its
value cannot change the output (a default such as ``frequency_penalty: 0``, ``tools: []``), and a
field it does not know at all is a 400 too (a typo, or another server's extension). The fields
that can never change the output (``user``, ``metadata``, ``store``...) are accepted and unused.
docs/serving.md lists the same tables.
"""

from __future__ import annotations

from specray.serve.errors import UnsupportedField

# Accepted and unused: bookkeeping that cannot change a generated token.
INERT = frozenset({
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
    "cache_salt",  # prefix-cache isolation: changes which pages are shared, never the output (issue 26)
})

# Known and not implemented; the values that leave the output unchanged are accepted.
_NO_EFFECT = {
    "best_of": (None, 1),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "prompt_logprobs": (None,),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "logits_processors": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
}
UNSUPPORTED = tuple(sorted(_NO_EFFECT))

_HINTS = {
    "prompt_logprobs": "use echo with logprobs on /v1/completions",
    "guided_json": "use response_format or structured_outputs",
    "guided_regex": "use structured_outputs.regex",
    "guided_choice": "use structured_outputs.choice",
    "guided_grammar": "use structured_outputs.grammar",
}

# A message's fields beyond role and content; None (an echoed assistant message's empty
# ``refusal``) cannot change the prompt.
MESSAGE_UNSUPPORTED = ("name", "tool_calls", "tool_call_id", "function_call", "audio", "refusal")


def check_fields(extra: dict | None, where: str = "") -> None:
    """Raise ``UnsupportedField`` for the first field of ``extra`` (the fields the request
    model does not declare) that would be ignored while it could change the output."""
    for name, value in (extra or {}).items():
        param = f"{where}{name}"
        if name in INERT:
            continue
        if name not in _NO_EFFECT:
            raise UnsupportedField(f"unknown field {param!r}: specray does not implement it, and ignoring it could "
                                   f"change what you get; leave it out", param=param)
        if value not in _NO_EFFECT[name]:
            hint = _HINTS.get(name)
            allowed = ", ".join(repr(v) for v in _NO_EFFECT[name])
            raise UnsupportedField(f"{param} ({value!r}) is not supported by specray"
                                   + (f" ({hint})" if hint else "") + f"; leave it out or send {allowed}",
                                   param=param)


def check_message_fields(index: int, extra: dict | None) -> None:
    for name, value in (extra or {}).items():
        if value is None:
            continue
        param = f"messages[{index}].{name}"
        known = "is not supported by specray" if name in MESSAGE_UNSUPPORTED else "is an unknown message field"
        raise UnsupportedField(f"{param} {known}: only role and text content are; leave it out", param=param)
