"""Kubernetes tooling for the mesh: `python -m mesh k8s render|apply|status`.

- `kustomize`: renders the Kustomize overlays under k8s/ with `kubectl kustomize`.
- `validation`: strict offline validation against Kubernetes 1.33 (kubernetes-validate) and the custom resources
  the overlays use (PodMonitor, ServiceMonitor, LeaderWorkerSet).
- `apply`: server-side apply of the rendered objects through the `kubernetes` client.
- `status`: a rollout and readiness summary of a deployed mesh.
"""

from __future__ import annotations


class ManifestError(ValueError):
    """A kustomization or manifest that cannot be rendered or is invalid; the message names the file and field."""


class ToolError(RuntimeError):
    """kubectl is missing or did not finish; the message says what to do."""


class ClusterError(RuntimeError):
    """The cluster refused or cannot serve what was asked; the message says what to do."""


def main(argv: list[str] | None = None) -> int:
    # Imported here: rendering alone should not pay for importing the kubernetes client.
    from mesh.k8s.cli import main as cli_main

    return cli_main(argv)
