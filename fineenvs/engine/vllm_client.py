"""vLLM's trainer-side weight-transfer modules, importable from the trainer's environment.

NCCL weight sync (``engine.weight_sync=nccl``) runs vLLM 0.33's own
``NCCLTrainerWeightTransferEngine`` in the trainer process, so the trainer must import
``vllm.distributed.weight_transfer``. vLLM cannot be installed into the trainer's environment
(it pins torch 2.14 and transformers < 5.21; the trainer uses transformers 5.24), so
``install_client`` puts the vLLM wheel, without its dependencies, plus the few small packages
those modules import, into a folder of its own under the fineenvs cache; ``import_client``
appends that folder to ``sys.path`` (after the environment's own packages, which keep priority).

Measured on the CPU machine (trainer venv: torch 2.13 CPU, transformers 5.24): with the folder on
the path, ``vllm.distributed.weight_transfer.nccl_engine`` and ``base`` import, and
``NCCLTrainerInitInfo``, ``ParamMeta``, ``WeightSource`` and ``PyNcclCommunicator`` load; the
NCCL communicator itself needs CUDA, so a transfer only runs on a GPU machine.

``python -m fineenvs.engine install-vllm-client [--dir DIR]`` installs it (about 340 MB download).
Importing ``vllm`` runs its ``env_override`` module, which sets a few process-wide variables and
torch Inductor options in the trainer process: untried on a GPU trainer so far.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from fineenvs.paths import cache_dir

VLLM_VERSION = "0.33.0"
# What vllm.distributed.weight_transfer imports beyond the trainer's own environment, found by
# importing it from a --no-deps install on a clean trainer venv (versions as resolved then).
CLIENT_PACKAGES = (
    f"vllm=={VLLM_VERSION}",
    "pyzmq==27.3.0",
    "cbor2==6.3.0",
    "aiohttp==3.14.5",
    "aiohappyeyeballs==2.7.1",
    "aiosignal==1.4.0",
    "attrs==26.1.0",
    "frozenlist==1.8.0",
    "multidict==7.2.1",
    "propcache==0.5.4",
    "yarl==1.25.1",
    "openai-harmony==0.0.8",
    "pybase64==1.5.1",
)
ENV_VAR = "FINEENVS_VLLM_CLIENT"


def client_dir() -> Path:
    """``$FINEENVS_VLLM_CLIENT``, else ``<fineenvs cache>/vllm-client-<version>``."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else cache_dir() / f"vllm-client-{VLLM_VERSION}"


def _installed_version(directory: Path) -> str | None:
    infos = sorted(directory.glob("vllm-*.dist-info"))
    return infos[0].name[len("vllm-") : -len(".dist-info")] if infos else None


def client_problem(directory: Path | None = None) -> str | None:
    """Why NCCL weight sync cannot import vLLM's trainer side here (None when it can)."""
    try:
        import vllm  # noqa: F401

        return None
    except ImportError:
        pass
    directory = directory or client_dir()
    version = _installed_version(directory) if directory.is_dir() else None
    if version == VLLM_VERSION:
        return None
    found = f"found vLLM {version}" if version else "nothing installed"
    return (
        "engine.weight_sync=nccl runs vLLM's NCCLTrainerWeightTransferEngine in the trainer, which needs "
        f"vLLM {VLLM_VERSION}'s trainer-side modules importable; {directory}: {found}. Fix: "
        "`python -m fineenvs.engine install-vllm-client` (vLLM itself stays in its own venv), or use "
        "engine.weight_sync=reload, which needs nothing in the trainer."
    )


def import_client(directory: Path | None = None) -> Any:
    """Import ``vllm.distributed.weight_transfer.nccl_engine`` (from the client folder if needed)."""
    problem = client_problem(directory)
    if problem:
        raise ImportError(problem)
    try:
        return importlib.import_module("vllm.distributed.weight_transfer.nccl_engine")
    except ImportError:
        path = str(directory or client_dir())
        if path not in sys.path:
            sys.path.append(path)  # after the venv: the trainer's own packages keep priority
        sys.modules.pop("vllm", None)
        return importlib.import_module("vllm.distributed.weight_transfer.nccl_engine")


def install_client(directory: Path | None = None, *, python: str | None = None) -> Path:
    """Install vLLM (no dependencies) and what its weight-transfer modules import into ``directory``."""
    directory = directory or client_dir()
    if _installed_version(directory) == VLLM_VERSION:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    cmd = [python or sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target"]
    cmd += [str(directory), *CLIENT_PACKAGES]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"installing vLLM's trainer-side modules into {directory} failed ({' '.join(cmd)}):\n"
            f"{done.stderr[-2000:]}\nFix: the machine needs PyPI (or a pip index with these wheels: "
            "PIP_INDEX_URL); --dir picks another folder; engine.weight_sync=reload needs none of this."
        )
    return directory
