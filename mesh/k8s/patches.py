"""The two kinds of patch Kustomize applies, with Kustomize's semantics.

Strategic merge: maps merge key by key and `null` deletes a key; a list merges element by element only where the
Kubernetes schema gives it a merge key (containers by `name`, container ports by `containerPort`, volume mounts by
`mountPath`, ...), otherwise the patch replaces it whole (args, tolerations). Merged lists come out as Kustomize
writes them: the patch's elements in the patch's order, then the original elements the patch did not mention.
`$patch: delete` removes an element, or the whole object at the top level.

JSON 6902 (RFC 6902): add, remove, replace, move, copy and test, with RFC 6901 pointers.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from mesh.k8s import ManifestError
from mesh.k8s.schema import Node

DIRECTIVE = "$patch"


def is_delete(patch: Mapping[str, Any]) -> bool:
    return patch.get(DIRECTIVE) == "delete"


def strategic_merge(original: Mapping[str, Any], patch: Mapping[str, Any], schema: Node | None) -> dict[str, Any]:
    """`original` with the strategic-merge `patch` applied (neither argument is modified)."""
    return _merge_map(original, patch, schema, "")


def _clean(value: Any) -> Any:
    """Patch content that lands where nothing was: without directives, and without the nulls that delete."""
    if isinstance(value, Mapping):
        return {k: _clean(v) for k, v in value.items() if k != DIRECTIVE and v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _merge_map(original: Mapping[str, Any], patch: Mapping[str, Any], schema: Node | None, path: str) -> dict[str, Any]:
    directive = patch.get(DIRECTIVE, "merge")
    if directive == "replace":
        return _clean(patch)
    if directive != "merge":
        raise ManifestError(f"{path or '/'}: unsupported {DIRECTIVE}: {directive!r} (merge, replace or delete)")
    merged = copy.deepcopy(dict(original))
    for key, value in patch.items():
        if key == DIRECTIVE:
            continue
        if key.startswith("$"):
            raise ManifestError(f"{path}/{key}: unsupported strategic-merge directive")
        field = schema.field(key) if schema is not None else None
        here = f"{path}/{key}"
        if value is None or (isinstance(value, Mapping) and is_delete(value)):
            merged.pop(key, None)
        elif isinstance(value, Mapping):
            base = merged.get(key)
            merged[key] = _merge_map(base if isinstance(base, Mapping) else {}, value, field, here)
        elif isinstance(value, list):
            merged[key] = _merge_list(merged.get(key), value, field, here)
        else:
            merged[key] = value
    return merged


def _merge_list(original: Any, patch: list[Any], schema: Node | None, path: str) -> list[Any]:
    key = schema.merge_key if schema is not None else None
    if key is None:
        if schema is None and any(isinstance(item, Mapping) for item in patch):
            # Without a schema (a custom resource) Kustomize guesses how to merge; we refuse to guess.
            raise ManifestError(f"{path}: no schema says how to merge this list; use a JSON 6902 patch")
        return _clean(patch)
    elements = original if isinstance(original, list) else []
    item_schema = schema.items() if schema is not None else None
    merged: list[Any] = []
    patched: list[Any] = []
    for item in patch:
        if not isinstance(item, Mapping) or key not in item:
            raise ManifestError(f"{path}: every element of this list needs its merge key {key!r}")
        patched.append(item[key])
        if is_delete(item):
            continue
        match = next((e for e in elements if isinstance(e, Mapping) and e.get(key) == item[key]), {})
        merged.append(_merge_map(match, item, item_schema, f"{path}[{key}={item[key]}]"))
    merged += [copy.deepcopy(e) for e in elements if not (isinstance(e, Mapping) and e.get(key) in patched)]
    return merged


# --- JSON 6902 ---


def _pointer(path: Any, where: str) -> list[str]:
    if not isinstance(path, str) or not path.startswith("/"):
        raise ManifestError(f"{where}: a path is a JSON pointer starting with '/', got {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _index(container: list[Any], token: str, where: str, *, append: bool = False) -> int:
    if append and token == "-":
        return len(container)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise ManifestError(f"{where}: {token!r} is not a list index")
    index = int(token)
    if index > len(container) or (index == len(container) and not append):
        raise ManifestError(f"{where}: index {index} is out of range (the list has {len(container)} elements)")
    return index


def _parent(doc: Any, tokens: list[str], where: str) -> Any:
    node = doc
    for token in tokens[:-1]:
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list):
            node = node[_index(node, token, where)]
        else:
            raise ManifestError(f"{where}: {token!r} does not exist")
    return node


def _get(doc: Any, tokens: list[str], where: str) -> Any:
    parent, last = _parent(doc, tokens, where), tokens[-1]
    if isinstance(parent, dict) and last in parent:
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last, where)]
    raise ManifestError(f"{where}: {last!r} does not exist")


def _add(doc: Any, tokens: list[str], value: Any, where: str) -> None:
    parent, last = _parent(doc, tokens, where), tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, where, append=True), value)
    else:
        raise ManifestError(f"{where}: cannot add below a scalar")


def _remove(doc: Any, tokens: list[str], where: str) -> Any:
    parent, last = _parent(doc, tokens, where), tokens[-1]
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_index(parent, last, where))
    raise ManifestError(f"{where}: {last!r} does not exist")


def json6902(obj: Mapping[str, Any], operations: list[Any], where: str) -> dict[str, Any]:
    """`obj` with the RFC 6902 `operations` applied (`obj` is not modified)."""
    doc = copy.deepcopy(dict(obj))
    for number, op in enumerate(operations):
        if not isinstance(op, Mapping) or "op" not in op or "path" not in op:
            raise ManifestError(f"{where}: operation {number} needs 'op' and 'path'")
        here = f"{where}: operation {number} ({op['op']} {op['path']})"
        tokens = _pointer(op["path"], here)
        if op["op"] in ("add", "replace", "test") and "value" not in op:
            raise ManifestError(f"{here}: needs a 'value'")
        match op["op"]:
            case "add":
                _add(doc, tokens, copy.deepcopy(op["value"]), here)
            case "remove":
                _remove(doc, tokens, here)
            case "replace":
                _remove(doc, tokens, here)
                _add(doc, tokens, copy.deepcopy(op["value"]), here)
            case "move":
                _add(doc, tokens, _remove(doc, _pointer(op.get("from"), here), here), here)
            case "copy":
                _add(doc, tokens, copy.deepcopy(_get(doc, _pointer(op.get("from"), here), here)), here)
            case "test":
                if _get(doc, tokens, here) != op["value"]:
                    raise ManifestError(f"{here}: test failed, the value is {_get(doc, tokens, here)!r}")
            case other:
                raise ManifestError(f"{here}: unknown operation {other!r}")
    return doc
