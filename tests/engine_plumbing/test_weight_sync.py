"""Weight sync call sequences against a recording fake server (on the real vLLM: the ``vllm``
tier, ``test_vllm_cpu.py``)."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from fineenvs.engine.weights import (
    EmbeddedWeightSync,
    NcclEndpoint,
    NcclGroup,
    VLLMControlPlane,
    VLLMFileTransferWeightSync,
    VLLMNcclWeightSync,
    VLLMReloadWeightSync,
    WeightSyncError,
    save_safetensors,
)


class Recorder:
    """Records (method, path, query, body) and answers like vLLM's dev routes."""

    def __init__(
        self,
        fail: str | None = None,
        *,
        dead_after_failure: bool = False,
        stuck_version: bool = False,
        fail_error: str = "boom",
    ) -> None:
        self.calls: list[tuple[str, str, dict[str, str], Any]] = []
        self.fail = fail
        self.fail_error = fail_error
        self.dead = False
        self.dead_after_failure = dead_after_failure
        self.stuck_version = stuck_version
        self.version = "default"
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        path = request.url.path
        with self.lock:
            self.calls.append((request.method, path, dict(request.url.params), body))
        if self.dead:
            raise httpx.ConnectError("connection refused")
        if path == self.fail:
            self.dead = self.dead_after_failure
            return httpx.Response(500, json={"error": self.fail_error})
        if path == "/get_world_size":
            return httpx.Response(200, json={"world_size": 2})
        if path == "/update_weight_version" and not self.stuck_version:
            self.version = body["new_version"]
        if path == "/finish_weight_update" and not self.stuck_version:
            self.version = body["weight_version"]
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.version})
        if path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        if request.url.path == "/update_weights_from_path":
            assert body is not None
            return httpx.Response(200, json={"weight_version": body["weight_version"]})
        return httpx.Response(200, json={"status": "ok"})

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self))

    @property
    def paths(self) -> list[str]:
        return [path for _, path, _, _ in self.calls if path != "/health"]


def state_dict() -> dict[str, torch.Tensor]:
    embed = torch.randn(16, 4)
    return {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "model.norm.weight": torch.ones(4)}


def test_save_safetensors_handles_tied_weights(tmp_path: Path) -> None:
    weights = state_dict()
    loaded = load_file(str(save_safetensors(weights, tmp_path)))
    assert set(loaded) == set(weights)
    assert torch.equal(loaded["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert not (tmp_path / "model.safetensors.partial").exists()


def test_embedded_sync_saves_and_posts_the_path(tmp_path: Path) -> None:
    rec = Recorder()
    sync = EmbeddedWeightSync("http://engine", tmp_path / "staging", client=rec.client())
    assert sync.push(state_dict(), 1) == 1
    assert sync.push(state_dict(), 2) == 2
    (_, path, _, body), last = rec.calls[0], rec.calls[-1]
    assert path == "/update_weights_from_path" and body["weight_version"] == 1
    assert Path(last[3]["path"]) == (tmp_path / "staging" / "v000002").resolve()
    assert set(load_file(str(Path(last[3]["path"]) / "model.safetensors"))) == set(state_dict())
    assert not (tmp_path / "staging" / "v000001").exists(), "older staged versions are pruned"


def test_embedded_sync_passes_checkpoint_dirs_through_and_reports_rejection(tmp_path: Path) -> None:
    rec = Recorder(fail="/update_weights_from_path")
    sync = EmbeddedWeightSync("http://engine", tmp_path / "staging", client=rec.client())
    save_safetensors(state_dict(), tmp_path)
    with pytest.raises(WeightSyncError, match="answered 500"):
        sync.push(tmp_path, 4)
    assert rec.calls[0][3]["path"] == str(tmp_path.resolve())
    with pytest.raises(FileNotFoundError):
        sync.push(tmp_path / "missing", 5)


def test_vllm_reload_sequence(tmp_path: Path) -> None:
    rec = Recorder()
    sync = VLLMReloadWeightSync("http://vllm", tmp_path, client=rec.client())
    assert sync.push(state_dict(), 7) == 7
    assert rec.paths == [
        "/pause", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache", "/resume", "/weight_info"
    ]  # fmt: skip
    # keep: running requests freeze and new ones queue; wait/abort would answer agents 503.
    assert rec.calls[0][2] == {"mode": "keep"}
    # Requests frozen mid-generation are recomputed with the new weights: no old prefix survives.
    assert rec.calls[3][2] == {"reset_running_requests": "true"}
    rpc = rec.calls[1][3]
    assert rpc["method"] == "reload_weights"
    # A directory: vLLM's reload_weights takes anything else for a Hugging Face repo id.
    assert Path(rpc["kwargs"]["weights_path"]).is_dir()
    assert (Path(rpc["kwargs"]["weights_path"]) / "model.safetensors").is_file()
    assert rec.calls[2][3] == {"new_version": "7"}
    with pytest.raises(ValueError, match="directory"):
        sync.push(Path(rpc["kwargs"]["weights_path"]) / "model.safetensors", 8)
    sync.announce(0)
    assert rec.calls[-1][1:] == ("/update_weight_version", {}, {"new_version": "0"})


def test_vllm_reload_resumes_even_when_reload_fails(tmp_path: Path) -> None:
    """A reload that failed may have loaded some layers already: the error does not claim the
    previous weights are intact."""
    rec = Recorder(fail="/collective_rpc")
    sync = VLLMReloadWeightSync("http://vllm", tmp_path, client=rec.client())
    with pytest.raises(
        WeightSyncError, match="reload_weights.*still up, but its weights may be partly updated"
    ):
        sync.push(state_dict(), 8)
    assert rec.paths == ["/pause", "/collective_rpc", "/resume"]


def test_a_failed_pause_still_resumes_and_keeps_the_previous_weights(tmp_path: Path) -> None:
    """A pause that failed (or timed out) may have taken effect: resume is sent anyway."""
    rec = Recorder(fail="/pause")
    sync = VLLMReloadWeightSync("http://vllm", tmp_path, client=rec.client())
    with pytest.raises(WeightSyncError, match="pause.*still up and serves the previous weights"):
        sync.push(state_dict(), 8)
    assert rec.paths == ["/pause", "/resume"]


def test_a_failed_resume_says_the_server_may_still_be_paused(tmp_path: Path) -> None:
    rec = Recorder(fail="/resume")
    sync = VLLMReloadWeightSync("http://vllm", tmp_path, client=rec.client())
    with pytest.raises(WeightSyncError, match="resume.*may still be paused.*holds the new weights"):
        sync.push(state_dict(), 8)
    assert rec.paths == [
        "/pause",
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/resume",
    ]


def test_file_transfer_tells_a_refused_update_from_one_that_failed_midway(tmp_path: Path) -> None:
    """The plugin marks an update it refused before loading anything; any other failure of
    update_weights may have loaded part of the weights."""
    from fineenvs.engine.vllm_plugin.fineenvs_vllm_plugin import REFUSED

    refused = Recorder(fail="/update_weights", fail_error=f"{REFUSED}: update_info.path is outside")
    sync = VLLMFileTransferWeightSync("http://vllm", tmp_path / "a", client=refused.client())
    with pytest.raises(WeightSyncError, match="outside.*still up and serves the previous weights"):
        sync.push(state_dict(), 2)
    midway = Recorder(fail="/update_weights", fail_error="out of memory")
    sync = VLLMFileTransferWeightSync("http://vllm", tmp_path / "b", client=midway.client())
    with pytest.raises(WeightSyncError, match="out of memory.*weights may be partly updated"):
        sync.push(state_dict(), 2)
    for rec in (refused, midway):
        assert rec.paths[-1] == "/resume" and "/finish_weight_update" not in rec.paths


def test_a_push_that_kills_the_server_is_reported_as_such(tmp_path: Path) -> None:
    """The failure the run reports names the dead server and its log, not the resume that failed after."""
    rec = Recorder(fail="/collective_rpc", dead_after_failure=True)
    sync = VLLMReloadWeightSync("http://vllm", tmp_path, client=rec.client(), log_path=tmp_path / "vllm.log")
    with pytest.raises(
        WeightSyncError, match="reload_weights.*died during the push.*vllm.log.*resumes"
    ) as err:
        sync.push(state_dict(), 8)
    assert "resume" not in str(err.value).split("died")[0].split("reload_weights")[0]


def test_a_version_that_did_not_move_is_an_error(tmp_path: Path) -> None:
    rec = Recorder(stuck_version=True)
    sync = VLLMReloadWeightSync("http://vllm", tmp_path, client=rec.client())
    with pytest.raises(WeightSyncError, match="reports 'default'.*did not move"):
        sync.push(state_dict(), 3)


def test_staged_weights_are_complete_before_they_get_their_name(tmp_path: Path) -> None:
    rec = Recorder()
    sync = VLLMReloadWeightSync("http://vllm", tmp_path, client=rec.client())
    sync.push(state_dict(), 1)
    staged = Path(rec.calls[1][3]["kwargs"]["weights_path"])
    assert staged.name == "v000001" and not staged.with_name("v000001.partial").exists()
    assert set(load_file(str(staged / "model.safetensors"))) == set(state_dict())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no \\*.safetensors file"):
        sync.push(tmp_path / "empty", 2)
    assert rec.paths.count("/collective_rpc") == 1, "a folder with nothing to load never reaches vLLM"


def test_file_transfer_sequence(tmp_path: Path) -> None:
    """vLLM's four weight-transfer phases, with the tensors in a file in the transfer folder."""
    rec = Recorder()
    sync = VLLMFileTransferWeightSync("http://vllm", tmp_path / "xfer", client=rec.client())
    assert sync.push(state_dict(), 5) == 5
    assert sync.push(state_dict(), 6) == 6
    one = [
        "/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache",
        "/resume", "/weight_info",
    ]  # fmt: skip
    assert rec.paths == ["/init_weight_transfer_engine", *one, *one]
    assert rec.calls[0][3] == {"init_info": {"directory": str((tmp_path / "xfer").resolve())}}
    update = [c[3]["update_info"] for c in rec.calls if c[1] == "/update_weights"]
    assert [Path(u["path"]).name for u in update] == ["v000005.safetensors", "v000006.safetensors"]
    assert all(u["names"] is None for u in update)
    assert [c[3] for c in rec.calls if c[1] == "/finish_weight_update"] == [
        {"weight_version": "5"},
        {"weight_version": "6"},
    ]
    assert set(load_file(update[1]["path"])) == set(state_dict())
    assert not Path(update[0]["path"]).exists(), "older files are pruned"
    sync.close()
    assert rec.paths[-1] == "/shutdown_weight_transfer_engine"


def test_file_transfer_failure_resumes_and_keeps_the_cause(tmp_path: Path) -> None:
    rec = Recorder(fail="/update_weights")
    sync = VLLMFileTransferWeightSync("http://vllm", tmp_path / "xfer", client=rec.client())
    with pytest.raises(WeightSyncError, match="update_weights"):
        sync.push(state_dict(), 1)
    assert rec.paths[-1] == "/resume" and "/finish_weight_update" not in rec.paths


class FakeNccl:
    """Calls the control plane the way vLLM 0.33's NCCLTrainerWeightTransferEngine does
    (trainer_init: init RPC in a thread during the rendezvous; send_weights: start, update in a
    thread alongside the broadcast, finish without a version)."""

    def __init__(self) -> None:
        self.control: VLLMControlPlane | None = None
        self.connected: list[tuple[str, int, int]] = []
        self.sent: list[list[str]] = []

    def connect(
        self, control: VLLMControlPlane, group: NcclGroup, weights: Mapping[str, torch.Tensor]
    ) -> None:
        self.control = control
        self.connected.append((group.master_address, group.master_port, group.world_size))
        payload = {"master_address": group.master_address, "master_port": group.master_port, "rank_offset": 1,
                   "world_size": group.world_size, "packed": True}  # fmt: skip
        thread = threading.Thread(target=control.init_weight_transfer_engine, args=(payload,))
        thread.start()
        thread.join()

    def send(self, weights: Mapping[str, torch.Tensor]) -> None:
        assert self.control is not None
        self.control.start_weight_update()
        info = {"names": list(weights), "dtype_names": [str(t.dtype).split(".")[-1] for t in weights.values()],
                "shapes": [list(t.shape) for t in weights.values()]}  # fmt: skip
        errors: list[BaseException] = []

        def update() -> None:
            try:
                self.control.update_weights(info)  # type: ignore[union-attr]
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=update)
        thread.start()
        self.sent.append(list(weights))  # the broadcast would happen here
        thread.join()
        if errors:
            raise errors[0]
        self.control.finish_weight_update()

    def shutdown(self) -> None:
        pass


def test_vllm_nccl_sequence() -> None:
    rec, nccl = Recorder(), FakeNccl()
    sync = VLLMNcclWeightSync(
        "http://vllm", client=rec.client(), transport=nccl, endpoint=NcclEndpoint("10.0.0.1", 29555)
    )
    weights = {"a": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.ones(4)}
    assert sync.push(weights, 3) == 3
    assert sync.push(weights, 4) == 4
    assert rec.paths[:2] == ["/get_world_size", "/init_weight_transfer_engine"]
    update = [
        "/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache",
        "/resume", "/weight_info",
    ]  # fmt: skip
    assert rec.paths[2:] == update + update, "connect once, then one drained handshake per push"
    assert nccl.connected == [("10.0.0.1", 29555, 3)]  # vLLM world size 2 + the trainer
    assert rec.calls[1][3]["init_info"]["world_size"] == 3
    assert rec.calls[2][2] == {"mode": "keep"}
    assert rec.calls[4][3] == {
        "update_info": {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], [4]]}
    }
    finished = [c[3] for c in rec.calls if c[1] == "/finish_weight_update"]
    assert finished == [{"weight_version": "3"}, {"weight_version": "4"}]
    assert nccl.sent == [["a", "b"], ["a", "b"]]
    sync.close()
    assert rec.paths[-1] == "/shutdown_weight_transfer_engine"


def test_vllm_nccl_resumes_after_a_failed_update_and_refuses_checkpoint_dirs(tmp_path: Path) -> None:
    rec = Recorder(fail="/update_weights")
    sync = VLLMNcclWeightSync("http://vllm", client=rec.client(), transport=FakeNccl())
    with pytest.raises(WeightSyncError, match="update_weights"):
        sync.push({"a": torch.zeros(1)}, 1)
    assert rec.paths[-1] == "/resume" and "/finish_weight_update" not in rec.paths
    assert sync.control.pending_version is None
    with pytest.raises(ValueError, match="engine.weight_sync=reload"):
        sync.push(tmp_path, 2)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_nccl_transport_imports_vllm_only_when_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fineenvs.engine.weights import VLLMNcclTransport

    monkeypatch.setenv("FINEENVS_VLLM_CLIENT", str(tmp_path / "no-client"))
    transport = VLLMNcclTransport()  # constructing must not need vllm
    control = VLLMControlPlane("http://vllm", httpx.Client(transport=httpx.MockTransport(Recorder())))
    with pytest.raises(ImportError, match="install-vllm-client"):
        transport.connect(control, NcclGroup("127.0.0.1", 1, world_size=2), weights={})
