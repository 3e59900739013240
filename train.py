"""Pretrain a Llama: python train.py [hydra overrides], e.g.

    python train.py                                    # tiny model, embedded corpus, a few CPU minutes
    python train.py model=llama3_125m trainer.max_steps=2000 trainer.run_dir=runs/125m
    python train.py -m model.impl=coda,eager           # one run per value (multirun)

Exit codes: 0 finished, or stopped by SIGTERM/SIGINT after saving a checkpoint, or during data preparation
(a multirun stops too; run again with the trainer.run_dir the message names to continue); 1 bad input (config, data, backend, checkpoint, or the run dir in
use by another run; nothing trained); 3 the loss or gradient norm became non-finite (that state is not
saved); 4 a file of the run dir could not be written (disk full, read-only, permissions; the newest
checkpoint is intact: fix the cause and run again to continue).
"""

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from coda_train.config import register_configs, to_dataclass
from coda_train.errors import ConfigError
from coda_train.trainer.loop import EXIT_BAD_INPUT, STOP_ERRORS, exit_code, train

log = logging.getLogger("train")
register_configs()


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        config = to_dataclass(cfg)
    except ConfigError as e:
        log.error("%s", e)
        sys.exit(EXIT_BAD_INPUT)
    try:
        hydra_config = HydraConfig.get()
        sweep_dir = Path(hydra_config.sweep.dir) if hydra_config.mode == RunMode.MULTIRUN else None
        end = train(config, Path(hydra_config.runtime.output_dir), sweep_dir)
    except STOP_ERRORS as e:  # train() logged it; kernels.BackendError is a ConfigError
        sys.exit(exit_code(e))
    if end.stopped_by:  # saved and stopped: exit now, so a multirun sweep stops too instead of starting its next job
        sys.exit(0)


def refuse_a_file_as_run_dir(argv: list[str]) -> None:
    """Hydra makes trainer.run_dir before main() runs, and a path that is a file stops it with a traceback."""
    for arg in argv:
        if arg.startswith(("trainer.run_dir=", "+trainer.run_dir=", "++trainer.run_dir=")):
            path = Path(arg.split("=", 1)[1]).expanduser().absolute()
            existing = next(p for p in (path, *path.parents) if p.exists())  # the run dir, or where it would be made
            if not existing.is_dir():
                print(f"trainer.run_dir={path}: {existing} is a file, not a directory; name a new or existing directory "
                      "(a run's files go there)", file=sys.stderr)
                sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    refuse_a_file_as_run_dir(sys.argv[1:])
    main()
