"""One process drives a run, the others replay its trainer calls: multi-process training.

Under ``accelerate launch`` with several processes every process runs the same command. Only the
main process may start the engine, the proxy and the agents and push weights (several engines
and agent swarms would fight over the GPUs and push weights over each other); but the trainer's
``step``, ``state_dict`` (an FSDP gather) and ``save_checkpoint`` are collectives that every
process must enter with the same arguments.

``Lockstep(trainer)`` is how the main process calls those: ``lock.call("step", rows)`` first
broadcasts ``("step", (rows,))`` to the others (``accelerate.utils.broadcast_object_list``), then
runs the call; ``lock.follow()`` is the other processes' whole job: receive a call, run it, until
``lock.stop()``. With one process it is a plain method call.

The processes wait in the broadcast while the main process collects rollouts, which takes
minutes: the process group is created with ``ddp_timeout`` long enough for that
(``GRPOSettings.process_timeout_s``, passed to TRL's config).

A call that fails on the main process may have left the others inside its collective (an
all-reduce in ``step``): a "stop" broadcast would then pair with the wrong collective and hang
until the timeout. So after a failed call ``stop`` sends nothing; the main process exits with the
error and ``accelerate launch`` (torch elastic) ends the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from fineenvs.train.grpo import CapturedGRPOTrainer

_T = TypeVar("_T")

CALLS = ("step", "state_dict", "save_checkpoint", "sequence_logprobs")


class Lockstep:
    def __init__(self, trainer: CapturedGRPOTrainer) -> None:
        self.trainer = trainer
        self.accelerator = trainer.accelerator
        self._stopped = False
        self._broken = False

    @property
    def is_main(self) -> bool:
        return bool(self.accelerator.is_main_process)

    @property
    def processes(self) -> int:
        return int(self.accelerator.num_processes)

    def _broadcast(self, message: Any) -> Any:
        from accelerate.utils import broadcast_object_list

        box = [message]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def call(self, name: str, *args: Any) -> Any:
        """Run ``trainer.<name>(*args)`` on every process (main process only)."""
        if name not in CALLS:
            raise ValueError(f"Lockstep.call({name!r}): only {CALLS} are collective trainer calls")
        if not self.is_main:
            raise RuntimeError("Lockstep.call is for the main process; the others run follow()")
        if self.processes > 1:
            self._broadcast((name, args))
        try:
            return getattr(self.trainer, name)(*args)
        except BaseException:
            self._broken = True  # the others may be waiting inside this call's collectives
            raise

    def agree(self, value: _T) -> _T:
        """The main process's ``value`` on every process (every process calls it, in the same order)."""
        return self._broadcast(value) if self.processes > 1 else value

    def follow(self) -> int:
        """Replay the main process's calls until it stops; returns how many ran."""
        ran = 0
        while True:
            name, args = self._broadcast(None)
            if name == "stop":
                return ran
            getattr(self.trainer, name)(*args)
            ran += 1

    def stop(self) -> None:
        """Release the other processes (idempotent; main process only; nothing after a failed call)."""
        if self._stopped or not self.is_main or self._broken:
            return
        self._stopped = True
        if self.processes > 1:
            self._broadcast(("stop", ()))
