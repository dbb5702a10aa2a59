"""Push trainer weights into a running engine: one protocol, three transports.

``WeightSync.push(weights, version) -> int`` takes either an in-memory state dict (HF parameter
names, the trainer's tensors) or a checkpoint directory, and returns the weight version the engine
serves afterwards. Completions record that version (the embedded engine returns it on every
response; vLLM with ``return_weight_versions``), which is how staleness is counted.

- ``EmbeddedWeightSync``: the embedded transformers engine. Saves safetensors under the run's
  staging folder and calls ``POST /update_weights_from_path``.
- ``VLLMReloadWeightSync``: any vLLM started with ``VLLM_SERVER_DEV_MODE=1``. Saves the weights
  into a new directory (complete, fsynced and checked before it gets its final name: vLLM's
  ``reload_weights(weights_path=...)`` loads ``*.safetensors`` from a local directory and takes
  anything else for a Hub id; given a missing folder it answers 500 and its next forward pass
  kills the worker), then ``/pause?mode=keep``, ``/collective_rpc reload_weights`` with
  ``weights_path`` by keyword, ``/update_weight_version``, ``/reset_prefix_cache``, and always
  ``/resume``.
- ``VLLMFileTransferWeightSync``: vLLM with ``--weight-transfer-config
  '{"backend":"fineenvs_file"}'`` (the plugin ``install-vllm`` puts into vLLM's environment).
  vLLM's four weight-transfer routes, as the NCCL backend drives them (``init`` once, then
  ``start_weight_update``, ``update_weights``, ``finish_weight_update`` with the version), with
  the tensors in a safetensors file the trainer writes into the transfer directory. Runs on
  vLLM's CPU build, so the control flow NCCL uses on GPUs runs for real in CI.
- ``VLLMNcclWeightSync``: vLLM with ``--weight-transfer-config '{"backend":"nccl"}'``. Broadcasts
  tensors GPU to GPU with vLLM 0.33's ``NCCLTrainerWeightTransferEngine``, which drives the HTTP
  routes through our ``VLLMControlPlane``; vLLM's trainer-side modules are imported when the
  first push happens (``fineenvs.engine.vllm_client``: the trainer process then needs CUDA and
  ``python -m fineenvs.engine install-vllm-client``). The NCCL broadcast itself has not run here
  (no GPU); its routes are the ones ``VLLMFileTransferWeightSync`` drives on the real server.

After every vLLM push the prefix cache is reset with ``reset_running_requests=true`` while the
engine is paused: requests frozen mid-generation are preempted and their prompts recomputed with
the new weights, so no cached prefix computed by older weights is ever served again. Every push
ends by reading ``/weight_info`` back; a push whose steps answered 200 but whose version did not
change is an error. A 200 does not prove the weights moved: the parity gate
(``fineenvs.engine.parity``) checks the engine's logprobs against the trainer's after each push.

Why ``mode=keep``: in ``wait`` (and ``abort``) mode vLLM answers every new request 503 until
``/resume``, and draining dozens of long generations takes tens of seconds every step, so agents
would see errors at every push. ``keep`` freezes running requests and queues new ones; they go on
with the new weights after ``/resume``, and each completion's ``weight_versions`` spans say which
tokens each version sampled (TRL's AsyncGRPO pauses the same way).

``announce(version)`` labels the weights the engine serves before the first push (vLLM starts at
``"default"``), so every recorded call carries a numeric version from the first step on.

Not covered: sharded (FSDP) state dicts (gather on rank 0 before calling ``push``), LoRA deltas,
vLLM's IPC and sparse backends.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from fineenvs.engine.launcher import free_port
from fineenvs.jsonl import JsonObject

if TYPE_CHECKING:
    import torch

Weights = Mapping[str, "torch.Tensor"] | Path


class WeightSyncError(RuntimeError):
    """The engine rejected or failed a weight update; the message carries its answer."""


PAUSE_MODE = "keep"

REFUSED_BEFORE_LOADING = "fineenvs_file refused the update before loading anything"
"""The plugin's prefix for an update it checked and refused (``fineenvs_vllm_plugin.REFUSED``):
the engine still serves the previous weights."""


class WeightSync(Protocol):
    def push(self, weights: Weights, version: int) -> int:
        """Make the engine serve ``weights`` as ``version``; return the version it reports."""
        ...

    def announce(self, version: int) -> None:
        """Label the weights the engine serves now as ``version`` (no weights move)."""
        ...

    def close(self) -> None: ...


def save_safetensors(
    state_dict: Mapping[str, torch.Tensor], directory: Path, filename: str = "model.safetensors"
) -> Path:
    """Write ``state_dict`` as ``directory/filename`` (CPU, contiguous, shared storage split: tied
    embeddings share memory, which safetensors refuses to serialise twice). The file is written
    under a temporary name, fsynced, checked against ``state_dict`` and renamed: a reader never
    sees a partial file, and a crash leaves none behind under the final name."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[int, int]] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if key in seen:
            t = t.clone()
        seen.add((t.untyped_storage().data_ptr(), int(t.storage_offset())))
        tensors[name] = t
    path = directory / filename
    tmp = directory / (filename + ".partial")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    _fsync(tmp)
    check_safetensors(tmp, {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()})
    tmp.replace(path)
    _fsync(directory)
    return path


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_safetensors(path: Path, expected: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """Raise unless ``path`` holds exactly ``expected``'s names with those dtypes and shapes
    (reads the header only)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        wrong = sorted(
            n for n in names & set(expected) if tuple(f.get_slice(n).get_shape()) != expected[n][1]
        )
    if names != set(expected) or wrong:
        raise WeightSyncError(
            f"{path} does not hold the weights just written (missing: {sorted(set(expected) - names)[:5]}, "
            f"unexpected: {sorted(names - set(expected))[:5]}, other shapes: {wrong[:5]}): the disk or the "
            "staging folder is faulty. Fix: free space or another engine.staging folder."
        )


def _check(response: httpx.Response, what: str, hint: str = "") -> httpx.Response:
    if response.status_code >= 400:
        if response.status_code == 404 and not hint:
            hint = (
                "vLLM serves its weight routes only in dev mode: start it with VLLM_SERVER_DEV_MODE=1 "
                "(a launched vLLM gets it whenever weights are pushed)"
            )
        raise WeightSyncError(
            f"{what}: {response.request.method} {response.request.url} answered {response.status_code}: "
            f"{response.text[:500]}" + (f". Fix: {hint}" if hint else "")
        )
    return response


class _StagedWeights:
    """Per-version staging folders (or files) under ``staging_dir``, keeping the last ``keep``."""

    def __init__(self, staging_dir: Path, keep: int) -> None:
        self.staging_dir = staging_dir
        self.keep = max(1, keep)
        self._paths: list[Path] = []

    def stage(self, weights: Weights, version: int) -> Path:
        """A directory holding ``weights`` as ``model.safetensors`` (a given directory as it is)."""
        if isinstance(weights, Path):
            if not weights.exists():
                raise FileNotFoundError(f"Checkpoint {weights} does not exist; nothing to push.")
            if not weights.is_dir():
                raise ValueError(
                    f"{weights} is a file; engines reload weights from a directory of *.safetensors "
                    f"(vLLM takes anything else for a Hugging Face repo id). Push {weights.parent} instead."
                )
            if not any(weights.glob("*.safetensors")):
                raise ValueError(f"{weights} holds no *.safetensors file: there is nothing to load from it.")
            return weights.resolve()
        directory = (self.staging_dir / f"v{version:06d}").resolve()
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        save_safetensors(weights, partial)
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)  # the folder the engine is told to load is complete
        _fsync(directory.parent)
        self._paths.append(directory)
        return directory

    def stage_file(self, weights: Weights, version: int) -> Path:
        """One ``v<version>.safetensors`` file in ``staging_dir`` (a checkpoint directory's single
        safetensors file is linked in: transfer backends read only from their own folder)."""
        path = (self.staging_dir / f"v{version:06d}.safetensors").resolve()
        if isinstance(weights, Path):
            files = sorted(self.stage(weights, version).glob("*.safetensors"))
            if len(files) != 1:
                raise ValueError(
                    f"{weights} holds {len(files)} safetensors files; a file transfer sends one. Push the "
                    "state dict instead (or engine.weight_sync=reload, which loads a sharded checkpoint)."
                )
            self.staging_dir.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            try:
                os.link(files[0], path)
            except OSError:
                shutil.copyfile(files[0], path)
        else:
            save_safetensors(weights, self.staging_dir.resolve(), path.name)
        self._paths.append(path)
        return path

    def prune(self) -> None:
        while len(self._paths) > self.keep:
            old = self._paths.pop(0)
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)


class EmbeddedWeightSync:
    """Weight sync for the embedded transformers engine (``POST /update_weights_from_path``)."""

    def __init__(
        self, url: str, staging_dir: Path, *, client: httpx.Client | None = None, keep: int = 1
    ) -> None:
        self.url = url.rstrip("/")
        self._staged = _StagedWeights(staging_dir, keep)
        self._own_client = client is None
        self.client = client or httpx.Client(timeout=600.0)

    def push(self, weights: Weights, version: int) -> int:
        path = self._staged.stage(weights, version)
        body = {"path": str(path), "weight_version": version}
        answer = _check(
            self.client.post(self.url + "/update_weights_from_path", json=body), "weight update"
        ).json()
        self._staged.prune()
        return int(answer["weight_version"])

    def announce(self, version: int) -> None:
        """The embedded engine numbers its weights itself (0 at start, then what each push says)."""

    def close(self) -> None:
        if self._own_client:
            self.client.close()


# How long a route that only flips a switch (pause, resume, version, prefix-cache reset, start of
# an update) may take. Such a route answers in milliseconds even under load; one that does not has
# a hung server behind it (stopped, deadlocked, swapped out), and a push must not wait the loading
# timeout (30 min, sized for reloading a large model) on it.
CONTROL_TIMEOUT_S = 60.0


class _VLLMServer:
    """The dev-mode routes every vLLM push uses, and what a failed push reports."""

    def __init__(
        self,
        url: str,
        client: httpx.Client,
        log_path: Path | None,
        control_timeout_s: float = CONTROL_TIMEOUT_S,
    ) -> None:
        self.url = url
        self.client = client
        self.log_path = log_path
        self.control_timeout_s = control_timeout_s
        self.weights = "previous"
        """What the engine holds during a push: ``previous`` until a step that loads weights
        starts, ``partial`` from then on, ``new`` once every loading step answered."""

    def moving(self) -> None:
        """Mark that the next call starts loading weights: a failure from here on may leave the
        engine's weights partly updated, and the error says so."""
        self.weights = "partial"

    def post(
        self,
        path: str,
        what: str,
        hint: str = "",
        *,
        json: JsonObject | None = None,
        params: dict[str, str] | None = None,
        loading: bool = False,
    ) -> JsonObject:
        """POST a dev route; ``loading``: the route moves weights and may take the client's full
        timeout, any other gets ``control_timeout_s``."""
        timeout = httpx.USE_CLIENT_DEFAULT if loading else self.control_timeout_s
        try:
            response = self.client.post(self.url + path, json=json, params=params, timeout=timeout)
        except httpx.TimeoutException as exc:
            raise WeightSyncError(
                f"{what}: POST {self.url}{path} got no answer within "
                f"{'the loading timeout' if loading else f'{self.control_timeout_s:g} s'} ({exc!r}): the server "
                f"is hung.{self._health()}"
            ) from exc
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{what}: POST {self.url}{path} failed ({exc}).{self._health()}") from exc
        try:
            _check(response, what, hint)
        except WeightSyncError as exc:
            if REFUSED_BEFORE_LOADING in response.text:
                self.weights = "previous"  # the plugin checked the update and loaded nothing
            raise WeightSyncError(f"{exc}{self._health()}") from None
        try:
            body: JsonObject = response.json()
        except ValueError:
            body = {}
        return body

    def _health(self) -> str:
        """What the server's state says about a failed call, for the error message."""
        alive = False
        for _ in range(2):  # a second try on a fresh connection: the server closes one after a 500
            try:
                alive = (
                    self.client.get(
                        self.url + "/health", timeout=min(10.0, self.control_timeout_s)
                    ).status_code
                    == 200
                )
                break
            except httpx.HTTPError:
                continue
        if alive and self.weights == "previous":
            return " The server is still up and serves the previous weights."
        if alive and self.weights == "new":
            return " The server is still up and holds the new weights."
        if alive:
            return (
                " The server is still up, but its weights may be partly updated: the step that loads "
                "them failed midway. The run stops here; rerunning the same command resumes from the last "
                "checkpoint with a fresh server."
            )
        where = f" Its log: {self.log_path}." if self.log_path else ""
        return (
            f" The vLLM server no longer answers /health: it died during the push.{where} The run stops "
            "here; its last checkpoint is intact, so rerunning the same command resumes from it with a fresh server."
        )

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Freeze running requests and queue new ones (``mode=keep``); always resume. A failure to
        resume after an earlier failure does not hide the earlier one. ``/resume`` is sent even
        when ``/pause`` itself failed: a pause that timed out may still have taken effect."""
        self.weights = "previous"
        failed = False
        try:
            self.post("/pause", "pause (freeze requests)", params={"mode": PAUSE_MODE})
            yield
        except BaseException:
            failed = True
            raise
        finally:
            try:
                self.post(
                    "/resume",
                    "resume",
                    "the server may still be paused (agents' calls queue until it resumes): "
                    f"POST {self.url}/resume, or stop the run and rerun it to resume from its last checkpoint",
                )
            except WeightSyncError:
                if not failed:
                    raise

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix; requests frozen mid-generation are preempted and recomputed
        with the new weights (``reset_running_requests``), so none is left to hit."""
        answer = self.post(
            "/reset_prefix_cache", "reset_prefix_cache", params={"reset_running_requests": "true"}
        )
        if answer.get("success") is False:
            raise WeightSyncError(
                f"reset_prefix_cache: {self.url} kept its prefix cache (success=false) although running "
                "requests were preempted: cached prefixes computed by the previous weights would be served. "
                "Fix: report the vLLM version; engine.enable_prefix_caching=false avoids the cache."
            )

    def check_version(self, version: int) -> None:
        try:
            response = _check(
                self.client.get(self.url + "/weight_info", timeout=self.control_timeout_s), "weight_info"
            )
            served = response.json().get("weight_version")
        except (httpx.HTTPError, ValueError, WeightSyncError) as exc:
            raise WeightSyncError(
                f"weight_info: GET {self.url}/weight_info failed ({exc}).{self._health()}"
            ) from exc
        if served != str(version):
            raise WeightSyncError(
                f"after pushing version {version}, {self.url}/weight_info reports {served!r}: the update's "
                "steps answered 200 but the version did not move. Fix: check the server's log."
            )


class _VLLMWeightSync:
    """What every vLLM push shares: the client, the dev-mode routes, announcing a version, closing,
    and the framing of a push (``_swap``): freeze requests, load, stamp the version, drop the prefix
    cache, always resume, then read the version back. Subclasses say how weights load."""

    def __init__(
        self,
        url: str,
        client: httpx.Client | None,
        timeout_s: float,
        log_path: Path | None,
        control_timeout_s: float = CONTROL_TIMEOUT_S,
    ) -> None:
        self.url = url.rstrip("/")
        self._own_client = client is None
        self.client = client or httpx.Client(timeout=timeout_s)
        self.server = _VLLMServer(self.url, self.client, log_path, control_timeout_s)
        self.control = VLLMControlPlane(self.url, self.client)

    def _swap(self, weights: Weights, version: int) -> int:
        with self.server.paused():
            self.install(weights, version)
        self.server.check_version(version)
        return version

    def install(self, weights: Weights, version: int) -> None:
        """Load ``weights`` as ``version`` and drop the prefix cache, on a paused server (a replica
        set pauses every replica first, installs on each, then resumes them all)."""
        self._begin()
        self.server.moving()
        self._load(weights, version)
        self.server.weights = "new"
        self._stamp(version)
        self.server.reset_prefix_cache()

    def _begin(self) -> None:
        """A step before any weights move (a failure here leaves the previous weights served)."""

    def _load(self, weights: Weights, version: int) -> None:
        raise NotImplementedError

    def _stamp(self, version: int) -> None:
        """Label the loaded weights, for a transport whose loading step does not."""

    def announce(self, version: int) -> None:
        self.server.post(
            "/update_weight_version", "update_weight_version", json={"new_version": str(version)}
        )

    def _shutdown(self) -> None:
        """Release the transfer engine, for a transport that set one up."""

    def close(self) -> None:
        try:
            self._shutdown()
        except (httpx.HTTPError, WeightSyncError):
            pass  # the server may already be gone at shutdown
        finally:
            if self._own_client:
                self.client.close()


class StagedVLLMWeightSync(_VLLMWeightSync):
    """A vLLM push that reads the weights from a file or folder staged under ``staging_dir`` (the
    last ``keep`` versions stay). Staging happens before the pause: saving is the slow part, and
    generation continues meanwhile."""

    def __init__(
        self,
        url: str,
        staging_dir: Path,
        *,
        client: httpx.Client | None = None,
        keep: int = 1,
        timeout_s: float = 1800.0,
        control_timeout_s: float = CONTROL_TIMEOUT_S,
        log_path: Path | None = None,
    ) -> None:
        super().__init__(url, client, timeout_s, log_path, control_timeout_s)
        self.staging_dir = staging_dir
        self._staged = _StagedWeights(staging_dir, keep)

    def stage(self, weights: Weights, version: int) -> Path:
        """Write ``weights`` under the staging folder (before any pause: saving is the slow part)."""
        raise NotImplementedError

    def ready(self, staged: Path) -> None:
        """What this server needs before it loads ``staged`` (replicas share one staged copy)."""

    def prune(self) -> None:
        self._staged.prune()

    def push(self, weights: Weights, version: int) -> int:
        path = self.stage(weights, version)
        self.ready(path)
        self._swap(path, version)
        self.prune()
        return version


class VLLMReloadWeightSync(StagedVLLMWeightSync):
    """Save a checkpoint and make vLLM reload it from disk (needs ``VLLM_SERVER_DEV_MODE=1``)."""

    def stage(self, weights: Weights, version: int) -> Path:
        return self._staged.stage(weights, version)

    def ready(self, staged: Path) -> None:
        if not staged.is_dir():  # checked again: a missing folder kills vLLM's worker
            raise WeightSyncError(f"staged weights {staged} vanished before the reload; nothing was sent.")

    def _load(self, weights: Weights, version: int) -> None:
        self.server.post(
            "/collective_rpc",
            "reload_weights",
            f"the vLLM server must be able to read {weights} (same machine or a shared filesystem)",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(weights)}},
            loading=True,
        )

    def _stamp(self, version: int) -> None:
        self.announce(version)


TRANSFER_BACKEND = "fineenvs_file"


class VLLMFileTransferWeightSync(StagedVLLMWeightSync):
    """vLLM's weight-transfer routes with fineenvs' file backend (``fineenvs_vllm_plugin``): the
    four phases NCCL uses, the tensors in a safetensors file in ``staging_dir``."""

    _initialised = False

    def _init(self) -> None:
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        hint = (
            f'start vLLM with --weight-transfer-config \'{{"backend":"{TRANSFER_BACKEND}"}}\' and fineenvs\' '
            "plugin in its environment (`python -m fineenvs.engine install-vllm` installs it)"
        )
        self.server.post(
            "/init_weight_transfer_engine",
            "init_weight_transfer_engine",
            hint,
            json={"init_info": {"directory": str(self.staging_dir.resolve())}},
            loading=True,  # sets up the transfer engine on every worker
        )
        self._initialised = True

    def stage(self, weights: Weights, version: int) -> Path:
        return self._staged.stage_file(weights, version)  # written and checked before the pause

    def ready(self, staged: Path) -> None:
        if not self._initialised:
            self._init()

    def _begin(self) -> None:
        self.server.post("/start_weight_update", "start_weight_update")

    def _load(self, weights: Weights, version: int) -> None:
        self.server.post(
            "/update_weights",
            "update_weights",
            json={"update_info": {"path": str(weights), "names": None}},
            loading=True,
        )
        # Finishing runs the model's post-load processing (repacking, quantisation): loading work.
        self.server.post(
            "/finish_weight_update",
            "finish_weight_update",
            json={"weight_version": str(version)},
            loading=True,
        )

    def _shutdown(self) -> None:
        if self._initialised:
            self.control.shutdown_weight_transfer_engine()


def vllm_weight_sync(
    mode: str | None, url: str, staging_dir: Path, log_path: Path | None = None
) -> WeightSync | None:
    """The weight sync for a vLLM server at ``url`` (``mode``: nccl, file_transfer, reload, None)."""
    if mode == "nccl":
        return VLLMNcclWeightSync(url)
    if mode == "file_transfer":
        return VLLMFileTransferWeightSync(url, staging_dir, log_path=log_path)
    if mode == "reload":
        return VLLMReloadWeightSync(url, staging_dir, log_path=log_path)
    if mode is None:
        return None
    raise ValueError(f"no vLLM weight sync called {mode!r} (nccl, file_transfer, reload)")


class VLLMControlPlane:
    """vLLM 0.33's ``VLLMWeightSyncClient`` protocol (four methods, structural) over our httpx
    client, so vLLM's trainer engine drives the handshake through routes we can record and test.
    ``finish_weight_update`` stamps the version being pushed: vLLM's engine calls it without one."""

    def __init__(self, url: str, client: httpx.Client) -> None:
        self.url = url.rstrip("/")
        self.client = client
        self.pending_version: str | None = None

    def _post(self, path: str, body: JsonObject | None = None) -> None:
        _check(self.client.post(self.url + path, json=body), path.lstrip("/"))

    def init_weight_transfer_engine(self, init_info: JsonObject) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: JsonObject | list[JsonObject]) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", {"weight_version": weight_version or self.pending_version})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("/shutdown_weight_transfer_engine")


@dataclass(frozen=True)
class NcclGroup:
    """One NCCL transfer group: where it meets and how many ranks join (the trainer and vLLM's workers)."""

    master_address: str
    master_port: int
    world_size: int


class NcclTransport(Protocol):
    """Trainer side of the NCCL transfer; calls the control plane in vLLM's order."""

    def connect(
        self, control: VLLMControlPlane, group: NcclGroup, weights: Mapping[str, torch.Tensor]
    ) -> None:
        """Rendezvous: ``control.init_weight_transfer_engine`` concurrently with the trainer endpoint."""
        ...

    def send(self, weights: Mapping[str, torch.Tensor]) -> None:
        """One round: ``start_weight_update``, ``update_weights`` alongside the broadcast, ``finish``."""
        ...

    def shutdown(self) -> None: ...


class VLLMNcclTransport:
    """vLLM 0.33's ``NCCLTrainerWeightTransferEngine`` (imported on first use) over a state dict.

    The engine replays one ``WeightSource`` each round; ours reads whichever state dict was pushed
    last, so names, dtypes and shapes must stay the same from push to push (vLLM checks it).
    Tensors must be on the trainer's GPU: NCCL broadcasts device memory."""

    def __init__(self, packed: bool = True) -> None:
        self.packed = packed
        self._engine: Any = None
        self._source: _WeightSource | None = None

    def connect(
        self, control: VLLMControlPlane, group: NcclGroup, weights: Mapping[str, torch.Tensor]
    ) -> None:
        from fineenvs.engine.vllm_client import import_client

        nccl = import_client()
        self._source = _state_dict_source(weights)
        # rank is this trainer process's rank in the transfer group: the single sender is rank 0.
        init = nccl.NCCLTrainerInitInfo(
            master_address=group.master_address,
            master_port=group.master_port,
            world_size=group.world_size,
            packed=self.packed,
            rank=0,
        )
        self._engine = nccl.NCCLTrainerWeightTransferEngine.trainer_init(
            init, client=control, source=self._source
        )

    def send(self, weights: Mapping[str, torch.Tensor]) -> None:
        import torch

        if torch.cuda.is_available():
            # NCCL broadcasts device memory; a gathered (FSDP) state dict may sit on the CPU.
            device = torch.device("cuda", torch.cuda.current_device())
            weights = {k: v if v.device == device else v.to(device) for k, v in weights.items()}
        assert self._source is not None, "connect() comes first"
        self._source.current = weights
        self._engine.send_weights()

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()


class _WeightSource(Protocol):
    """vLLM's ``WeightSource`` over the state dict pushed last."""

    current: Mapping[str, torch.Tensor]


def _state_dict_source(weights: Mapping[str, torch.Tensor]) -> _WeightSource:
    from functools import cached_property

    from fineenvs.engine.vllm_client import import_client

    import_client()
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateDictSource(WeightSource):  # type: ignore[misc]
        def __init__(self, current: Mapping[str, torch.Tensor]) -> None:
            self.current = current

        @cached_property
        def metadata(self) -> list[object]:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.current.items()]

        def iter_full(self) -> Iterable[tuple[str, torch.Tensor]]:
            yield from self.current.items()

    return StateDictSource(weights)


@dataclass
class NcclEndpoint:
    """Where vLLM's workers meet the trainer (rank 0) for the NCCL group."""

    master_address: str = "127.0.0.1"
    master_port: int = 0
    """0 picks a free port."""


class VLLMNcclWeightSync(_VLLMWeightSync):
    """Native vLLM weight transfer: HTTP control plane, NCCL broadcast of the tensors. The first
    push joins the NCCL group (``/get_world_size`` + the rendezvous); every push freezes requests
    (``/pause?mode=keep``), sends, stamps the version, and always resumes."""

    def __init__(
        self,
        url: str,
        *,
        endpoint: NcclEndpoint | None = None,
        client: httpx.Client | None = None,
        transport: NcclTransport | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        super().__init__(url, client, timeout_s, None)
        self.endpoint = endpoint or NcclEndpoint()
        self.transport = transport or VLLMNcclTransport()
        self._connected = False

    def _connect(self, weights: Mapping[str, torch.Tensor]) -> None:
        answer = _check(self.client.get(self.url + "/get_world_size"), "get_world_size").json()
        port = self.endpoint.master_port or free_port(self.endpoint.master_address)
        # The trainer is rank 0, vLLM's workers follow.
        group = NcclGroup(self.endpoint.master_address, port, world_size=int(answer["world_size"]) + 1)
        self.transport.connect(self.control, group, weights)
        self._connected = True

    def push(self, weights: Weights, version: int) -> int:
        if isinstance(weights, Path):
            raise ValueError(
                f"VLLMNcclWeightSync broadcasts in-memory tensors, not checkpoint directories ({weights}). "
                "Pass the state dict, or use engine.weight_sync=reload to load a checkpoint from disk."
            )
        if not self._connected:
            self._connect(weights)
        return self._swap(weights, version)

    def _load(self, weights: Weights, version: int) -> None:
        assert not isinstance(weights, Path)  # push refuses directories
        self.control.pending_version = str(version)
        try:
            self.transport.send(weights)
        finally:
            self.control.pending_version = None

    def _shutdown(self) -> None:
        if self._connected:
            self.transport.shutdown()
            self.control.shutdown_weight_transfer_engine()
