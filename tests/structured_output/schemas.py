"""Twenty JSON schemas of different shapes for the structured-output tests and benchmark, each
finite (bounded strings, arrays and numbers), so a small model's output always ends."""
from __future__ import annotations

_NAME = {"type": "string", "minLength": 1, "maxLength": 20}

SCHEMAS: dict[str, dict] = {
    "person": {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,8}\\.com$"}},
        "required": ["id", "email"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                                       "items": {"type": "string", "minLength": 1, "maxLength": 12}}},
             "required": ["tags"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "bounded_number": {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
                       "required": ["celsius"]},
    "optional": {"type": "object", "properties": {"active": {"type": "boolean"},
                                                  "nickname": {"type": "string", "maxLength": 10}},
                 "required": ["active"]},
    "points": {"type": "object", "properties": {"points": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"]}}}, "required": ["points"]},
    "phone": {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
              "required": ["phone"]},
    "const": {"type": "object", "properties": {"version": {"const": 2}, "name": _NAME},
              "required": ["version", "name"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "maxLength": 8}]}},
        "required": ["value"]},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                        "minItems": 3, "maxItems": 3},
    "nullable": {"type": "object", "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 10}},
                 "required": ["middle_name"]},
    "matrix": {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "required": ["matrix"]},
    "date": {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
             "required": ["date"]},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                                                  "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
                                 "required": ["lat", "lon"]}},
             "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
             "required": ["start", "end"]},
    "rating": {"type": "object", "properties": {"rating": {"enum": [1, 2, 3, 4, 5]},
                                                "comment": {"type": "string", "maxLength": 30}},
               "required": ["rating", "comment"]},
    "movie": {"type": "object", "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 30},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genres": {"type": "array", "maxItems": 3, "items": {"enum": ["drama", "comedy", "action", "horror"]}}},
        "required": ["title", "year", "genres"]},
    "code": {"type": "object", "properties": {"code": {"type": "string", "minLength": 4, "maxLength": 6}},
             "required": ["code"]},
    "one_of": {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1, "maximum": 50}},
         "required": ["kind", "radius"]},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 50}},
         "required": ["kind", "side"]}]}}, "required": ["shape"]},
    "exclusive": {"type": "object", "properties": {
        "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["count", "ratio"]},
}
