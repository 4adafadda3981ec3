"""The image: multi-stage, pinned bases, non-root, CPU/CUDA by build argument, probes in the manifests for the ports it
exposes, and a build context that carries the packages and nothing else. (No Docker engine here: the files are read.)"""

from __future__ import annotations

import re
import tomllib

from k8s_helpers import K8S, OVERLAYS, REPO, pod_spec, rendered, workloads

DOCKERFILE = K8S / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines if line and line[0] != "#"]


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for instruction in instructions():
        if instruction[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


def build_args() -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in instructions() if i == "ARG" and "=" in a)


def test_multi_stage_build_whose_runtime_copies_only_the_environment() -> None:
    build, runtime = stages()
    assert build[0][1].endswith("AS build")
    assert runtime[0][1].endswith("AS runtime")
    copies = [a for i, a in runtime if i == "COPY"]
    assert copies == ["--from=build /opt/v41mesh /opt/v41mesh"]


def test_base_images_are_pinned_to_an_exact_version() -> None:
    args = build_args()
    for instruction, arguments in instructions():
        if instruction != "FROM":
            continue
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], arguments.split()[0])
        tag = image.partition(":")[2]
        assert tag, f"{image} has no tag"
        assert tag != "latest"
        assert "@sha256:" in image or re.match(r"\d+\.\d+\.\d+", tag), f"{image}: pin an exact version"


def test_runs_as_the_non_root_user_the_manifests_expect() -> None:
    (_, runtime) = stages()
    (user,) = [a for i, a in runtime if i == "USER"]
    uid, _, gid = user.partition(":")
    assert int(uid) > 0
    assert int(gid) > 0
    for overlay in OVERLAYS:
        for w in workloads(rendered(overlay)):
            context = pod_spec(w)["securityContext"]
            assert (context["runAsUser"], context["runAsGroup"]) == (int(uid), int(gid))


def test_cpu_and_cuda_variants_by_build_argument() -> None:
    args = build_args()
    assert args["VARIANT"] == "cpu"
    (install,) = [a for i, a in instructions() if i == "RUN" and "VARIANT" in a]
    assert re.search(r"cpu\) index=https://download.pytorch.org/whl/cpu", install)
    assert re.search(r"cuda\) index=https://download.pytorch.org/whl/\$\{TORCH_CUDA\}", install)
    assert "exit 1" in install, "an unknown variant fails the build"
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])


def test_probe_parity_every_exposed_port_is_a_probed_container_port() -> None:
    assert ("HEALTHCHECK", "NONE") in instructions(), "Kubernetes probes are the health checks"
    (expose,) = [a for i, a in instructions() if i == "EXPOSE"]
    for overlay in OVERLAYS:
        ports = set()
        for w in workloads(rendered(overlay)):
            for c in pod_spec(w)["containers"]:
                assert all(c.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe"))
                ports |= {p["containerPort"] for p in c["ports"]}
        assert {int(p) for p in expose.split()} == ports


def test_every_role_the_manifests_run_is_installed_into_the_image() -> None:
    (entrypoint,) = [a for i, a in instructions() if i == "ENTRYPOINT"]
    assert entrypoint == '["python", "-m"]'
    copied = {s for i, a in instructions() if i == "COPY" and not a.startswith("--") for s in a.split()[:-1]}
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert {p.rstrip("*") for p in packages["include"]} <= copied, "pip install needs every package"
    for overlay in OVERLAYS:
        for w in workloads(rendered(overlay)):
            role = pod_spec(w)["containers"][0]["args"][0]
            assert role in copied
            assert (REPO / role / "__init__.py").is_file()


# --- the build context (.dockerignore, Docker's matching rules) ---


def _pattern(text: str) -> re.Pattern[str]:
    regex = ""
    i = 0
    while i < len(text):
        if text.startswith("**/", i):
            regex, i = regex + "(.*/)?", i + 3
        elif text.startswith("**", i):
            regex, i = regex + ".*", i + 2
        elif text[i] == "*":
            regex, i = regex + "[^/]*", i + 1
        elif text[i] == "?":
            regex, i = regex + "[^/]", i + 1
        elif text[i] == "[":
            end = text.index("]", i)
            regex, i = regex + text[i : end + 1], end + 1
        else:
            regex, i = regex + re.escape(text[i]), i + 1
    return re.compile(regex)


def excluded(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
    rules = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    result = False
    parts = path.split("/")
    for rule in (r for r in rules if r and not r.startswith("#")):
        negated, pattern = rule.startswith("!"), _pattern(rule.lstrip("!").strip("/"))
        if any(pattern.fullmatch("/".join(parts[: n + 1])) for n in range(len(parts))):
            result = not negated
    return result


def test_dockerignore_keeps_environments_tests_caches_and_secrets_out() -> None:
    for path in (".venv/bin/python", ".git/HEAD", "tests/k8s/test_k8s_dockerfile.py", "bench/out/kernels.json",
                 "recipe/__pycache__/render.cpython-311.pyc", "model/kernels/__pycache__/x.pyc", ".env",
                 "docs/benchmarks.md", ".ruff_cache/x", "v41mesh.egg-info/PKG-INFO", "k8s/Dockerfile"):  # fmt: skip
        assert excluded(path), path


def test_dockerignore_lets_in_everything_the_build_copies() -> None:
    copied = [s for i, a in instructions() if i == "COPY" and not a.startswith("--") for s in a.split()[:-1]]
    for source in copied:
        sample = source if source.endswith((".toml", ".md")) else f"{source}/__init__.py"
        assert not excluded(sample), sample
    assert not excluded("model/weights/demo.safetensors"), "the embedded checkpoint ships in the image"
