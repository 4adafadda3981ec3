"""`python -m mesh <command>`: run the whole mesh locally (`up`), a scripted conversation against it
(`demo`), or the Kubernetes helpers (`k8s render|apply|status`)."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "up": ("mesh.up", "start cache, prefill, decode and gateway on loopback"),
    "demo": ("mesh.demo", "run a short scripted conversation against a running mesh"),
    "k8s": ("mesh.k8s", "render, apply or inspect the Kubernetes deployment"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<6} {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: python -m mesh <command> [options]\n\ncommands:\n" + "\n".join(lines))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
