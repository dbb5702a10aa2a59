"""Which GPUs vLLM gets and which the trainer keeps, decided before anything touches CUDA.

vLLM claims ``gpu_memory_utilization`` (85 % by default) of every GPU it can see, so a trainer on
one of those GPUs runs out of memory. The launched server therefore always gets an explicit
``CUDA_VISIBLE_DEVICES``; when the job trains, the trainer keeps the other GPUs.

``plan_devices`` is pure: GPUs are named as ``nvidia-smi -L`` does (index or UUID), ``visible``
is the caller's own ``CUDA_VISIBLE_DEVICES`` (None when unset: every GPU).

- ``engine.devices`` set: vLLM gets exactly those; they must exist and, when training, must not
  overlap the GPUs the trainer was started with.
- unset, not training (evaluation, teacher collection): vLLM gets the first TP x DP GPUs the job
  can see.
- unset, training, ``CUDA_VISIBLE_DEVICES`` unset: vLLM gets the last TP x DP GPUs and the trainer
  the rest (the published layout on two GPUs: trainer on GPU 0, vLLM on GPU 1).
- unset, training, ``CUDA_VISIBLE_DEVICES`` set (``accelerate launch``, a SLURM allocation): the
  trainer keeps what it was given and vLLM gets the first TP x DP GPUs outside it; when there are
  none outside (a SLURM job sees only its own), the visible GPUs are split as above.

Under several trainer processes on the machine (``accelerate launch --num_processes N``), the
trainer must keep at least N GPUs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_GPU_LINE = re.compile(r"^GPU (\d+):.*?\(UUID: (GPU-[0-9a-fA-F-]+)\)")


@dataclass(frozen=True)
class Gpu:
    index: str
    uuid: str | None = None

    def named(self, name: str) -> bool:
        return name == self.index or (self.uuid is not None and name == self.uuid)


@dataclass(frozen=True)
class DevicePlan:
    engine: tuple[str, ...]
    """The server's ``CUDA_VISIBLE_DEVICES``."""
    trainer: tuple[str, ...] | None
    """The trainer's ``CUDA_VISIBLE_DEVICES`` to set before CUDA starts (None: leave it)."""
    reason: str
    """One line for the plan: what was chosen and why."""


class DeviceError(ValueError):
    """The GPUs cannot be split as asked; the message says how to fix it."""


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """GPUs from ``nvidia-smi -L`` output (``GPU 0: NVIDIA H200 (UUID: GPU-...)``)."""
    gpus = []
    for line in text.splitlines():
        m = _GPU_LINE.match(line.strip())
        if m:
            gpus.append(Gpu(m.group(1), m.group(2)))
        elif line.startswith("GPU "):
            gpus.append(Gpu(line.split(":", 1)[0].split()[1]))
    return gpus


def visible_from_env(env: dict[str, str] | None = None) -> list[str] | None:
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def plan_devices(
    gpus: list[Gpu],
    *,
    visible: list[str] | None,
    engine_devices: list[str],
    needed: int,
    training: bool,
    trainer_processes: int = 1,
) -> DevicePlan:
    """Split ``gpus`` between the launched vLLM (``needed`` = TP x DP GPUs) and the trainer, whose
    ``trainer_processes`` processes on this machine need a GPU each."""
    plan = _plan(gpus, visible=visible, engine_devices=engine_devices, needed=needed, training=training)
    if training and trainer_processes > 1:
        left = plan.trainer if plan.trainer is not None else tuple(visible or ())
        if len(left) < trainer_processes:
            raise DeviceError(
                f"the trainer runs {trainer_processes} processes on this machine (accelerate launch "
                f"--num_processes) but {len(left)} GPU(s) are left for it ({', '.join(left) or 'none'}) after "
                f"vLLM's {', '.join(plan.engine)}. Fix: launch {len(left) or 1} trainer process(es), lower "
                "engine.tensor_parallel_size / engine.data_parallel_size, or run on more GPUs."
            )
    return plan


def _plan(
    gpus: list[Gpu], *, visible: list[str] | None, engine_devices: list[str], needed: int, training: bool
) -> DevicePlan:
    names = {g.index for g in gpus} | {g.uuid for g in gpus if g.uuid}
    if visible is not None:
        unknown = [v for v in visible if v not in names]
        if unknown and gpus:
            raise DeviceError(
                f"CUDA_VISIBLE_DEVICES names {', '.join(unknown)}, which nvidia-smi does not list "
                f"({', '.join(g.index for g in gpus)}). Fix: CUDA_VISIBLE_DEVICES=<indices from nvidia-smi -L>."
            )
    mine = [g for g in gpus if visible is None or any(g.named(v) for v in visible)]
    if engine_devices:
        _check_engine_devices(gpus, names, engine_devices, needed)
        return _named_plan(
            gpus, mine, visible=visible, engine_devices=engine_devices, needed=needed, training=training
        )
    return _default_plan(gpus, mine, visible=visible, needed=needed, training=training)


def _check_engine_devices(gpus: list[Gpu], names: set[str], engine_devices: list[str], needed: int) -> None:
    """Refuse an ``engine.devices`` that names a GPU twice, one nvidia-smi does not list, or the
    wrong number of GPUs for vLLM's ranks."""
    if len(set(engine_devices)) != len(engine_devices):
        raise DeviceError(
            f"engine.devices={engine_devices} names a GPU twice: vLLM needs distinct GPUs, one per rank. "
            "Fix: list each GPU once."
        )
    missing = [d for d in engine_devices if d not in names]
    if missing:
        raise DeviceError(
            f"engine.devices names {', '.join(missing)}, which nvidia-smi does not list "
            f"(GPUs here: {', '.join(g.index for g in gpus) or 'none'}). Fix: engine.devices=[<index>, ...]."
        )
    if len(engine_devices) != needed:
        raise DeviceError(
            f"engine.devices has {len(engine_devices)} GPU(s) but engine.tensor_parallel_size x "
            f"engine.data_parallel_size is {needed}: vLLM needs exactly one GPU per rank. Fix: list "
            f"{needed} GPU(s) in engine.devices, or change the parallel sizes."
        )


def _named_plan(
    gpus: list[Gpu],
    mine: list[Gpu],
    *,
    visible: list[str] | None,
    engine_devices: list[str],
    needed: int,
    training: bool,
) -> DevicePlan:
    """vLLM on the GPUs ``engine.devices`` names; the trainer on what is left (or what it sees)."""
    chosen = [g for g in gpus if any(g.named(d) for d in engine_devices)]
    if not training:
        return DevicePlan(tuple(engine_devices), None, f"vLLM on GPU(s) {', '.join(engine_devices)}")
    if visible is not None:
        shared = [g.index for g in mine if g in chosen]
        if shared:
            raise DeviceError(
                f"engine.devices={engine_devices} overlaps the trainer's GPUs (CUDA_VISIBLE_DEVICES="
                f"{','.join(visible)}): vLLM claims engine.gpu_memory_utilization of each GPU it sees, so "
                f"the trainer would run out of memory on GPU(s) {', '.join(shared)}. Fix: start the run "
                "with CUDA_VISIBLE_DEVICES naming only the trainer's GPUs, or pick other engine.devices."
            )
        return DevicePlan(
            tuple(engine_devices), None,
            f"vLLM on GPU(s) {', '.join(engine_devices)}; trainer keeps CUDA_VISIBLE_DEVICES={','.join(visible)}",
        )  # fmt: skip
    rest = tuple(g.index for g in gpus if g not in chosen)
    if not rest:
        raise DeviceError(_no_trainer_gpu(gpus, needed))
    return DevicePlan(
        tuple(engine_devices), rest,
        f"vLLM on GPU(s) {', '.join(engine_devices)}; trainer on GPU(s) {', '.join(rest)}",
    )  # fmt: skip


def _default_plan(
    gpus: list[Gpu], mine: list[Gpu], *, visible: list[str] | None, needed: int, training: bool
) -> DevicePlan:
    """vLLM's GPUs when ``engine.devices`` is unset: the last ones, or those outside the trainer's
    ``CUDA_VISIBLE_DEVICES``."""
    if not training:
        if len(mine) < needed:
            raise DeviceError(_too_few(mine, needed, "vLLM"))
        engine = tuple(g.index for g in mine[:needed])
        return DevicePlan(
            engine, None, f"vLLM on GPU(s) {', '.join(engine)} (engine.devices unset: the first)"
        )
    if visible is None:
        if len(gpus) < needed + 1:
            raise DeviceError(_no_trainer_gpu(gpus, needed))
        engine = tuple(g.index for g in gpus[-needed:])
        trainer = tuple(g.index for g in gpus[:-needed])
        return DevicePlan(
            engine, trainer,
            f"vLLM on GPU(s) {', '.join(engine)} (the last), trainer on GPU(s) {', '.join(trainer)} "
            "(engine.devices unset)",
        )  # fmt: skip
    outside = [g for g in gpus if g not in mine]
    if len(outside) < needed:
        # A job whose CUDA_VISIBLE_DEVICES names all of its GPUs (SLURM): split within them.
        if len(mine) >= needed + 1:
            engine = tuple(g.index for g in mine[-needed:])
            trainer = tuple(g.index for g in mine[:-needed])
            return DevicePlan(
                engine, trainer,
                f"vLLM on GPU(s) {', '.join(engine)}, trainer on GPU(s) {', '.join(trainer)} (split within "
                f"CUDA_VISIBLE_DEVICES={','.join(visible)}: no GPU outside it)",
            )  # fmt: skip
        raise DeviceError(
            f"the trainer was started with CUDA_VISIBLE_DEVICES={','.join(visible)} and vLLM needs {needed} "
            f"more GPU(s), but only {len(outside)} other GPU(s) exist ({', '.join(g.index for g in outside) or 'none'}) "
            "and too few are visible to split. Fix: make one more GPU visible, name vLLM's GPUs with "
            "engine.devices=[...], or attach to a vLLM server elsewhere with engine.url=http://HOST:PORT."
        )
    engine = tuple(g.index for g in outside[:needed])
    return DevicePlan(
        engine, None,
        f"vLLM on GPU(s) {', '.join(engine)} (outside the trainer's CUDA_VISIBLE_DEVICES={','.join(visible)})",
    )  # fmt: skip


def _too_few(gpus: list[Gpu], needed: int, who: str) -> str:
    return (
        f"{who} needs {needed} GPU(s) (engine.tensor_parallel_size x engine.data_parallel_size) but "
        f"{len(gpus)} are visible. Fix: lower engine.data_parallel_size / engine.tensor_parallel_size, or "
        "make more GPUs visible."
    )


def _no_trainer_gpu(gpus: list[Gpu], needed: int) -> str:
    return (
        f"training with a launched vLLM needs {needed} GPU(s) for vLLM (engine.tensor_parallel_size x "
        f"engine.data_parallel_size) and at least one more for the trainer, but {len(gpus)} GPU(s) exist: "
        "vLLM claims engine.gpu_memory_utilization of each GPU it sees, so the two cannot share one. Fix: "
        "run on a machine with one more GPU, lower engine.data_parallel_size, or attach to a vLLM server "
        "on other GPUs with engine.url=http://HOST:PORT."
    )


# --- replicas ------------------------------------------------------------------------------------


def per_replica(devices: tuple[str, ...], replicas: int) -> list[tuple[str, ...]]:
    """The engine's GPUs in order, ``len(devices) // replicas`` to each replica (TP x DP each)."""
    size, rest = divmod(len(devices), replicas)
    if size == 0 or rest:
        raise DeviceError(
            f"{len(devices)} GPU(s) for vLLM ({', '.join(devices)}) do not split into {replicas} replicas of "
            "engine.tensor_parallel_size x engine.data_parallel_size each. Fix: engine.replicas, or the GPUs "
            "given (engine.devices, CUDA_VISIBLE_DEVICES)"
        )
    return [devices[i * size : (i + 1) * size] for i in range(replicas)]


def parse_core_list(spec: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]`` (the syntax of ``VLLM_CPU_OMP_THREADS_BIND`` and taskset)."""
    cores: list[int] = []
    for part in spec.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"{part!r} is not a core or a range of cores. Fix: a list like 0-3,6")
        cores += range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1)
    return cores


def split_cores(cores: list[int], replicas: int) -> list[str]:
    """This machine's ``cores`` in order, an even share to each replica, as core lists."""
    size = len(cores) // replicas
    if size == 0:
        raise DeviceError(
            f"engine.replicas={replicas} on the CPU needs a core per replica at least, and this process may "
            f"use {len(cores)} ({cores}). Fix: engine.replicas={len(cores) or 1}, or run on a larger machine"
        )
    return [",".join(str(c) for c in cores[i * size : (i + 1) * size]) for i in range(replicas)]


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))
