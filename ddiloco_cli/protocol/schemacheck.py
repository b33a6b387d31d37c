"""A fast yes/no check of a record against its JSON schema, for the hot read paths.

``jsonschema`` walks a schema generically and takes 0.5-1.3 ms for a 1-2 kB
manifest, which a learner pays for every version it receives. ``compile_schema``
turns a schema into nested closures once; checking a record is then a few
dictionary lookups per field. The common shapes compile to one function each: an
object's (its properties, required keys, additional properties and if/then) and a
number's or string's leaf (type, bounds, length, pattern, format, also "or null"),
which check exact JSON types (a subclass gets a no, and jsonschema the last word).
It supports exactly the keywords our schemas use (``type``, ``properties``,
``required``, ``additionalProperties``, ``items``, ``minItems``/``maxItems``,
``minimum``/``maximum`` and their exclusive forms, ``maxLength``, ``pattern``,
``const``, ``enum``, ``format``, ``if``/``then``, local ``$ref``) with jsonschema's semantics (an integral float is an integer, a
bool is neither a number nor equal to 1, ``pattern`` searches, each keyword
applies only to its own instance type) and refuses to compile anything else
(``Unsupported``), so a schema change cannot silently weaken a check.

It only says yes or no: ``records.validate`` accepts on yes and asks jsonschema,
which stays the authority and writes the error message, on no. A record is
therefore accepted only when this check accepts it, and the test suite checks
that both agree on valid and mutated records.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping

Check = Callable[[Any], bool]

_ANNOTATIONS = {"$schema", "$id", "$defs", "title", "description", "default", "examples", "$comment"}


class Unsupported(ValueError):
    """The schema uses a keyword (or form) this checker does not implement."""


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_TYPES: dict[str, Check] = {
    "object": lambda x: isinstance(x, dict),
    "array": lambda x: isinstance(x, list),
    "string": lambda x: isinstance(x, str),
    "boolean": lambda x: isinstance(x, bool),
    "null": lambda x: x is None,
    "number": _is_number,
    "integer": lambda x: (isinstance(x, int) and not isinstance(x, bool))
    or (isinstance(x, float) and x.is_integer()),
}


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality as jsonschema's const/enum see it: 1 == 1.0, but True != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _is_number(a) and _is_number(b):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# Records are checked on every bucket read: the closures below are plain loops and
# short-circuit chains (a generator per check costs more than the check).
def _all_of(checks: list[Check]) -> Check:
    if len(checks) == 1:
        return checks[0]
    if len(checks) == 2:
        a, b = checks
        return lambda x: a(x) and b(x)
    if len(checks) == 3:
        a, b, c = checks
        return lambda x: a(x) and b(x) and c(x)

    def check_all(x: Any) -> bool:
        for c in checks:
            if not c(x):
                return False
        return True
    return check_all


def _any_of(checks: list[Check]) -> Check:
    if len(checks) == 1:
        return checks[0]
    return lambda x: any(c(x) for c in checks)


def _equal_to_one_of(options: list[Any]) -> Check:
    """``const`` / ``enum``: json_equal to one of ``options``. Strings only equal strings,
    so a set lookup decides for them."""
    if all(isinstance(o, str) for o in options):
        strings = frozenset(options)
        return lambda x: isinstance(x, str) and x in strings
    return lambda x: any(json_equal(x, o) for o in options)


def compile_schema(schema: Mapping[str, Any], *, formats: Mapping[str, Check]) -> Check:
    """A function record -> bool equivalent to validating against ``schema`` (draft 2020-12,
    the keyword subset above; ``formats`` maps a format name to its check). Raises
    Unsupported for anything else."""
    return _Compiler(schema, formats).compile(schema)


def _value_keyword(key: str, value: Any) -> Check | None:
    """The check of a keyword that looks at the instance alone (no subschema), or None."""
    if key == "required":
        names = frozenset(value)
        return lambda x: not isinstance(x, dict) or x.keys() >= names
    if key == "minItems":
        return lambda x: not isinstance(x, list) or len(x) >= value
    if key == "maxItems":
        return lambda x: not isinstance(x, list) or len(x) <= value
    if key == "minimum":
        return lambda x: not _is_number(x) or x >= value
    if key == "maximum":
        return lambda x: not _is_number(x) or x <= value
    if key == "exclusiveMinimum":
        return lambda x: not _is_number(x) or x > value
    if key == "exclusiveMaximum":
        return lambda x: not _is_number(x) or x < value
    if key == "maxLength":
        return lambda x: not isinstance(x, str) or len(x) <= value
    if key == "pattern":
        regex = re.compile(value)
        return lambda x: not isinstance(x, str) or regex.search(x) is not None
    if key == "const":
        return _equal_to_one_of([value])
    if key == "enum":
        return _equal_to_one_of(list(value))
    return None


def _each_value(check: Callable[[str, Any], bool]) -> Check:
    """A check that every (key, value) of a dict instance passes (anything else passes)."""
    def check_dict(x: Any) -> bool:
        if isinstance(x, dict):
            for k, v in x.items():
                if not check(k, v):
                    return False
        return True
    return check_dict


def _each_item(item: Check) -> Check:
    def check_items(x: Any) -> bool:
        if isinstance(x, list):
            for v in x:
                if not item(v):
                    return False
        return True
    return check_items


_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "if", "then"}
_SCALAR_KEYS = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "maxLength", "pattern", "format"}


def _scalar(k: Mapping[str, Any], formats: Mapping[str, Check]) -> Check | None:
    """One function for a number or string leaf (``type`` "integer", "number" or "string", or
    one of them with "null", and their bounds, length, pattern and format), or None. It checks
    exact types (``type(x) is int``), which is what JSON parses to; anything else (a subclass)
    it refuses, and jsonschema, asked on every no, decides."""
    names = k.get("type")
    names = [names] if isinstance(names, str) else list(names) if isinstance(names, list) else []
    null = "null" in names
    kinds = [n for n in names if n != "null"]
    if len(kinds) != 1 or kinds[0] not in ("integer", "number", "string") or not set(k) <= _SCALAR_KEYS:
        return None
    if kinds[0] == "string":
        if any(key in k for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            return None
        longest = k.get("maxLength", math.inf)
        regex = re.compile(k["pattern"]) if "pattern" in k else None
        if "format" in k and k["format"] not in formats:
            raise Unsupported(f"format {k['format']!r}")
        fmt = formats.get(k["format"]) if "format" in k else None

        def check_string(x: Any) -> bool:
            if type(x) is str:
                return len(x) <= longest and (regex is None or regex.search(x) is not None) and (fmt is None or fmt(x))
            return null and x is None
        return check_string
    if any(key in k for key in ("maxLength", "pattern", "format")):
        return None
    integer = kinds[0] == "integer"
    lo, hi = k.get("minimum", -math.inf), k.get("maximum", math.inf)
    above, below = k.get("exclusiveMinimum", -math.inf), k.get("exclusiveMaximum", math.inf)

    def check_number(x: Any) -> bool:
        t = type(x)
        if t is not int and (t is not float or (integer and not x.is_integer())):
            return null and x is None
        return lo <= x <= hi and above < x < below
    return check_number


class _Compiler:
    """One schema's compilation: its ``$defs`` compiled once, referred to late-bound (a
    definition may refer to itself)."""

    def __init__(self, schema: Mapping[str, Any], formats: Mapping[str, Check]):
        self.defs: Mapping[str, Any] = schema.get("$defs", {})
        self.formats = formats
        self.compiled_defs: dict[str, Check] = {}

    def compile(self, schema: Mapping[str, Any]) -> Check:
        for name, sub in self.defs.items():
            self.compiled_defs[name] = self.node(sub)
        return self.node(schema)

    def ref(self, target: str) -> Check:
        prefix = "#/$defs/"
        if not target.startswith(prefix) or target[len(prefix):] not in self.defs:
            raise Unsupported(f"$ref {target!r}")
        name, compiled = target[len(prefix):], self.compiled_defs

        def check(x: Any) -> bool:  # late-bound: a definition may refer to itself
            return compiled[name](x)
        return check

    def node(self, s: Any) -> Check:
        if s is True:
            return lambda x: True
        if s is False:
            return lambda x: False
        if not isinstance(s, dict):
            raise Unsupported(f"schema {s!r}")
        keywords = {key: value for key, value in s.items() if key not in _ANNOTATIONS}
        fused = _scalar(keywords, self.formats) or self._object(keywords)
        if fused is not None:
            return fused
        return _all_of([self.keyword(key, value, s) for key, value in keywords.items()])

    def _object(self, k: Mapping[str, Any]) -> Check | None:
        """One function for an object's schema (``type`` "object" or none, ``properties``,
        ``required``, ``additionalProperties``, ``if``/``then``: the records', their entries' and
        their conditions' shape): a dict lookup and one check a property."""
        typed = "type" in k
        if (typed and k["type"] != "object") or not set(k) <= _OBJECT_KEYS or ("then" in k) != ("if" in k):
            return None
        props = {name: self.node(sub) for name, sub in k.get("properties", {}).items()}
        required = frozenset(k.get("required", ()))
        closed = k.get("additionalProperties", True) is not True  # else only the named properties are looked at
        extra, get, named = self.node(k.get("additionalProperties", True)), props.get, list(props.items())
        cond = self.node(k["if"]) if "if" in k else None
        then = self.node(k["then"]) if "then" in k else None

        def check_object(x: Any) -> bool:
            if type(x) is not dict:
                # properties, required and additionalProperties hold for anything but an object
                return not typed and not isinstance(x, dict) and (cond is None or not cond(x) or then(x))
            if not x.keys() >= required:
                return False
            if closed:
                for key, v in x.items():
                    p = get(key)
                    if not (extra(v) if p is None else p(v)):
                        return False
            else:
                for name, p in named:
                    if name in x and not p(x[name]):
                        return False
            return cond is None or not cond(x) or then(x)
        return check_object

    def keyword(self, key: str, value: Any, s: Mapping[str, Any]) -> Check:
        simple = _value_keyword(key, value)
        if simple is not None:
            return simple
        if key == "type":
            names = [value] if isinstance(value, str) else list(value)
            if not names or any(n not in _TYPES for n in names):
                raise Unsupported(f"type {value!r}")
            return _any_of([_TYPES[n] for n in names])
        if key == "properties":
            props = {name: self.node(sub) for name, sub in value.items()}
            return _each_value(lambda k, v: (p := props.get(k)) is None or p(v))
        if key == "additionalProperties":
            if "patternProperties" in s:
                raise Unsupported("additionalProperties with patternProperties")
            known, extra = frozenset(s.get("properties", {})), self.node(value)
            return _each_value(lambda k, v: k in known or extra(v))
        if key == "items":
            if "prefixItems" in s:
                raise Unsupported("prefixItems")
            return _each_item(self.node(value))
        if key == "format":
            if value not in self.formats:
                raise Unsupported(f"format {value!r}")
            fmt = self.formats[value]
            return lambda x: not isinstance(x, str) or fmt(x)
        return self.conditional(key, value, s)

    def conditional(self, key: str, value: Any, s: Mapping[str, Any]) -> Check:
        if key == "if":
            if "else" in s:
                raise Unsupported("else")
            cond, then = self.node(value), self.node(s.get("then", True))
            return lambda x: not cond(x) or then(x)
        if key == "then":
            if "if" not in s:
                raise Unsupported("then without if")
            return lambda x: True  # applied by "if"
        if key == "$ref":
            return self.ref(value)
        raise Unsupported(f"keyword {key!r}")
