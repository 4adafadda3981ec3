"""Validation of emitted Responses objects against the vendored Open Responses OpenAPI document (README.md here).

Streaming events are validated by the schema their `type` names (the document's `text/event-stream` union), the
response object by `ResponseResource`; an event type the document does not define (an extension such as
`response.custom_tool_call_input.delta`) must still carry `type` and `sequence_number`, as extensions must.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

DOCUMENT = Path(__file__).with_name("openapi.json")
EXTENSION_EVENT = {"type": "object", "required": ["type", "sequence_number"]}


@functools.cache
def _document() -> dict[str, Any]:
    return json.loads(DOCUMENT.read_text())


@functools.cache
def validator(component: str) -> jsonschema.Draft202012Validator:
    """A validator of one component schema of the document (its `$ref`s resolved within the document)."""
    resource = Resource.from_contents(_document(), default_specification=DRAFT202012)
    registry: Registry = Registry().with_resource("urn:open-responses", resource)
    schema = {"$ref": f"urn:open-responses#/components/schemas/{component}"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


@functools.cache
def _event_components() -> dict[str, str]:
    """Streaming event `type` → the component that defines it."""
    stream = _document()["paths"]["/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    components = {}
    for ref in stream["schema"]["oneOf"]:
        name = ref["$ref"].rsplit("/", 1)[1]
        for kind in _document()["components"]["schemas"][name]["properties"]["type"]["enum"]:
            components[kind] = name
    return components


def check(component: str, body: Any) -> None:
    """Raise a jsonschema ValidationError naming the first field of `body` the component does not allow."""
    errors = sorted(validator(component).iter_errors(body), key=lambda e: e.path)
    if errors:
        raise jsonschema.ValidationError("; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors))


def check_event(event: dict[str, Any]) -> None:
    """A streaming event (HTTP or WebSocket) against the schema of its type."""
    component = _event_components().get(event.get("type", ""))
    if component is None:
        jsonschema.validate(event, EXTENSION_EVENT)
    else:
        check(component, event)
