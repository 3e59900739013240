"""Pretrain a Llama: python train.py [hydra overrides], e.g.

    python train.py                                    # tiny model, embedded corpus, a few CPU minutes
    python train.py model=llama3_125m trainer.max_steps=2000 trainer.run_dir=runs/125m
    python train.py -m model.impl=coda,eager           # one run per value (multirun)

Exit codes: 0 finished, or stopped by SIGTERM/SIGINT after saving a checkpoint, or during data preparation
(a multirun stops too; run again with the trainer.run_dir the message names to continue); 1 bad input (config,
data, backend, checkpoint, or the run dir in use by another run; nothing trained), or a step out of GPU memory
mid-run (its checkpoints up to the last saved step kept); 3 the loss or gradient norm
became non-finite (that state is not saved); 4 a file of the run dir could not be written, or the run dir cannot
be made, or data.cache_dir cannot take the data being prepared (disk full, read-only, permissions; the newest
checkpoint is intact: fix the cause and run again to continue). In a multirun, every job's config is checked
before the first job runs (a bad value stops the sweep with 1); past that, a job stopping with 1 or 3 does not stop
the sweep: the other jobs run, and train.py then names each failed job and exits with the first one's code.
"""

import faulthandler
import itertools
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import hydra
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import QuotedString
from hydra.errors import ConfigCompositionException, HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import InterpolationResolutionError

from coda_train.config import Config, check_config, register_configs, to_dataclass
from coda_train.data import DataError
from coda_train.durable import replace_synced
from coda_train.errors import ConfigError
from coda_train.kernels import resolve_backend
from coda_train.trainer.build import backend_on_device, check_compute, check_model_before_data
from coda_train.trainer.checkpoint import CHECKPOINTS_DIR, check_ckpt_async, list_checkpoints, resumes
from coda_train.trainer.device import pick_compute_dtype
from coda_train.trainer.loop import (CONFIG_FILE, EXIT_BAD_INPUT, EXIT_NON_FINITE, STOP_ERRORS, exit_code,
                                     recorded_config, train)
from coda_train.trainer.metrics import METRICS_FILE
from coda_train.trainer.rundir import EarlyWarnings, check_run_dir_path

log = logging.getLogger("train")
register_configs()
CONFIG_DIR = str(Path(__file__).resolve().parent / "configs")  # what @hydra.main composes from (config_path="configs")
JOB_NAME = Path(__file__).stem  # hydra.job.name in a run: the script's name
# hydra's flags that choose another config than configs/config.yaml
CONFIG_FLAGS = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd")


# multirun jobs that stopped on their own input or diverged, as (job number, its run dir, exit code): the sweep
# goes on with its other jobs (e.g. an lr sweep whose largest lr diverges) and train.py exits with the first code
failed_jobs: list[tuple[int, str, int]] = []
# the run dir values of the command line (run_dir_keys) that existed before hydra made the rest
existing_run_dirs: set[Path] = set()
# the dirs above those run dirs, and above configs/config.yaml's default ones (outputs/<date>/, multirun/<date>/), that did
# not exist before: hydra makes them with the run dir, and a start refused leaves none of them behind
new_parent_dirs: set[Path] = set()
# the multirun jobs main() was called for, by number, and those that stopped with exit 1 having changed nothing in
# their run dir: a sweep all of whose jobs were refused so leaves the sweep dir's record as it was
started_jobs: list[int] = []
refused_jobs: list[int] = []
# each multirun job's run dir so far, and its job number: a second job in one dir would resume the first's run as its own
job_dirs: dict[Path, int] = {}
SWEEP_DIR = "hydra.sweep.dir"  # where a multirun puts its job dirs (<it>/<job number>): trainer.run_dir unless overridden
RUN_DIR = "hydra.run.dir"  # a single run's dir: trainer.run_dir unless overridden
SWEEP_SUBDIR = "hydra.sweep.subdir"  # a job's dir under the sweep dir: ${hydra.job.num} unless overridden
SWEEP_RECORD = "multirun.yaml"  # hydra's record of a sweep (its config and command line), written as the sweep starts


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hydra_config = HydraConfig.get()
    sweep_dir = Path(hydra_config.sweep.dir) if hydra_config.mode == RunMode.MULTIRUN else None
    run_dir = Path(hydra_config.runtime.output_dir)
    if sweep_dir is not None:
        started_jobs.append(hydra_config.job.num)
    before = runs_record(run_dir)
    try:
        try:
            config = to_dataclass(cfg)
            if sweep_dir is not None:
                check_job_dir_is_its_own(run_dir, hydra_config.job.num)
        except ConfigError as e:
            log.error("%s", e)
            raise
        with EarlyWarnings().attached() as early:  # train.log gets what is said before the run holds its dir
            say_preset_unused(config, list(hydra_config.overrides.task))
            end = train(config, run_dir, sweep_dir, early)
    except STOP_ERRORS as e:  # train() logged it; kernels.BackendError is a ConfigError
        code = exit_code(e)
        remove_if_made_here_and_empty(run_dir)
        if sweep_dir is None or code not in (EXIT_BAD_INPUT, EXIT_NON_FINITE):  # a stop signal or a full disk ends a sweep
            sys.exit(code)
        failed_jobs.append((hydra_config.job.num, str(run_dir), code))
        if code == EXIT_BAD_INPUT and runs_record(run_dir) == before:  # refused at its start, not stopped mid-run
            refused_jobs.append(hydra_config.job.num)
        log.error("multirun job #%d stopped (exit code %d); the sweep goes on with its next job", hydra_config.job.num, code)
        return
    if end.stopped_by:  # saved and stopped: exit now, so a multirun sweep stops too instead of starting its next job
        sys.exit(0)


def runs_record(run_dir: Path) -> tuple[Optional[tuple[int, int]], list[str]]:
    """What a run leaves of its steps in run_dir: its metrics.jsonl (size, modification time) and its checkpoints'
    names. A job that stops with exit 1 mid-run (a step out of GPU memory) has changed it; one refused at its start not."""
    metrics = run_dir / METRICS_FILE
    stat = metrics.stat() if metrics.is_file() else None
    return ((stat.st_size, stat.st_mtime_ns) if stat else None,
            sorted(p.name for p in list_checkpoints(run_dir / CHECKPOINTS_DIR)))


def check_job_dir_is_its_own(run_dir: Path, job: int) -> None:
    """A sweep whose hydra.sweep.subdir (or swept trainer.run_dir) puts two jobs in one dir: the later job would resume
    the earlier one's finished run (trainer.resume=auto), change its settings and train nothing. ConfigError."""
    earlier = job_dirs.setdefault(run_dir.absolute(), job)
    if earlier != job:
        raise ConfigError(f"multirun job #{job}'s run dir {run_dir} is job #{earlier}'s too, and this job would resume that "
                          f"run as its own: give each job a dir of its own (leave {SWEEP_SUBDIR} unset: its default, "
                          "${hydra.job.num}, is the job's number; or make it name every swept value, e.g. lr${optim.lr})")


def say_preset_unused(config: Config, overrides: list[str]) -> None:
    """model.init_from fixes the model's shape and weights (resolve_model_config), so a preset chosen beside it is not
    used, while config.yaml records it all the same: said on rank 0. Only the command line tells a chosen preset from
    configs/config.yaml's default (model: tiny); one chosen in another config file (--config-name) is not seen."""
    chosen = [o for o in overrides if o.split("=", 1)[0].lstrip("+") in ("model", "model.preset")]
    if not chosen or config.model.init_from is None or int(os.environ.get("RANK", "0")) != 0:
        return
    log.warning("%s and model.init_from=%s both choose the model: the run takes model.init_from's shape and weights, "
                "and the preset %s is not used (config.yaml records model.preset=%s all the same; its resolved_model "
                "is the shape trained). Drop %s, or drop model.init_from to train %s from scratch", chosen[-1],
                config.model.init_from, config.model.preset, config.model.preset, chosen[-1], config.model.preset)


def remove_if_made_here_and_empty(run_dir: Path) -> None:
    """A start refused before it wrote anything leaves no dir behind that hydra made for it (one that existed stays),
    nor the new dirs above it that hold nothing else."""
    try:
        if run_dir.absolute() not in existing_run_dirs and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()
            for parent in run_dir.absolute().parents:
                if parent not in new_parent_dirs or not parent.is_dir() or any(parent.iterdir()):
                    break
                parent.rmdir()
    except FileNotFoundError:  # under torchrun every refused rank removes the same dirs: another rank was first
        pass


def record_existing_dirs(argv: list[str]) -> None:
    """existing_run_dirs and new_parent_dirs, before hydra makes any dir."""
    values = [Path(v).expanduser().absolute() for key in run_dir_keys(argv) for v in run_dir_values(argv, key)]
    existing_run_dirs.update(path for path in values if path.is_dir())
    today = time.strftime("%Y-%m-%d")  # hydra's ${now:...} is local time too
    for path in values + [Path("outputs", today, "run").absolute(), Path("multirun", today, "sweep").absolute()]:
        new_parent_dirs.update(itertools.takewhile(lambda parent: not parent.exists(), path.parents))


def run_dir_values(argv: list[str], key: str = "trainer.run_dir") -> list[str]:
    """The trainer.run_dir values (or another key's) of the command line, each of a multirun sweep's (a,b or
    choice(a,b)) too; null (a fresh timestamped dir) and what hydra cannot parse (it reports that itself) are left out."""
    values = []
    for arg in argv:
        if not arg.lstrip("+").startswith(f"{key}="):
            continue
        try:
            override = OverridesParser.create().parse_overrides([arg])[0]
            found = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        except HydraException:  # a syntax error, or an interval sweep: hydra's own message follows
            continue
        values += [v.text if isinstance(v, QuotedString) else str(v) for v in found if v is not None]
    return values


def run_dir_keys(argv: list[str]) -> tuple[str, str]:
    """The keys whose values name the dir hydra makes for this command: trainer.run_dir, and hydra's own that it uses
    instead (hydra.sweep.dir in a sweep, else hydra.run.dir)."""
    return "trainer.run_dir", SWEEP_DIR if {"-m", "--multirun"} & set(argv) else RUN_DIR


def check_run_dirs(argv: list[str]) -> None:
    """Hydra makes trainer.run_dir before main() runs, and one it cannot make (a file, an empty path that would be
    the current directory, a read-only place) stops it with a traceback or worse: each value of run_dir_keys is
    checked first."""
    for key in run_dir_keys(argv):
        for value in run_dir_values(argv, key):
            try:
                check_run_dir_path(value, key)
            except STOP_ERRORS as e:
                print(e, file=sys.stderr)
                sys.exit(exit_code(e))


def check_sweep_configs(argv: list[str]) -> None:
    """Every job of a multirun composed and its config checked before the first job runs: a bad value in a sweep's
    last job (optim.lr=1e-3,-1) would otherwise stop that job only after every job before it has trained, and one
    that hydra cannot compose (model=tiny,nope) would stop the sweep only after hydra rewrote the sweep dir's
    multirun.yaml. Command lines that name another config (--config-name, ...) are left to each job's own check."""
    if not {"-m", "--multirun"} & set(argv) or any(a.split("=")[0] in CONFIG_FLAGS for a in argv):
        return
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name=JOB_NAME):
            # with hydra's config loader, as its sweeper parses them: glob(...) expands to the group's options
            parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
            parsed = parser.parse_overrides([a for a in argv if not a.startswith("-")])
            values = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                      else [o.input_line] for o in parsed if not o.get_key_element().lstrip("+~").startswith("hydra")]
            swept = [o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()]
            sweep_dirs = run_dir_values(argv, SWEEP_DIR)
            subdirs = run_dir_values(argv, SWEEP_SUBDIR)
            jobs = list(itertools.product(*values))
            if not jobs:  # hydra would launch no job, exit 0 and leave a sweep dir
                empty = [o.input_line for o in parsed if o.is_sweep_override() and not list(o.sweep_string_iterator())]
                print(f"{' '.join(empty)} matches no option of its group, so the sweep has no job: fix the glob (e.g. "
                      "model=glob(llama3_*)) or list the options; no job of the sweep ran", file=sys.stderr)
                sys.exit(EXIT_BAD_INPUT)
            if len(jobs) > 1 and subdirs and "${" not in subdirs[-1]:
                print(f"{SWEEP_SUBDIR}={subdirs[-1]} puts all {len(jobs)} jobs of the sweep in one dir, where each would resume the "
                      "one before as its own run; leave it unset (its default, ${hydra.job.num}, is the job's number) or make "
                      "it name every swept value (e.g. lr${optim.lr}); no job of the sweep ran", file=sys.stderr)
                sys.exit(EXIT_BAD_INPUT)
            for job, overrides in enumerate(jobs):
                try:
                    cfg = to_dataclass(compose_job(list(overrides), job))
                    check_config_and_model(cfg)
                    if not subdirs:  # job #i's dir is <sweep dir>/i, where an earlier sweep's job #i ran
                        check_job_dir_is_this_jobs(cfg, job, swept, sweep_dirs[0] if len(sweep_dirs) == 1 else None)
                except (ConfigError, DataError) as e:
                    print(f"multirun job #{job} ({' '.join(overrides)}): {e}; no job of the sweep ran", file=sys.stderr)
                    sys.exit(EXIT_BAD_INPUT)
                except ConfigCompositionException as e:  # hydra's own (an unknown key or option), often several lines
                    print(f"multirun job #{job} ({' '.join(overrides)}) cannot be composed; no job of the sweep ran:\n{e}",
                          file=sys.stderr)
                    sys.exit(EXIT_BAD_INPUT)
    except HydraException:  # a syntax error, or an interval sweep: hydra's own message or sweeper follows
        return


def compose_job(overrides: list[str], job: Optional[int] = None) -> DictConfig:
    """The config a run (or multirun job #job) gets, composed as hydra composes it: with its hydra config set (job
    number, output dir), so ${hydra:...} interpolations resolve as they do in the run (--cfg and a sweep's check
    refused them: HydraConfig was not set)."""
    cfg = compose("config", overrides=overrides, return_hydra_config=True)
    if job is not None:  # as hydra's launcher numbers a sweep's jobs
        with read_write(cfg.hydra), open_dict(cfg.hydra):
            cfg.hydra.job.num = cfg.hydra.job.id = job
    HydraConfig.instance().set_config(cfg)  # before the run dir resolves: it may name ${hydra:runtime.cwd}, as in a run
    try:
        output_dir = (os.path.join(str(OmegaConf.select(cfg, SWEEP_DIR)), str(OmegaConf.select(cfg, SWEEP_SUBDIR)))
                      if job is not None else str(OmegaConf.select(cfg, RUN_DIR)))
    except InterpolationResolutionError as e:  # hydra stopped on it with its own traceback, before main()
        raise ConfigError(f"{e.full_key} (the run dir: trainer.run_dir unless {e.full_key} is set) cannot be resolved: "
                          f"{str(e.msg).splitlines()[0]}; fix the ${{...}} interpolation of trainer.run_dir or "
                          f"{e.full_key}") from None
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.runtime.output_dir = os.path.abspath(output_dir)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def check_config_and_model(cfg: Config) -> None:
    """check_config, and the model checks a run makes before its data (every model field, head/dim divisibility,
    trainer.seq_len against max_seq_len, the cute kernels' limits where this machine runs cute), as lenient as a resumed
    run's where model.init_from or data.tokenizer is gone: --cfg printed model.n_heads=3 and exited 0, and a sweep
    trained every job before the one a run refuses so. trainer.ckpt_async=true is refused here where trainer.parallel
    is none or ddp, as under any launch; with auto or fsdp it depends on the launch (torchrun with several processes
    runs it, one process does not), which the run's start checks, as it checks that this machine runs cute."""
    check_config(cfg)
    if cfg.trainer.parallel in ("none", "ddp"):
        check_ckpt_async(cfg.trainer.ckpt_async, cfg.trainer.parallel)
    backend = "cute" if cfg.kernels.backend == "cute" else resolve_backend(cfg.kernels.backend)
    if cfg.trainer.device == "cpu":
        backend = backend_on_device(cfg, backend, "cpu")
    # the cute kernels run on a GPU, where trainer.compute_dtype=auto is bfloat16: float32 is refused as a run refuses it
    check_compute(cfg, backend, pick_compute_dtype(cfg.trainer.compute_dtype, torch.device("cuda")))
    check_model_before_data(cfg, backend, resuming=True)


def check_printed_config(argv: list[str]) -> None:
    """`--cfg job` (or all) prints the composed config and runs nothing: its values are checked first as a run's start
    checks them, so a config it prints is one training takes (it printed optim.lr=nan or +trainer.max_step=3 and exited
    0). A sweep's jobs are check_sweep_configs'; another config (--config-name, ...) is left to hydra."""
    args = get_args_parser().parse_known_args(argv)[0]  # hydra's own parser: --cfg/-c, --package, the overrides
    if args.cfg not in ("job", "all") or args.multirun or args.config_name or args.config_path or args.config_dir:
        return
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name=JOB_NAME):
        try:
            check_config_and_model(to_dataclass(compose_job(args.overrides)))
        except (ConfigError, DataError) as e:
            print(f"{e}; --cfg prints the config once that is fixed", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        except HydraException:  # an unknown key or option: hydra's own message follows
            return


def check_run_dir_resolves(argv: list[str]) -> None:
    """Hydra resolves a run's dir (hydra.run.dir: trainer.run_dir unless set) before main() runs, and an interpolation
    there that cannot be resolved (trainer.run_dir=${oc.env:UNSET}) stopped it with hydra's own traceback: a run whose
    command line holds an interpolation resolves its dir first (--cfg and a sweep's jobs are checked whole)."""
    args = get_args_parser().parse_known_args(argv)[0]
    if (not any("${" in o for o in args.overrides) or args.cfg or args.multirun or args.help or args.hydra_help
            or args.info or args.shell_completion or args.config_name or args.config_path or args.config_dir):
        return
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name=JOB_NAME):
        try:
            compose_job(args.overrides)
        except ConfigError as e:
            print(e, file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        except HydraException:  # an unknown key or option: hydra's own message follows
            return


def check_job_dir_is_this_jobs(cfg: Config, job: int, swept: list[str], sweep_dir: Optional[str] = None) -> None:
    """A sweep into a trainer.run_dir (or a hydra.sweep.dir, `sweep_dir`, which hydra then uses instead) that an
    earlier sweep used resumes each job dir's run (trainer.resume=auto): job #i's dir must hold a run of job #i's swept
    values, not another sweep's job #i (an eager run continued as coda, and compared as coda). Its config.yaml says
    which values it ran with."""
    parent, named = (sweep_dir, SWEEP_DIR) if sweep_dir is not None else (cfg.trainer.run_dir, "trainer.run_dir")
    if parent is None or cfg.trainer.resume != "auto":
        return
    job_dir = Path(parent).expanduser() / str(job)
    if not resumes("auto", job_dir) or not (job_dir / CONFIG_FILE).is_file():
        return
    try:
        previous = OmegaConf.load(job_dir / CONFIG_FILE)
    except (OSError, yaml.YAMLError):  # the job's own resume check reads what it can
        return
    now = OmegaConf.create(recorded_config(cfg, job_dir))
    keys = [k for k in swept if k != "trainer.run_dir"]  # the job's dir, as hydra made it for the earlier run
    other = {k: OmegaConf.select(previous, k) for k in keys if OmegaConf.select(previous, k) != OmegaConf.select(now, k)}
    if other:
        raise ConfigError(f"its dir {job_dir} holds a run of {', '.join(f'{k}={v}' for k, v in other.items())}, which "
                          f"this job would resume as its own; sweep into a new {named}, or sweep the values that "
                          "run used")


def refuse_a_sweep_under_torchrun(argv: list[str]) -> None:
    """A multirun's second job would set up the process group again inside the same torchrun workers, which
    hangs in its first collective: one torchrun per job instead."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and ({"-m", "--multirun"} & set(argv)):
        print("a multirun sweep (-m) cannot run under torchrun (its second job would hang setting up the processes "
              "again); launch one torchrun per job instead, e.g. a shell loop over the values", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def end_worker(code: object) -> None:
    """End a torchrun worker with `code` (a SystemExit code) without finalizing the interpreter. gloo's worker
    threads outlive destroy_process_group (the process group stays referenced, and gloo has no shutdown), and
    one that drops the last reference to a finished collective's tensor after its Python object died (the
    main thread moved on) takes the GIL to free it: once finalization has begun, CPython ends that thread
    inside a noexcept destructor and the process aborts (SIGABRT, "terminate called without an active
    exception"). By now train() has closed everything of the run (files, wandb, the process group)."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # as the interpreter does for sys.exit("message")
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def remove_run_dir_and_die(signum: int, frame: object) -> None:
    """A torchrun worker's SIGTERM before the run: torchrun ends every worker so once one exits (a start refused on
    the rank that got there first), and the dir hydra made for this rank stayed behind; removed as a refused start's
    is (remove_if_made_here_and_empty: one the run holds is not empty), then the signal ends the worker as before."""
    try:
        run_dir = Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # HydraConfig not set (or its dir not chosen) yet: hydra made no dir
        run_dir = None
    if run_dir is not None:
        remove_if_made_here_and_empty(run_dir)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def sweep_record(argv: list[str]) -> Optional[tuple[Path, Optional[bytes]]]:
    """A multirun into one trainer.run_dir or hydra.sweep.dir, its sweep dir: that dir's multirun.yaml and its bytes
    before hydra rewrites it (None: there is none yet); None for any other command line (a fresh timestamped sweep dir,
    or a file that cannot be read, which is left as hydra leaves it)."""
    values = run_dir_values(argv, SWEEP_DIR) or run_dir_values(argv)  # hydra.sweep.dir wins over config.yaml's default
    if not {"-m", "--multirun"} & set(argv) or len(set(values)) != 1:
        return None
    path = Path(values[0]).expanduser() / SWEEP_RECORD
    try:
        return path, path.read_bytes() if path.is_file() else None
    except OSError:
        return None


def keep_sweep_record(path: Path, before: Optional[bytes]) -> None:
    """A sweep that ran no job (refused by hydra, or each job refused at its start) leaves its dir's record as it was:
    hydra rewrote multirun.yaml as the sweep started, so the previous sweep's is put back whole (a temp file renamed
    over it), or, where there was none, the new one is removed with the sweep dir this command made."""
    if before is None:
        path.unlink(missing_ok=True)
        remove_if_made_here_and_empty(path.parent)
    elif not path.is_file() or path.read_bytes() != before:
        replace_synced(path, before)


def launch(argv: list[str]) -> None:
    """The checks of the whole command line, then the run or sweep; a sweep's failed jobs set the exit code."""
    refuse_a_sweep_under_torchrun(argv)
    check_run_dirs(argv)
    check_printed_config(argv)
    check_run_dir_resolves(argv)
    record_existing_dirs(argv)
    check_sweep_configs(argv)
    record = sweep_record(argv)
    try:
        main()
    finally:  # also when a later job's stop signal or unwritable run dir ends the sweep (sys.exit)
        if record is not None and refused_jobs == started_jobs:  # no job, or each refused at its start (nothing trained)
            keep_sweep_record(*record)
        for job, run_dir, code in failed_jobs:
            print(f"multirun job #{job} ({run_dir}) stopped with exit code {code} (its reason is logged above)",
                  file=sys.stderr)
    if failed_jobs:
        sys.exit(failed_jobs[0][2])


if __name__ == "__main__":
    # a crash in native code (a kernel launch, a bad memory map) prints every thread's Python stack, not just its signal
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        launch(sys.argv[1:])
    else:  # a torchrun worker (hydra turns every error into a SystemExit)
        signal.signal(signal.SIGTERM, remove_run_dir_and_die)  # the training loop handles it itself while it runs
        try:
            launch(sys.argv[1:])
        except SystemExit as e:
            end_worker(e.code)
        end_worker(0)
