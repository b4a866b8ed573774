"""Ten JSON schemas of different shapes for the structured-output tests, each with a question
that asks a small model for an instance of it."""

from __future__ import annotations

SCHEMAS = [
    ("Describe a person as JSON.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
      "required": ["name", "age"], "additionalProperties": False}),
    ("Give the coordinates of Paris as JSON.",
     {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                       "lon": {"type": "number", "minimum": -180, "maximum": 180}},
      "required": ["lat", "lon"], "additionalProperties": False}),
    ("List three fruits as a JSON array of strings.",
     {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}),
    ("What colour is the sky? Answer as JSON.",
     {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
      "additionalProperties": False}),
    ("Describe a book with its author as nested JSON.",
     {"type": "object", "properties": {
         "title": {"type": "string", "maxLength": 30},
         "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                     "born": {"type": "integer", "minimum": 1000, "maximum": 2025}},
                    "required": ["name", "born"], "additionalProperties": False}},
      "required": ["title", "author"], "additionalProperties": False}),
    ("Is water wet? Answer as JSON with a boolean.",
     {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
      "additionalProperties": False}),
    ("Give two points of a line as JSON.",
     {"type": "object", "properties": {"points": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
         "type": "object", "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                                          "y": {"type": "integer", "minimum": -10, "maximum": 10}},
         "required": ["x", "y"], "additionalProperties": False}}},
      "required": ["points"], "additionalProperties": False}),
    ("Rate a movie from 1 to 5 as JSON, with a short comment.",
     {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                       "comment": {"type": ["string", "null"], "maxLength": 40}},
      "required": ["stars", "comment"], "additionalProperties": False}),
    ("Give a temperature reading as JSON.",
     {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60},
                                       "unit": {"const": "C"}},
      "required": ["celsius", "unit"], "additionalProperties": False}),
    ("Describe a shop's opening days as JSON.",
     {"type": "object", "properties": {
         "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                  "minItems": 1, "maxItems": 7},
         "open": {"type": "boolean"}},
      "required": ["days", "open"], "additionalProperties": False}),
]
