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
(``fineenvs.train.trl_compat``).
"""

from __future__ import annotations

from typing import Any

CALLS = ("step", "state_dict", "save_checkpoint")


class Lockstep:
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.accelerator = trainer.accelerator
        self._stopped = False

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
        return getattr(self.trainer, name)(*args)

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
        """Release the other processes (idempotent; main process only)."""
        if self._stopped or not self.is_main:
            return
        self._stopped = True
        if self.processes > 1:
            self._broadcast(("stop", ()))
