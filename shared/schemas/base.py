"""The record base and decoding: what every Kafka record shares, and how bytes become a record.

:class:`Record` carries ``schema`` (its name) and ``schema_version`` in each JSON object; :func:`decode`
validates one, and a record that fails goes to flywheel.dlq as a ``DeadLetter`` with the reason (see
``shared.kafka``). :func:`require_utf8` is the UTF-8 check that task bodies (and the sandbox's requests) run
before validation.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


def _non_utf8_path(value: Any) -> str | None:
    """Path (``a.0.b``) of the first string or key in ``value`` that cannot be UTF-8 encoded (a lone
    surrogate such as ``"\\ud800"`` in JSON), or None when every one can."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:  # the path may hold the bad key itself: show it escaped
                return (path or "(value)").encode("utf-8", "backslashreplace").decode("utf-8")
        elif isinstance(v, dict):
            for k, c in v.items():
                sub = f"{path}.{k}" if path else str(k)
                if isinstance(k, str):
                    stack.append((k, sub))
                stack.append((c, sub))
        elif isinstance(v, (list, tuple)):
            stack.extend((c, f"{path}.{i}" if path else str(i)) for i, c in enumerate(v))
    return None


def require_utf8(data: Any) -> Any:
    """``data`` unchanged; for a ``mode="before"`` model validator.

    Raises:
        ValueError: a string or key in ``data`` is not valid UTF-8 text; the message names its path.
    """
    bad = _non_utf8_path(data)
    if bad is not None:
        raise ValueError(f"{bad}: not valid UTF-8 text (a lone surrogate code point)")
    return data


def _record_json_schema(schema: dict[str, Any], cls: type) -> None:
    """Pydantic ``json_schema_extra`` hook of :class:`Record`: in a record's JSON Schema, ``schema`` and
    ``schema_version`` are the record's own constants (the model fields default to the base's) and required,
    as every encoded record carries them (``docs/schemas/``, ``shared.schema_export``)."""
    props = schema.setdefault("properties", {})
    props["schema"] = {"const": cls.SCHEMA, "default": cls.SCHEMA, "title": "Schema", "type": "string",
                       "description": "The record's schema name."}
    props["schema_version"] = {"const": cls.VERSION, "default": cls.VERSION, "title": "Schema Version",
                               "type": "integer", "description": "The record's schema version (decoders accept "
                               "only their own)."}
    rest = [r for r in schema.get("required", []) if r not in ("schema", "schema_version")]
    schema["required"] = ["schema", "schema_version", *rest]


class Record(BaseModel):
    """Base of every Kafka record: a schema name and version travel in each JSON object.

    Unknown fields are rejected (``extra="forbid"``): a record with a field this version does not know fails
    :func:`decode` and goes to the DLQ (``docs/schemas/README.md``, "Compatibility").
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, json_schema_extra=_record_json_schema)
    SCHEMA: ClassVar[str] = "record"
    VERSION: ClassVar[int] = 1
    READS: ClassVar[tuple[int, ...]] = ()
    """Older versions whose records are valid records of this version as they are (the new version only widened
    what is allowed, e.g. a new verifier kind): they decode, and are re-labelled with :attr:`VERSION`."""
    schema_: str = Field("record", alias="schema")
    schema_version: int = 1

    def __init__(self, **data: Any) -> None:
        data.setdefault("schema", self.SCHEMA)
        data.setdefault("schema_version", self.VERSION)
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _check_schema(cls, data: Any) -> Any:
        if isinstance(data, dict):
            name, ver = data.get("schema", cls.SCHEMA), data.get("schema_version", cls.VERSION)
            if name != cls.SCHEMA:
                raise ValueError(f"schema is {name!r}, expected {cls.SCHEMA!r}")
            if ver in cls.READS:
                data = {**data, "schema_version": cls.VERSION}
            elif ver != cls.VERSION:
                raise ValueError(f"schema version {ver} of {cls.SCHEMA!r} is not supported (want {cls.VERSION})")
        return data

    def encode(self) -> bytes:
        """The record as one orjson-encoded JSON object."""
        return orjson.dumps(self.model_dump(mode="json", by_alias=True))


R = TypeVar("R", bound=Record)


class DecodeError(ValueError):
    """A record that is not valid JSON or fails its schema; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def decode(raw: bytes | None, cls: type[R]) -> R:
    """Parse and validate one record of type ``cls``.

    Raises:
        DecodeError: the bytes are not a JSON object or fail validation (the reason names the field).
    """
    if raw is None:
        raise DecodeError("empty record value")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise DecodeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise DecodeError(f"not a JSON object but {type(obj).__name__}")
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(map(str, er['loc'])) or '<root>'}: {er['msg']}" for er in e.errors()[:5])
        raise DecodeError(f"{cls.SCHEMA} v{cls.VERSION} validation failed: {errs}") from None
