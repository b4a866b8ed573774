"""The structured-output request fields: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``), each
turned into one ``StructuredOutput`` for the engine. Whether the spec compiles is decided by
xgrammar on rank 0 when the request is added (a 400 saying why when it does not)."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specray.config import StructuredOutput


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict | bool = Field(alias="schema")
    strict: bool | None = None  # specray always follows the schema exactly


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _known_type(self):
        if self.type not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type {self.type!r} must be 'text', 'json_object' or 'json_schema'")
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format json_schema goes with type 'json_schema', and only with it")
        return self

    def structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        return StructuredOutput("json_schema", json.dumps(self.json_schema.json_schema))


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its constraints."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name in ("json_", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {[g.rstrip('_') for g in given] or 'none'}")
        return self

    def structured(self) -> StructuredOutput:
        if self.json_ is not None:
            return StructuredOutput("json_schema", self.json_ if isinstance(self.json_, str) else json.dumps(self.json_))
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.choice is not None:
            return StructuredOutput("choice", json.dumps(self.choice))
        if self.grammar is not None:
            return StructuredOutput("grammar", self.grammar)
        return StructuredOutput("json_object")
