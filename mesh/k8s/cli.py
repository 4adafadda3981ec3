"""`python -m mesh k8s render|apply|status`: render an overlay, apply it server-side, summarise the rollout.

TARGET is an overlay name under k8s/overlays (dev, gpu, released, released-mmap, multinode) or a directory
holding a kustomization.yaml.

  python -m mesh k8s render gpu -o gpu.yaml        # kubectl kustomize k8s/overlays/gpu, validated offline
  python -m mesh k8s apply dev --wait 600          # server-side apply, then wait until every role is ready
  python -m mesh k8s status gpu                    # rollouts, pods holding them back, autoscalers
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console
from rich.table import Table

from mesh.k8s import ClusterError, ManifestError, ToolError
from mesh.k8s.kustomize import documents, render
from mesh.k8s.validation import validate

K8S_DIR = Path(__file__).resolve().parents[2] / "k8s"
PART_OF = "app.kubernetes.io/part-of=v41mesh"
_POLL_S = 5.0


def resolve_target(target: str) -> Path:
    """An overlay name (k8s/overlays/NAME) or a directory with a kustomization."""
    path = Path(target)
    if path.is_dir():
        return path
    overlays = K8S_DIR / "overlays"
    if (overlays / target).is_dir():
        return overlays / target
    names = sorted(p.name for p in overlays.iterdir() if p.is_dir()) if overlays.is_dir() else []
    raise ManifestError(f"no overlay or directory {target!r} (overlays: {', '.join(names) or 'none found'})")


class Rendering(NamedTuple):
    text: str  # kubectl kustomize's output
    objects: list[dict[str, Any]]


def rendered(target: str, *, check: bool = True) -> Rendering:
    """The target rendered, each object validated against the Kubernetes schemas (1.33) unless `check` is off."""
    text = render(resolve_target(target))
    objects = documents(text)
    if check:
        for obj in objects:
            validate(obj)
    return Rendering(text, objects)


def namespace_of(objects: list[dict[str, Any]]) -> str | None:
    return next((o["metadata"]["namespace"] for o in objects if o["metadata"].get("namespace")), None)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mesh k8s", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    render = commands.add_parser("render", help="render an overlay to YAML with kubectl kustomize")
    render.add_argument("target", help="overlay name (dev, gpu) or kustomization directory")
    render.add_argument("-o", "--output", help="write to this file instead of stdout")
    render.add_argument("--no-validate", action="store_true", help="skip the Kubernetes schema validation")

    cluster = argparse.ArgumentParser(add_help=False)
    cluster.add_argument("--context", help="kubeconfig context (default: the current one; in a pod: in-cluster)")
    cluster.add_argument("--wait", type=float, default=0, metavar="SECONDS", help="wait for every role to be ready")

    apply = commands.add_parser("apply", parents=[cluster], help="server-side apply an overlay (field manager v41mesh)")
    apply.add_argument("target", help="overlay name (dev, gpu) or kustomization directory")
    apply.add_argument("--namespace", help="namespace for objects that name none (an overlay always names one)")
    apply.add_argument("--dry-run", action="store_true", help="let the API server check everything, change nothing")
    apply.add_argument("--force-conflicts", action="store_true", help="take over fields another manager owns")

    status = commands.add_parser("status", parents=[cluster], help="rollout and readiness of a deployed mesh")
    status.add_argument("target", nargs="?", help="overlay whose namespace to inspect")
    status.add_argument("--namespace", help="namespace to inspect (default: the target's)")
    return parser


def _client(context: str | None) -> Any:
    import urllib3
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    from kubernetes.dynamic import DynamicClient

    try:
        api = config.new_client_from_config(context=context)
    except config.ConfigException as exc:
        if context:
            raise ClusterError(f"kubeconfig context {context!r}: {exc}") from None
        try:
            config.load_incluster_config()
        except config.ConfigException:
            raise ClusterError("no kubeconfig (~/.kube/config or $KUBECONFIG) and not inside a cluster") from None
        api = client.ApiClient()
    try:
        return DynamicClient(api)
    except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise ClusterError(f"cannot reach the API server at {api.configuration.host}: {exc}") from None


def _render(args: argparse.Namespace) -> int:
    text = rendered(args.target, check=not args.no_validate).text
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _apply(args: argparse.Namespace, console: Console) -> int:
    from mesh.k8s.apply import apply, missing_secrets, plan

    calls = plan(rendered(args.target).objects, namespace=args.namespace)
    client = _client(args.context)
    for ref in missing_secrets(client, calls):
        console.print(
            f"[yellow]warning[/]: Secret {ref.name} (needed by {ref.used_by}) does not exist yet; create it with\n"
            f"  kubectl -n {ref.namespace} create secret generic {ref.name} --from-literal=..."
        )
    failures = apply(
        client,
        calls,
        dry_run=args.dry_run,
        force_conflicts=args.force_conflicts,
        report=lambda call, outcome: console.print(f"{call.describe()} {outcome}"),
    )
    for failure in failures:
        console.print(f"[red]error[/]: {failure}")
    if failures:
        return 1
    namespace = next((c.namespace for c in calls if c.namespace), None)
    if args.wait and not args.dry_run and namespace:
        return _show_status(client, namespace, args.wait, console)
    return 0


def _status(args: argparse.Namespace, console: Console) -> int:
    namespace = args.namespace or (namespace_of(rendered(args.target, check=False).objects) if args.target else None)
    if namespace is None:
        raise ManifestError("name an overlay or pass --namespace")
    return _show_status(_client(args.context), namespace, args.wait, console)


def _show_status(client: Any, namespace: str, wait_s: float, console: Console) -> int:
    from mesh.k8s.status import summarise

    def items(api_version: str, kind: str) -> list[dict[str, Any]]:
        resource = client.resources.get(api_version=api_version, kind=kind)
        return resource.get(namespace=namespace, label_selector=PART_OF).to_dict()["items"]

    deadline = time.monotonic() + wait_s
    with console.status(f"reading the mesh in {namespace}") as spinner:
        while True:
            summary = summarise(
                items("apps/v1", "Deployment"),
                items("apps/v1", "StatefulSet"),
                items("v1", "Pod"),
                items("autoscaling/v2", "HorizontalPodAutoscaler"),
            )
            if summary.ready or time.monotonic() >= deadline:
                break
            done = sum(w.state == "ready" for w in summary.workloads)
            spinner.update(f"waiting for the rollout in {namespace}: {done} of {len(summary.workloads)} roles ready")
            time.sleep(_POLL_S)

    table = Table(title=f"v41mesh in namespace {namespace}")
    for column in ("workload", "ready", "updated", "state", "detail"):
        table.add_column(column)
    colour = {"ready": "green", "progressing": "yellow", "failed": "red"}
    for w in summary.workloads:
        state = f"[{colour[w.state]}]{w.state}[/]"
        table.add_row(f"{w.kind.lower()}/{w.name}", f"{w.ready}/{w.desired}", str(w.updated), state, w.detail)
    console.print(table if summary.workloads else f"no v41mesh workloads in namespace {namespace}")
    if summary.autoscalers:
        scalers = Table(title="autoscalers (queue depth)")
        for column in ("name", "replicas", "min-max", "metric"):
            scalers.add_column(column)
        for a in summary.autoscalers:
            scalers.add_row(a.name, f"{a.current} -> {a.desired}", a.bounds, a.metric)
        console.print(scalers)
    for problem in summary.problems:
        console.print(f"[yellow]pod[/] {problem}")
    return 0 if summary.ready else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(stderr=args.command == "render")
    try:
        if args.command == "render":
            return _render(args)
        if args.command == "apply":
            return _apply(args, console)
        return _status(args, console)
    except (ManifestError, ClusterError, ToolError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
