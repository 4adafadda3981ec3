"""YAML in and out the way Kustomize (go-yaml v3) does it, so rendered manifests match `kubectl kustomize` byte for
byte: read with the YAML 1.2 core schema (`yes`, `on` and dates are strings), write with sorted keys, two-space
indentation, sequences flush with their key, and strings that would read back as something else double-quoted."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from mesh.k8s import ManifestError

_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_TIMESTAMP = "tag:yaml.org,2002:timestamp"
_STR = "tag:yaml.org,2002:str"


class _Loader(yaml.SafeLoader):
    """The YAML 1.2 core schema: only true/false are booleans, dates stay strings."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _INT, _FLOAT, _TIMESTAMP)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)

_RESOLVER_12 = _Loader("")  # only its resolve(): what a YAML 1.2 reader takes a plain scalar for

# go-yaml also quotes what YAML 1.1 readers take for booleans or numbers, so old tools read the same values.
_OLD_BOOLS = frozenset(
    {"y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "on", "On", "ON", "off", "Off", "OFF"}
)
_OCTAL_12 = re.compile(r"^0o[0-7]+$")


class _Dumper(yaml.SafeDumper):
    pass


def _represent_str(dumper: _Dumper, value: str) -> yaml.ScalarNode:
    style = None
    if "\n" in value:
        style = "|"
    elif (
        value in _OLD_BOOLS
        or _OCTAL_12.match(value)
        or dumper.resolve(yaml.ScalarNode, value, (True, False)) != _STR
        or _RESOLVER_12.resolve(yaml.ScalarNode, value, (True, False)) != _STR
    ):
        style = '"'
    return dumper.represent_scalar(_STR, value, style=style)


_Dumper.add_representer(str, _represent_str)


def load_documents(text: str, where: str) -> list[dict[str, Any]]:
    """The non-empty documents of a YAML stream; each must be a mapping."""
    try:
        documents = [doc for doc in yaml.load_all(text, Loader=_Loader) if doc is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{where}: not valid YAML: {exc}") from None
    for number, doc in enumerate(documents):
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}: document {number} is a {type(doc).__name__}, not a mapping")
    return documents


def load_yaml(text: str, where: str) -> Any:
    """One YAML document of any shape (a JSON 6902 patch is a list)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ManifestError(f"{where}: not valid YAML: {exc}") from None


def dump_documents(objects: Iterable[Mapping[str, Any]]) -> str:
    """A multi-document YAML stream, documents separated by `---` as Kustomize writes them."""
    return "---\n".join(
        yaml.dump(dict(obj), Dumper=_Dumper, default_flow_style=False, sort_keys=True, allow_unicode=True)
        for obj in objects
    )
