"""The Python Kustomize renderer: identical to `kubectl kustomize` on our overlays (where kubectl is installed), and
Kustomize's semantics on small trees, each also checked against kubectl when it is there."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from k8s_helpers import K8S, REPO

from mesh.k8s import ManifestError, main
from mesh.k8s.kustomize import build, render
from mesh.k8s.yaml_io import dump_documents, load_documents

KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: nothing to compare with")


def kubectl_kustomize(directory: Path) -> str:
    assert KUBECTL is not None
    return subprocess.run(
        [KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, check=True, timeout=120
    ).stdout


def built(tmp_path: Path, files: dict[str, str], target: str = ".") -> list[dict[str, Any]]:
    """Write a kustomization tree, render it, and hold the result to kubectl's where kubectl is installed."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    text = render(tmp_path / target)
    if KUBECTL is not None:
        assert text == kubectl_kustomize(tmp_path / target)
    return load_documents(text, "rendered")


DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      nodeSelector: {gpu: "yes"}
      tolerations: [{key: gpu, operator: Exists}]
      containers:
      - name: main
        image: registry.local:5000/team/web:1.0
        args: [serve, --port, "80"]
        env: [{name: A, value: "1"}, {name: B, value: "1"}, {name: C, value: "1"}]
        ports: [{containerPort: 80, name: http}]
        volumeMounts: [{name: v1, mountPath: /a}, {name: v2, mountPath: /b}]
        resources: {limits: {cpu: "1", gpu: "1"}, requests: {cpu: "1", gpu: "1"}}
      - name: side
        image: side:2
      volumes: [{name: v1, emptyDir: {}}, {name: v2, emptyDir: {}}]
"""


@needs_kubectl
@pytest.mark.parametrize("target", ["base", "overlays/dev", "overlays/gpu"])
def test_our_overlays_render_exactly_as_kubectl_kustomize(target: str) -> None:
    assert render(K8S / target) == kubectl_kustomize(K8S / target)


def test_strategic_merge_follows_the_schema_merge_keys(tmp_path: Path) -> None:
    patch = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  template:
    spec:
      nodeSelector: null
      tolerations: [{key: other, operator: Exists}]
      containers:
      - name: extra
        image: extra:1
      - name: main
        args: [serve]
        env: [{name: C, value: "2"}, {name: D, value: "2"}, {name: A, value: "2"}]
        ports: [{containerPort: 80, name: web}]
        volumeMounts: [{name: v3, mountPath: /a}]
        resources: {limits: {gpu: null}, requests: {gpu: null}}
      volumes: [{name: v2, $patch: delete}, {name: v3, emptyDir: {}}]
"""
    files = {"kustomization.yaml": "resources: [d.yaml]\npatches:\n- path: p.yaml\n", "d.yaml": DEPLOYMENT}
    (dep,) = built(tmp_path, files | {"p.yaml": patch})
    spec = dep["spec"]["template"]["spec"]
    assert "nodeSelector" not in spec
    assert spec["tolerations"] == [{"key": "other", "operator": "Exists"}], "no merge key: replaced whole"
    # Merged lists: the patch's elements in its order, then the original elements it did not mention.
    assert [c["name"] for c in spec["containers"]] == ["extra", "main", "side"]
    main = spec["containers"][1]
    assert main["args"] == ["serve"]
    assert [(e["name"], e["value"]) for e in main["env"]] == [("C", "2"), ("D", "2"), ("A", "2"), ("B", "1")]
    assert main["ports"] == [{"containerPort": 80, "name": "web"}], "merged by containerPort"
    assert main["volumeMounts"] == [{"name": "v3", "mountPath": "/a"}, {"name": "v2", "mountPath": "/b"}]
    assert main["resources"] == {"limits": {"cpu": "1"}, "requests": {"cpu": "1"}}
    assert [v["name"] for v in spec["volumes"]] == ["v3", "v1"]


def test_json6902_operations_and_targets_by_anchored_name(tmp_path: Path) -> None:
    other = DEPLOYMENT.replace("name: web\n", "name: webber\n", 1)
    ops = """\
- {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: Z, value: "9"}}
- {op: replace, path: /spec/template/spec/containers/0/env/0/value, value: "0"}
- {op: remove, path: /spec/template/spec/tolerations}
- {op: copy, from: /spec/template/spec/containers/0/image, path: /spec/template/spec/containers/1/image}
- {op: move, from: /spec/template/spec/nodeSelector, path: /spec/template/metadata/annotations}
- {op: test, path: /spec/template/spec/containers/1/name, value: side}
"""
    files = {
        "kustomization.yaml": "resources: [d.yaml, o.yaml]\n"
        "patches:\n- path: p.yaml\n  target: {kind: Deployment, name: web}\n",
        "d.yaml": DEPLOYMENT,
        "o.yaml": other,
        "p.yaml": ops,
    }
    web, webber = built(tmp_path, files)
    spec = web["spec"]["template"]["spec"]
    assert [(e["name"], e["value"]) for e in spec["containers"][0]["env"]] == [
        ("A", "0"),
        ("B", "1"),
        ("C", "1"),
        ("Z", "9"),
    ]
    assert "tolerations" not in spec
    assert spec["containers"][1]["image"] == "registry.local:5000/team/web:1.0"
    assert web["spec"]["template"]["metadata"]["annotations"] == {"gpu": "yes"}
    assert webber["spec"]["template"]["spec"] == load_documents(other, "o")[0]["spec"]["template"]["spec"]


def test_json6902_errors_name_the_operation(tmp_path: Path) -> None:
    (tmp_path / "d.yaml").write_text(DEPLOYMENT)
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [d.yaml]\npatches:\n- target: {kind: Deployment}\n  patch: |-\n"
        "    - {op: test, path: /spec/template/spec/containers/1/name, value: main}\n"
    )
    with pytest.raises(ManifestError, match=r"operation 0 \(test .*\): test failed, the value is 'side'"):
        build(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [d.yaml]\npatches:\n- target: {kind: Deployment}\n  patch: |-\n"
        "    - {op: remove, path: /spec/template/spec/containers/7}\n"
    )
    with pytest.raises(ManifestError, match="index 7 is out of range"):
        build(tmp_path)


def test_generated_config_maps_get_kustomizes_hash_and_every_reference_follows(tmp_path: Path) -> None:
    deployment = DEPLOYMENT.replace(
        "        ports:",
        "        envFrom: [{configMapRef: {name: settings}}]\n"
        "        livenessProbe: {exec: {command: [settings]}}\n"
        "        ports:",
    ).replace("{name: v2, emptyDir: {}}", "{name: v2, configMap: {name: settings}}")
    files = {
        "base/kustomization.yaml": "resources: [d.yaml]\nconfigMapGenerator:\n- name: settings\n  literals: [one=]\n"
        "- name: empty\n- name: three\n  literals: [two=2, one=, three=3]\n",
        "base/d.yaml": deployment,
        "overlay/kustomization.yaml": "resources: [../base]\nconfigMapGenerator:\n"
        "- name: three\n  behavior: replace\n  literals: [four=4]\n",
    }
    objects = built(tmp_path, files, "base")
    names = sorted(o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap")
    # Kustomize's own test-suite values for these contents (api/hasher/hasher_test.go).
    assert names == ["empty-6ct58987ht", "settings-9g67k2htb6", "three-f5h7t85m9b"]
    spec = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert spec["containers"][0]["envFrom"] == [{"configMapRef": {"name": "settings-9g67k2htb6"}}]
    assert spec["containers"][0]["livenessProbe"]["exec"]["command"] == ["settings"], "only references are renamed"
    assert spec["volumes"][1]["configMap"]["name"] == "settings-9g67k2htb6"
    overlay = built(tmp_path, {}, "overlay")
    three = next(o for o in overlay if o["metadata"]["name"].startswith("three-"))
    assert three["data"] == {"four": "4"}
    assert three["metadata"]["name"] != "three-f5h7t85m9b", "new content, new name"


def test_namespace_labels_replicas_and_images(tmp_path: Path) -> None:
    account = "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: web}\n"
    binding = (
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: web}\n"
        "roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: web}\n"
        "subjects: [{kind: ServiceAccount, name: web}, {kind: ServiceAccount, name: web, namespace: other}]\n"
    )
    namespace = "apiVersion: v1\nkind: Namespace\nmetadata: {name: prod}\n"
    files = {
        "kustomization.yaml": "namespace: prod\nresources: [d.yaml, a.yaml, b.yaml, n.yaml]\n"
        "labels:\n- pairs: {team: serving}\nreplicas:\n- {name: web, count: 3}\nimages:\n"
        "- {name: registry.local:5000/team/web, newTag: '2.0'}\n"
        "- {name: side, newName: mirror.local/side, digest: 'sha256:abc'}\n",
        "d.yaml": DEPLOYMENT,
        "a.yaml": account,
        "b.yaml": binding,
        "n.yaml": namespace,
    }
    objects = built(tmp_path, files)
    assert [o["kind"] for o in objects] == ["Namespace", "ServiceAccount", "RoleBinding", "Deployment"]
    ns, _, rb, dep = objects
    assert "namespace" not in ns["metadata"], "cluster-scoped"
    assert all(o["metadata"]["namespace"] == "prod" for o in objects[1:])
    assert all(o["metadata"]["labels"] == {"team": "serving"} for o in objects)
    assert dep["spec"]["template"]["metadata"]["labels"] == {"app": "web"}, "pairs touch metadata only"
    # The subject follows its ServiceAccount; one naming another namespace is someone else's.
    assert rb["subjects"] == [
        {"kind": "ServiceAccount", "name": "web", "namespace": "prod"},
        {"kind": "ServiceAccount", "name": "web", "namespace": "other"},
    ]
    assert dep["spec"]["replicas"] == 3
    images = [c["image"] for c in dep["spec"]["template"]["spec"]["containers"]]
    assert images == ["registry.local:5000/team/web:2.0", "mirror.local/side@sha256:abc"]


def test_kinds_come_out_in_kubectls_order(tmp_path: Path) -> None:
    kinds = ["ValidatingWebhookConfiguration", "Deployment", "Ingress", "ConfigMap", "Namespace", "Service"]
    docs = [f"apiVersion: {'v1' if k in ('ConfigMap', 'Namespace', 'Service') else 'x.io/v1'}\nkind: {k}\n"
            f"metadata: {{name: {k.lower()}}}\n" for k in kinds]  # fmt: skip
    objects = built(tmp_path, {"kustomization.yaml": "resources: [r.yaml]\n", "r.yaml": "---\n".join(docs)})
    assert [o["kind"] for o in objects] == [
        "Namespace", "ConfigMap", "Service", "Deployment", "Ingress", "ValidatingWebhookConfiguration"
    ]  # fmt: skip


def test_yaml_is_written_as_go_yaml_writes_it() -> None:
    values = {"a": "8000", "b": "true", "c": "y", "d": "on", "e": "", "f": "2001-12-14", "g": "0o17", "h": "x: y",
              "i": "plain", "j": "two\nlines\n", "k": 8000, "l": True, "m": None, "p": {}, "q": ["-x"]}  # fmt: skip
    text = dump_documents([values])
    assert text.splitlines() == [
        'a: "8000"', 'b: "true"', 'c: "y"', 'd: "on"', 'e: ""', 'f: "2001-12-14"', 'g: "0o17"', "h: 'x: y'",
        "i: plain", "j: |", "  two", "  lines", "k: 8000", "l: true", "m: null", "p: {}", "q:", "- -x",
    ]  # fmt: skip
    assert load_documents(text, "round trip") == [values]
    # YAML 1.2 reading: `on` and dates stay strings, as Kustomize reads them.
    assert load_documents("a: on\nb: 2001-12-14\nc: 0x10\n", "x") == [{"a": "on", "b": "2001-12-14", "c": 16}]


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"kustomization.yaml": "commonLabels: {a: b}\n"}, "unknown field `commonLabels`"),
        ({"kustomization.yaml": "resources: [missing.yaml]\n"}, "resource 'missing.yaml' does not exist"),
        ({"kustomization.yaml": "resources: [https://x/y]\n"}, "remote resource"),
        ({"kustomization.yaml": "resources: [.]\n"}, "resources form a cycle"),
        ({"kustomization.yaml": "configMapGenerator:\n- name: c\n  literals: [novalue]\n"}, "is not KEY=VALUE"),
        (
            {"kustomization.yaml": "resources: [d.yaml, d.yaml]\n", "d.yaml": DEPLOYMENT},
            "Deployment/web is defined twice",
        ),
        (
            {
                "kustomization.yaml": "resources: [d.yaml]\npatches:\n- path: p.yaml\n",
                "d.yaml": DEPLOYMENT,
                "p.yaml": "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\n---\n"
                "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\n",
            },
            "one patch per entry, got 2",
        ),
        (
            {
                "kustomization.yaml": "resources: [d.yaml]\npatches:\n- patch: '[{op: remove, path: /spec}]'\n",
                "d.yaml": DEPLOYMENT,
            },
            "a JSON 6902 patch needs a `target`",
        ),
        (
            {
                "kustomization.yaml": "resources: [d.yaml]\npatches:\n- patch: '{kind: Deployment, metadata: {name: "
                "api}}'\n",
                "d.yaml": DEPLOYMENT,
            },
            "the patch matches no resource",
        ),
        (
            {"kustomization.yaml": "resources: [d.yaml]\nreplicas:\n- {name: api, count: 2}\n", "d.yaml": DEPLOYMENT},
            "no Deployment or StatefulSet named 'api'",
        ),
        (
            {
                "kustomization.yaml": "resources: [m.yaml]\npatches:\n- patch: '{apiVersion: x.io/v1, kind: M, "
                "metadata: {name: m}, spec: {items: [{name: a}]}}'\n",
                "m.yaml": "apiVersion: x.io/v1\nkind: M\nmetadata: {name: m}\nspec: {items: [{name: b}]}\n",
            },
            "no schema says how to merge this list",
        ),
        (
            {
                "kustomization.yaml": "resources: [d.yaml]\npatches:\n- patch: '{apiVersion: apps/v1, kind: Deployment,"
                " metadata: {name: web}, spec: {template: {spec: {containers: [{image: x}]}}}}'\n",
                "d.yaml": DEPLOYMENT,
            },
            "needs its merge key 'name'",
        ),
    ],
)
def test_bad_kustomizations_get_a_precise_error(tmp_path: Path, files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ManifestError, match=message.replace("[", r"\[").replace("(", r"\(")):
        build(tmp_path)


def test_cli_renders_validated_yaml_to_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dev.yaml"
    assert main(["render", "dev", "-o", str(out)]) == 0
    assert out.read_text() == render(K8S / "overlays" / "dev")
    assert main(["render", "nope"]) == 1
    assert "no overlay or directory 'nope' (overlays: dev, gpu)" in capsys.readouterr().err


def test_cli_refuses_to_render_an_invalid_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: [d.yaml]\n")
    (tmp_path / "d.yaml").write_text(DEPLOYMENT.replace("  selector:", "  replica: 2\n  selector:"))
    assert main(["render", str(tmp_path)]) == 1
    assert "Deployment/web: spec: Additional properties are not allowed ('replica' was unexpected)" in (
        capsys.readouterr().err
    )
    assert main(["render", str(tmp_path), "--no-validate"]) == 0


def test_python_m_mesh_k8s_render_is_wired() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mesh", "k8s", "render", "gpu"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == render(K8S / "overlays" / "gpu")
