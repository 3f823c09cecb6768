"""The OpenAPI document at /api-doc/openapi.json, with TGI's schema names.

Routes read their bodies themselves (to answer parse failures the way axum does), so FastAPI
cannot infer request schemas; each route names its TGI schema with `json_body(...)` and
`build_openapi` adds the pydantic models under `components/schemas`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tgi_compat.api.protocol import tgi as schemas

REF = "#/components/schemas/{model}"

# Models documented by default; other route modules may register theirs with `register_schemas`.
_DOCUMENTED: list[type[BaseModel]] = [
    schemas.CompatGenerateRequest,
    schemas.GenerateRequest,
    schemas.GenerateParameters,
    schemas.GrammarType,
    schemas.GenerateResponse,
    schemas.Details,
    schemas.BestOfSequence,
    schemas.Token,
    schemas.PrefillToken,
    schemas.StreamResponse,
    schemas.StreamDetails,
    schemas.SimpleToken,
    schemas.ErrorResponse,
    schemas.Info,
]


def register_schemas(*models: type[BaseModel]) -> None:
    _DOCUMENTED.extend(m for m in models if m not in _DOCUMENTED)


def json_body(schema_name: str) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is the TGI schema `schema_name`."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=schema_name)}}},
        }
    }


def _component_schemas() -> dict[str, Any]:
    components: dict[str, Any] = {}
    for model in _DOCUMENTED:
        schema = model.model_json_schema(ref_template=REF, mode="serialization")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    return components


def build_openapi(app: FastAPI, version: str) -> dict[str, Any]:
    if app.openapi_schema is None:
        document = get_openapi(
            title="Text Generation Inference",
            version=version,
            description="Text Generation Webserver",
            routes=app.routes,
        )
        document.setdefault("components", {}).setdefault("schemas", {}).update(_component_schemas())
        app.openapi_schema = document
    return app.openapi_schema
