"""Push trainer weights into a running engine: one protocol, three transports.

``WeightSync.push(weights, version) -> int`` takes either an in-memory state dict (HF parameter
names, the trainer's tensors) or a checkpoint directory, and returns the weight version the engine
serves afterwards. Completions record that version (the embedded engine returns it on every
response; vLLM with ``return_weight_versions``), which is how staleness is counted.

- ``EmbeddedWeightSync``: the embedded transformers engine. Saves safetensors under the run's
  staging folder and calls ``POST /update_weights_from_path``.
- ``VLLMReloadWeightSync``: any vLLM started with ``VLLM_SERVER_DEV_MODE=1``. Saves the weights
  into a directory (vLLM's ``reload_weights(weights_path=...)`` loads ``*.safetensors`` from a
  local directory; anything else it takes for a Hub id), then ``/pause?mode=keep``,
  ``/collective_rpc reload_weights``, ``/update_weight_version``, and always ``/resume``.
- ``VLLMNcclWeightSync``: vLLM with ``--weight-transfer-config '{"backend":"nccl"}'``. Broadcasts
  tensors GPU to GPU with vLLM 0.33's ``NCCLTrainerWeightTransferEngine``, which drives the HTTP
  routes through our ``VLLMControlPlane``; vLLM's trainer-side modules are imported when the
  first push happens (``fineenvs.engine.vllm_client``: the trainer process then needs CUDA and
  ``python -m fineenvs.engine install-vllm-client``). The control plane is tested with vLLM's own
  trainer engine against the stand-in; the NCCL broadcast itself has not run (no GPU here).

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

import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from fineenvs.engine.launcher import free_port

if TYPE_CHECKING:
    import torch

Weights = Mapping[str, "torch.Tensor"] | Path


class WeightSyncError(RuntimeError):
    """The engine rejected or failed a weight update; the message carries its answer."""


PAUSE_MODE = "keep"


class WeightSync(Protocol):
    def push(self, weights: Weights, version: int) -> int:
        """Make the engine serve ``weights`` as ``version``; return the version it reports."""
        ...

    def announce(self, version: int) -> None:
        """Label the weights the engine serves now as ``version`` (no weights move)."""
        ...

    def close(self) -> None: ...


def save_safetensors(state_dict: Mapping[str, torch.Tensor], directory: Path) -> Path:
    """Write ``state_dict`` as ``directory/model.safetensors`` (CPU, contiguous, shared storage split:
    tied embeddings share memory, which safetensors refuses to serialise twice)."""
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
    path = directory / "model.safetensors"
    tmp = directory / "model.safetensors.partial"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)  # a reader never sees a half-written file
    return path


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
    """Per-version staging folders under ``staging_dir``, keeping the last ``keep`` versions."""

    def __init__(self, staging_dir: Path, keep: int) -> None:
        self.staging_dir = staging_dir
        self.keep = max(1, keep)
        self._dirs: list[Path] = []

    def stage(self, weights: Weights, version: int) -> Path:
        if isinstance(weights, Path):
            if not weights.exists():
                raise FileNotFoundError(f"Checkpoint {weights} does not exist; nothing to push.")
            if not weights.is_dir():
                raise ValueError(
                    f"{weights} is a file; engines reload weights from a directory of *.safetensors "
                    f"(vLLM takes anything else for a Hugging Face repo id). Push {weights.parent} instead."
                )
            return weights.resolve()
        directory = (self.staging_dir / f"v{version:06d}").resolve()
        save_safetensors(weights, directory)
        self._dirs.append(directory)
        return directory

    def prune(self) -> None:
        while len(self._dirs) > self.keep:
            shutil.rmtree(self._dirs.pop(0), ignore_errors=True)


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


class VLLMReloadWeightSync:
    """Save a checkpoint and make vLLM reload it from disk (needs ``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(
        self,
        url: str,
        staging_dir: Path,
        *,
        client: httpx.Client | None = None,
        keep: int = 1,
        reload_timeout_s: float = 1800.0,
    ) -> None:
        self.url = url.rstrip("/")
        self._staged = _StagedWeights(staging_dir, keep)
        self._own_client = client is None
        self.client = client or httpx.Client(timeout=reload_timeout_s)

    def push(self, weights: Weights, version: int) -> int:
        # Write before pausing: saving is the slow part and generation continues meanwhile.
        path = self._staged.stage(weights, version)
        try:
            # Inside the try: a pause that failed half-way must still be resumed.
            _check(
                self.client.post(self.url + "/pause", params={"mode": PAUSE_MODE}), "pause (freeze requests)"
            )
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
            _check(
                self.client.post(self.url + "/collective_rpc", json=rpc),
                "reload_weights",
                f"the vLLM server must be able to read {path} (same machine or a shared filesystem)",
            )
            _check(
                self.client.post(self.url + "/update_weight_version", json={"new_version": str(version)}),
                "update_weight_version",
            )
        finally:
            _check(self.client.post(self.url + "/resume"), "resume")
        self._staged.prune()
        return version

    def announce(self, version: int) -> None:
        _check(
            self.client.post(self.url + "/update_weight_version", json={"new_version": str(version)}),
            "update_weight_version",
        )

    def close(self) -> None:
        if self._own_client:
            self.client.close()


class VLLMControlPlane:
    """vLLM 0.33's ``VLLMWeightSyncClient`` protocol (four methods, structural) over our httpx
    client, so vLLM's trainer engine drives the handshake through routes we can record and test.
    ``finish_weight_update`` stamps the version being pushed: vLLM's engine calls it without one."""

    def __init__(self, url: str, client: httpx.Client) -> None:
        self.url = url.rstrip("/")
        self.client = client
        self.pending_version: str | None = None

    def _post(self, path: str, body: dict[str, Any] | None = None) -> None:
        _check(self.client.post(self.url + path, json=body), path.lstrip("/"))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", {"weight_version": weight_version or self.pending_version})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("/shutdown_weight_transfer_engine")


class NcclTransport(Protocol):
    """Trainer side of the NCCL transfer; calls the control plane in vLLM's order."""

    def connect(
        self,
        control: VLLMControlPlane,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        weights: Mapping[str, torch.Tensor],
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
        self._source: Any = None

    def connect(
        self,
        control: VLLMControlPlane,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        weights: Mapping[str, torch.Tensor],
    ) -> None:
        from fineenvs.engine.vllm_client import import_client

        nccl = import_client()
        self._source = _state_dict_source(weights)
        # rank is this trainer process's rank in the transfer group: the single sender is rank 0.
        init = nccl.NCCLTrainerInitInfo(
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
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
        self._source.current = weights
        self._engine.send_weights()

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()


def _state_dict_source(weights: Mapping[str, torch.Tensor]) -> Any:
    from functools import cached_property

    from fineenvs.engine.vllm_client import import_client

    import_client()
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateDictSource(WeightSource):  # type: ignore[misc]
        def __init__(self, current: Mapping[str, torch.Tensor]) -> None:
            self.current = current

        @cached_property
        def metadata(self) -> list[Any]:
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


class VLLMNcclWeightSync:
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
        self.url = url.rstrip("/")
        self.endpoint = endpoint or NcclEndpoint()
        self._own_client = client is None
        self.client = client or httpx.Client(timeout=timeout_s)
        self.control = VLLMControlPlane(self.url, self.client)
        self.transport = transport or VLLMNcclTransport()
        self._connected = False

    def _connect(self, weights: Mapping[str, torch.Tensor]) -> None:
        answer = _check(self.client.get(self.url + "/get_world_size"), "get_world_size").json()
        port = self.endpoint.master_port or free_port(self.endpoint.master_address)
        self.transport.connect(
            self.control,
            master_address=self.endpoint.master_address,
            master_port=port,
            world_size=int(answer["world_size"]) + 1,  # the trainer is rank 0, vLLM's workers follow
            weights=weights,
        )
        self._connected = True

    def push(self, weights: Weights, version: int) -> int:
        if isinstance(weights, Path):
            raise ValueError(
                f"VLLMNcclWeightSync broadcasts in-memory tensors, not checkpoint directories ({weights}). "
                "Pass the state dict, or use engine.weight_sync=reload to load a checkpoint from disk."
            )
        if not self._connected:
            self._connect(weights)
        try:
            _check(
                self.client.post(self.url + "/pause", params={"mode": PAUSE_MODE}), "pause (freeze requests)"
            )
            self.control.pending_version = str(version)
            self.transport.send(weights)
        finally:
            self.control.pending_version = None
            _check(self.client.post(self.url + "/resume"), "resume")
        return version

    def announce(self, version: int) -> None:
        _check(
            self.client.post(self.url + "/update_weight_version", json={"new_version": str(version)}),
            "update_weight_version",
        )

    def close(self) -> None:
        try:
            if self._connected:
                self.transport.shutdown()
                self.control.shutdown_weight_transfer_engine()
        except (httpx.HTTPError, WeightSyncError):
            pass  # the server may already be gone at shutdown
        finally:
            if self._own_client:
                self.client.close()
