"""JSON schemas the structured-output tests share (each a bounded one: a random model's instance
always ends within a few dozen tokens)."""

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "maxItems": 3},
    "ok": {"type": "boolean"},
}, "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
