"""The update under torchrun: rank 0 plays the rollouts, publishes and evaluates; every rank trains.

Rank 0 broadcasts each step (``train`` with the episode ids it stored, ``load`` of a checkpoint, ``stop``)
and the other ranks, in ``follow()``, read the same episodes from the store (a SQLite file on one host,
Postgres across hosts) and run the same trainer calls: ``train_on`` shards the list by rank and
all-reduces the gradients; saving adapters and checkpoints are collectives where rank 0 writes. With one
process nothing is broadcast.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def rank_and_world() -> tuple[int, int]:
    """torchrun's RANK / WORLD_SIZE, read before the trainer joins the process group."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class TrainStep:
    def __init__(self, trainer: Any, store: Any):
        self.trainer, self.store = trainer, store
        self.world = trainer.world

    def _bcast(self, cmd: Any) -> Any:
        if self.world == 1:
            return cmd
        import torch.distributed as dist

        box = [cmd]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # -- rank 0 ------------------------------------------------------------------------------------

    def train(self, episode_ids: list[str], out_dir: Path, episodes: list | None = None) -> dict:
        """One update on these episodes; the new adapters and the checkpoint written under ``out_dir``."""
        self._bcast(("train", list(episode_ids), str(out_dir)))
        return self._train(episode_ids, out_dir, episodes)

    def load(self, checkpoint: Path) -> None:
        self._bcast(("load", str(checkpoint)))
        self.trainer.load_checkpoint(checkpoint)

    def save_adapters(self, directory: Path) -> None:
        self._bcast(("adapters", str(directory)))
        self.trainer.save_adapters(directory)

    def stop(self) -> None:
        self._bcast(("stop",))

    # -- every rank ----------------------------------------------------------------------------------

    def _train(self, episode_ids: list[str], out_dir: Path, episodes: list | None = None) -> dict:
        if episodes is None:
            by_id = {e.id: e for e in self.store.get_episodes(episode_ids)}
            episodes = [by_id[i] for i in episode_ids]  # the same order on every rank: the same shards
        metrics = self.trainer.train_on(episodes)
        self.trainer.save_adapters(Path(out_dir) / "adapters")
        self.trainer.save_checkpoint(Path(out_dir) / "checkpoint")
        return metrics

    def follow(self) -> None:
        """Ranks > 0: do what rank 0 broadcasts until it says stop."""
        while True:
            cmd = self._bcast(None)
            if cmd[0] == "stop":
                return
            if cmd[0] == "train":
                self._train(cmd[1], Path(cmd[2]))
            elif cmd[0] == "load":
                self.trainer.load_checkpoint(Path(cmd[1]))
            elif cmd[0] == "adapters":
                self.trainer.save_adapters(Path(cmd[1]))
