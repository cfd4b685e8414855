"""JSON Schema checks that need neither torch nor xgrammar: the HTTP server checks a tool's parameters with them
without loading what grammar-constrained decoding needs (the scheduler's side)."""

from __future__ import annotations

from typing import Any

import jsonschema

from minisgl.errors import GrammarError


def check_json_schema(schema: Any) -> None:
    """Raise GrammarError unless schema is valid under its JSON Schema meta-schema (default 2020-12)."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GrammarError(f"invalid JSON schema at {where}: {e.message}") from e
