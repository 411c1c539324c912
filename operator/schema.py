"""pydantic JSON schema -> Kubernetes structural schema (what a CRD's openAPIV3Schema must be).

Kubernetes wants every node typed and self-contained: no $ref, no type-carrying anyOf/oneOf, no
`additionalProperties: false` beside `properties`, OpenAPI 3.0 `nullable` and boolean exclusive bounds.
Discriminated unions become one object holding every variant's properties, the tag an enum of the variants;
the CRD is the first line of defence, pydantic (`parse_job` in the operator) remains the authority.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from pydantic import BaseModel

# Keywords that mean the same in JSON Schema and in Kubernetes' OpenAPI v3 subset.
KEPT = ("type", "format", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern",
        "minItems", "maxItems", "minProperties", "maxProperties", "description")


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of a pydantic model (aliases as field names; no defaults: pydantic fills them)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _Converter(raw.get("$defs", {}), _model_classes(model)).node(raw, owner=model.__name__)


class _Converter:
    def __init__(self, defs: dict[str, Any], classes: dict[str, type[BaseModel]]):
        self.defs = defs
        self.classes = classes

    def node(self, schema: dict[str, Any], owner: str | None = None) -> dict[str, Any]:
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[1]
            return self.node(self.defs[name], owner=name) | _described(schema)
        if "oneOf" in schema or "anyOf" in schema:
            return self.union(schema)
        out = {key: schema[key] for key in KEPT if key in schema}
        if "const" in schema:
            out["enum"] = [schema["const"]]
        for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if bound in schema:
                out[plain], out[bound] = schema[bound], True
        if schema.get("type") == "array":
            out["items"] = self.node(schema["items"])
        if schema.get("type") == "object":
            out |= self.object_body(schema, owner)
        return out

    def object_body(self, schema: dict[str, Any], owner: str | None) -> dict[str, Any]:
        if "properties" in schema:
            docs = _field_docs(self.classes[owner]) if owner in self.classes else {}
            props = {}
            for name, prop in schema["properties"].items():
                props[name] = self.node(prop)
                if name in docs and "description" not in props[name]:
                    props[name]["description"] = docs[name]
            body: dict[str, Any] = {"properties": props}
            if schema.get("required"):
                body["required"] = list(schema["required"])
            return body
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            return {"additionalProperties": self.node(extra)}
        # dict[str, Any]: free-form by design.
        return {"x-kubernetes-preserve-unknown-fields": True}

    def union(self, schema: dict[str, Any]) -> dict[str, Any]:
        options = schema.get("oneOf") or schema["anyOf"]
        variants = [o for o in options if o.get("type") != "null"]
        nullable = len(variants) < len(options)
        if len(variants) == 1:
            out = self.node(variants[0])
        else:
            out = _merge_variants([self.node(v) for v in variants])
        if nullable:
            out["nullable"] = True
        return out | _described(schema)


def _merge_variants(variants: list[dict[str, Any]]) -> dict[str, Any]:
    """A tagged union as one object: every variant's properties, only the common ones required."""
    if any(v.get("type") != "object" for v in variants):
        return {"x-kubernetes-preserve-unknown-fields": True}
    props: dict[str, Any] = {}
    for variant in variants:
        for name, prop in variant["properties"].items():
            props[name] = _loosen(props[name], prop) if name in props else prop
    required = set.intersection(*(set(v.get("required", [])) for v in variants))
    if "type" in props:
        required.add("type")  # the discriminator: pydantic needs it to pick a variant
    lines = [f"{v['properties']['type']['enum'][0]}: {v.get('description', '')}".strip()
             for v in variants if "type" in v["properties"]]
    merged: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        merged["required"] = sorted(required)
    if lines:
        merged["description"] = "One of, by `type`: " + " | ".join(lines)
    return merged


def _loosen(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """A property two variants define differently: the loosest schema admitting both."""
    if a == b:
        return a
    if a.get("type") != b.get("type"):
        return {"x-kubernetes-preserve-unknown-fields": True}
    out = {key: a[key] for key in a if key in b and a[key] == b[key]}
    if "enum" in a and "enum" in b:
        out["enum"] = a["enum"] + [value for value in b["enum"] if value not in a["enum"]]
    for key, pick in (("minimum", min), ("maximum", max)):
        if key in a and key in b:
            out[key] = pick(a[key], b[key])
    return out


def _described(schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": schema["description"]} if "description" in schema else {}


def _model_classes(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model reachable from root's fields, by class name (pydantic's $defs keys)."""
    found: dict[str, type[BaseModel]] = {}
    pending: list[Any] = [root]
    while pending:
        item = pending.pop()
        if isinstance(item, type) and issubclass(item, BaseModel):
            if item.__name__ in found:
                continue
            found[item.__name__] = item
            pending += [field.annotation for field in item.model_fields.values()]
        else:
            pending += list(getattr(item, "__args__", ()))
    return found


@functools.lru_cache(maxsize=None)
def _field_docs(model: type[BaseModel]) -> dict[str, str]:
    """Attribute docstrings (the string right under a field), keyed by the field's alias."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
        except (OSError, TypeError):
            continue
        for field, doc in zip(body, body[1:]):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                docs[field.target.id] = inspect.cleandoc(doc.value.value)
    return {(model.model_fields[name].alias or name): text for name, text in docs.items() if name in model.model_fields}
