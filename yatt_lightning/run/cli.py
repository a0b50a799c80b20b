"""The ``yatt`` command: LightningCLI over RLHFModule, PromptDataModule and MegatronStrategy.

``yatt fit --config configs/grpo_tiny.yaml [--trainer.max_steps 20 ...]`` trains; ``--print_config``
shows the resolved configuration; ``--ckpt_path last`` resumes. ``yatt export --ckpt_dir DIR --out DIR``
writes a checkpoint as a Hugging Face model folder. Every ``__init__`` argument of the module, data module, strategy
and callbacks is a config key with its docstring in ``--help``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

# Before torch (and vLLM) are imported: offline Hugging Face, vLLM in-process. Threads: each process gets
# the cores of its node shared by the run's processes there (`distributed/threads.py`, set by the strategy before
# the engine starts); an OMP_NUM_THREADS of the user's wins.
for _key, _value in {
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_key, _value)

from yatt_lightning.distributed.threads import FROM_USER, remember_user_setting  # noqa: E402
from yatt_lightning.engines.vllm_engine import set_vllm_env  # noqa: E402
from yatt_lightning.run import failure_screen  # noqa: E402

remember_user_setting()
failure_screen.remember_run()

set_vllm_env()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from yatt_lightning.datamodules.prompt import PromptDataModule  # noqa: E402
from yatt_lightning.distributed import console  # noqa: E402
from yatt_lightning.lazy_defaults import lazy_default  # noqa: E402
from yatt_lightning.module import RLHFModule  # noqa: E402, F401
from yatt_lightning.run import errors  # noqa: E402
from yatt_lightning.run.logging_setup import configure_logging  # noqa: E402
from yatt_lightning.run.process_exit import collect_once_at_exit  # noqa: E402
from yatt_lightning.strategy import MegatronStrategy  # noqa: E402


class SaveConfigToLoggers(SaveConfigCallback):
    """The resolved configuration: ``config.yaml`` in the run's folder (Lightning's), and every logger's
    hyperparameters but TensorBoard's (W&B's run config, MLflow's params; TensorBoard's run has the file)."""

    def save_config(self, trainer: Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        config = self.config.as_dict()
        for logger in trainer.loggers:
            if not isinstance(logger, TensorBoardLogger):
                logger.log_hyperparams(config)


class YattCLI(LightningCLI):
    """LightningCLI with yatt-lightning's defaults (strategy, logger, checkpointing, data sharding)."""

    def __init__(self, args: list[str] | None = None, run: bool = True, console: bool | None = None) -> None:
        """``console``: add :class:`~yatt_lightning.callbacks.RunConsole` (the progress bar, the summary, library
        output into the run's ``output.log``) unless the config has a progress bar; default: when ``run``."""
        self.add_console = run if console is None else console
        super().__init__(
            pl.LightningModule,  # RLHFModule, or another stage's module (SFTModule), chosen by class_path
            PromptDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_defaults={
                "strategy": lazy_default(MegatronStrategy),
                "accelerator": "auto",
                "devices": 1,
                "use_distributed_sampler": False,  # PromptDataModule shards by data-parallel rank itself
                "default_root_dir": "runs",  # logs, checkpoints and the saved config go under it
                "logger": lazy_default(TensorBoardLogger, save_dir="", name="yatt"),
                "num_sanity_val_steps": -1,  # with a held-out set: every batch of it, before training
                "log_every_n_steps": 1,
                "enable_model_summary": False,  # RunConsole names the parameter count in one line
            },
            auto_configure_optimizers=False,
            save_config_callback=SaveConfigToLoggers,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        _loggers_default_to_root_dir(config.trainer)

    def init_parser(self, **kwargs: Any) -> Any:
        parser = super().init_parser(**kwargs)
        parser.exit_on_error = False  # main() shows one screen: the message that names the key, exit code 2
        return parser

    def fit(self, **kwargs: Any) -> None:
        global _RUNNING
        _RUNNING = True  # from here on an error is a run-time one (exit code 1), not a configuration one
        from lightning.pytorch.trainer.states import TrainerStatus

        from yatt_lightning.callbacks.async_checkpoint import AsyncCheckpoint

        try:
            self.trainer.fit(**kwargs)
        except SystemExit:  # Lightning's after a KeyboardInterrupt (exit code 1): a Ctrl-C's is 130
            if self.trainer.state.status == TrainerStatus.INTERRUPTED:
                raise SystemExit(errors.INTERRUPTED) from None
            raise
        for callback in self.trainer.callbacks:  # stopped by Ctrl-C / SIGTERM / SIGUSR1 after saving
            if isinstance(callback, AsyncCheckpoint) and callback.stopped_by is not None:
                raise SystemExit(128 + int(callback.stopped_by))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Lightning's, plus :class:`~yatt_lightning.callbacks.RunConsole` as the progress bar when the config
        names none (and does not turn the bar off)."""
        from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar

        from yatt_lightning.callbacks.run_console import RunConsole

        extra = [self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys]
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        has_bar = any(isinstance(c, ProgressBar) for c in [*callbacks, *extra])
        if self.add_console and not has_bar and config.get("enable_progress_bar") is not False:
            extra.append(RunConsole())
        return self._instantiate_trainer(config, extra)

    def before_fit(self) -> None:
        """``--ckpt_path last``: the ``latest`` tracker of the AsyncCheckpoint folder; the strategy loads the
        newest intact checkpoint it can find from there (and says so if it had to skip one)."""
        from yatt_lightning.checkpoint import folder as ckpt

        config = self.config_init[self.subcommand]
        path = config.get("ckpt_path")
        if path is not None and path != "last":
            # Before any process group or engine: every file there, of the size its manifest lists (the
            # checksums are verified when loading, split across the ranks).
            problems = ckpt.verify(Path(path), rank=0, world=1 << 30)
            if problems:
                raise ckpt.CheckpointError(
                    f"`--ckpt_path`: checkpoint {path} is incomplete or corrupted: {'; '.join(problems[:3])}. Pass "
                    "another checkpoint, or `--ckpt_path last` to use the newest intact one."
                )
        if path != "last":
            self._check_adapters(path)
            return
        from yatt_lightning.callbacks.async_checkpoint import AsyncCheckpoint

        savers = [cb for cb in self.trainer.callbacks if isinstance(cb, AsyncCheckpoint)]
        if not savers:
            raise ValueError(
                "`--ckpt_path last` needs an AsyncCheckpoint callback (its dirpath holds the checkpoints)."
            )
        saver = savers[0]
        if saver.dirpath is None:
            saver.setup(self.trainer, self.model, "fit")
        target = ckpt.resume_target(saver.dirpath)
        if target is None:
            print(f"--ckpt_path last: no checkpoint in {saver.dirpath} yet; starting from step 0", flush=True)
        config["ckpt_path"] = None if target is None else str(target)
        self._check_adapters(config["ckpt_path"])

    def _check_adapters(self, path) -> None:
        """LoRA adapters resume on the base they were trained on, with their rank and projections; full weights
        without ``model.lora`` (:mod:`yatt_lightning.checkpoint.lora_base`)."""
        from yatt_lightning.checkpoint import lora_base

        if path is not None and hasattr(self.model, "policy_spec"):
            lora_base.check(Path(path), Path(self.model.policy_spec.resolve()), getattr(self.model, "lora", None))

    def after_instantiate_classes(self) -> None:
        super().after_instantiate_classes()
        if not isinstance(self.trainer.strategy, MegatronStrategy):
            raise ValueError(
                "`trainer.strategy` must be yatt_lightning.strategy.MegatronStrategy (or a subclass), got "
                f"{type(self.trainer.strategy).__name__}."
            )
        from yatt_lightning.run.preflight import check_run

        check_run(self.model, self.datamodule, self.trainer)


def _loggers_default_to_root_dir(trainer) -> None:
    """A logger whose ``save_dir`` is empty writes under ``trainer.default_root_dir``, so that
    ``--trainer.default_root_dir`` moves everything a run writes (logs, checkpoints, the saved config)."""
    loggers = trainer.logger if isinstance(trainer.logger, list) else [trainer.logger]
    for logger in loggers:
        init_args = getattr(logger, "init_args", None)
        if init_args is not None and "save_dir" in init_args and not init_args.save_dir:
            init_args.save_dir = str(trainer.default_root_dir or ".")


_RUNNING = False


def _check_config_files(argv: list[str]) -> None:
    """Each ``--config FILE`` exists and is valid YAML (jsonargparse's message names neither file nor line)."""
    import yaml

    files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    files += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"`--config {name}`: no such file.")
        try:
            yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
            raise ValueError(f"{where}: not valid YAML ({getattr(err, 'problem', None) or err}); fix the file.") from None


SUBCOMMANDS = ("fit", "validate", "test", "predict", "export")


def main(args: list[str] | None = None) -> None:
    """``yatt fit|validate|export ...``; ``--verbose`` (fit): every library's output on the terminal;
    ``--debug``: full tracebacks instead of one screen per error."""
    import sys
    import traceback

    argv = sys.argv[1:] if args is None else args
    collect_once_at_exit()  # ~2.7 s of a core less at every rank's exit
    if argv[:1] == ["fit"] and "--verbose" in argv:  # every library's output on the terminal (RunConsole)
        argv = [a for a in argv if a != "--verbose"]
        os.environ[console.VERBOSE_ENV] = "1"  # the other ranks, launched with this environment, too
    if "--debug" in argv:
        argv = [a for a in argv if a != "--debug"]
        os.environ[errors.DEBUG_ENV] = "1"
    configure_logging()
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        import difflib

        close = difflib.get_close_matches(argv[0], SUBCOMMANDS, n=1, cutoff=0.5)
        hint = f"; did you mean `yatt {close[0]}`?" if close else ""
        print(f"yatt: error: unknown subcommand {argv[0]!r}{hint} The subcommands: {', '.join(SUBCOMMANDS)}.",
              file=sys.stderr, flush=True)  # fmt: skip
        sys.exit(2)
    try:
        if argv[:1] == ["export"]:
            from yatt_lightning.checkpoint.export import main as export_main

            export_main(argv[1:])  # its failures are about its arguments or the checkpoint: exit code 2
            return
        if os.environ.get("OMP_NUM_THREADS") and os.environ.get(FROM_USER) == "1":  # else the strategy sets it
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if "" not in sys.path and "." not in sys.path:
            sys.path.insert(0, "")  # a `class_path` in the user's own file in the working directory, as `python -m`
        _check_config_files(argv)
        YattCLI(args=argv)
    except SystemExit:
        raise
    except BaseException as err:
        if errors.debug():
            raise
        log_path = console.last_capture
        if log_path is not None and log_path.exists():
            with contextlib.suppress(OSError):  # a full disk: the screen below still says what happened
                with open(log_path, "a") as f:
                    f.write("".join(traceback.format_exception(err)))
        text, code = errors.error_screen(err, configuring=not _RUNNING, log_path=log_path)
        failure_screen.show(text, err, log_path)  # one rank's screen on the terminal; its peers' in their logs
        sys.exit(code)


if __name__ == "__main__":
    main()
