"""Optional experiment trackers (Weights & Biases, TensorBoard) fed the metrics of ``log.jsonl``.

``log.jsonl`` is the record of a run and is always written first; trackers are a view of it.
They are off unless ``ESConfig.trackers`` names them, and they can never stop or change a run:
a tracker whose package is missing, that cannot start (offline, no credentials) or that raises
later is reported once through ``echo`` and switched off.  wandb itself buffers when the
network is down (``WANDB_MODE=offline`` writes ``RUN/wandb/`` for a later ``wandb sync``).
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable


class Trackers:
    """The configured trackers of one run.

    names: ``"wandb"`` and/or ``"tensorboard"``.  run_dir: the run directory (TensorBoard writes
    ``RUN/tensorboard/<project>``; wandb uses ``RUN`` as its directory and a run id derived from
    the run directory's absolute path, so a resumed run continues the same wandb run).
    config: logged as the tracker's run config.  echo: where warnings go.
    """

    def __init__(self, names, run_dir: str, project: str, config: dict, echo: Callable[[str], None]):
        self.echo = echo
        self.active: dict[str, object] = {}
        for name in names:
            try:
                self.active[name] = getattr(self, f"_start_{name}")(run_dir, project, config)
            except Exception as e:  # noqa: BLE001 - a tracker never stops a run
                self._drop(name, e, starting=True)

    @staticmethod
    def _start_wandb(run_dir: str, project: str, config: dict):
        import wandb

        run_id = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
        return wandb.init(
            project=project,
            dir=run_dir,
            id=run_id,
            resume="allow",
            config=config,
            name=os.path.basename(os.path.abspath(run_dir)),
        )

    @staticmethod
    def _start_tensorboard(run_dir: str, project: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard", project))

    def _drop(self, name: str, e: BaseException, starting: bool = False) -> None:
        self.active.pop(name, None)
        what = "could not start" if starting else "failed"
        self.echo(
            f"[espert] tracker {name} {what} ({type(e).__name__}: {e}); it is off for this run, "
            f"log.jsonl has every metric"
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Send scalar ``metrics`` for iteration ``step`` to every active tracker."""
        for name, t in list(self.active.items()):
            try:
                if name == "wandb":
                    t.log(metrics, step=step)
                else:
                    for k, v in metrics.items():
                        t.add_scalar(k, v, step)
            except Exception as e:  # noqa: BLE001
                self._drop(name, e)

    def close(self) -> None:
        for name, t in list(self.active.items()):
            try:
                t.finish() if name == "wandb" else t.close()
            except Exception as e:  # noqa: BLE001
                self._drop(name, e)
        self.active.clear()
