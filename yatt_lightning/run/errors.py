"""What the user sees when ``yatt`` stops on an error: one screen, the project's own message, an exit code.

A constructor's ``ValueError`` ("`model.optimizer.lr` must be > 0, got -1.0.") reaches the CLI wrapped
by jsonargparse in a union error of a thousand characters; a run-time error arrives after Lightning's
and Megatron's frames. :func:`error_screen` finds the message that names the key, file or line (the
innermost cause), adds the closest valid key to an unknown one, and says where the full traceback is.
Exit codes: 2 for a configuration error (before the run starts), 1 for a failure at run time, 130 for
an interrupt. ``--debug`` (or ``YATT_DEBUG=1``) shows the full traceback instead.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
from pathlib import Path

DEBUG_ENV = "YATT_DEBUG"
CONFIG_ERROR = 2
RUNTIME_ERROR = 1
INTERRUPTED = 130

# Lines of jsonargparse's nested messages that say nothing the user can act on.
_NOISE = re.compile(
    r"^\s*(- )?(Expected a <class 'NoneType'>|Given value( type)?:|Subtypes:|Errors:|"
    r"Does not validate against any of the Union subtypes)"
)
_UNKNOWN = re.compile(r"Option '(?P<key>[^']+)' is not accepted")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (?P<args>.*)")
_TOP_KEYS = ("trainer", "model", "data", "seed_everything", "ckpt_path", "config", "print_config")
_PARSER_KEY = re.compile(r'Parser key "(?P<key>[^"]+)"')
_CLASS_PATH = re.compile(r"Problem with given class_path '(?P<path>[^']+)'")


def debug() -> bool:
    """True when the user asked for full tracebacks."""
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0", "false", "False")


_OURS = tuple(str(Path(__file__).resolve().parent.parent / d) for d in ("", "callbacks", "datamodules"))


def chain(err: BaseException) -> list[BaseException]:
    """``err`` and its causes, outermost first."""
    out = [err]
    while True:
        inner = err.__cause__ or (err.__context__ if not err.__suppress_context__ else None)
        if inner is None or any(inner is e for e in out) or isinstance(inner, (KeyboardInterrupt, SystemExit)):
            return out
        out.append(inner)
        err = inner


def raised_by_us(err: BaseException) -> bool:
    """True when the exception was raised in yatt-lightning's own code (its message names the key or file)."""
    tb = err.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and str(Path(last).resolve()).startswith(_OURS)


def root_cause(err: BaseException) -> BaseException:
    """The outermost exception raised by yatt-lightning in ``err``'s chain (the one written for the user:
    ``raise ValueError("`key` ...") from err``), or the innermost one when none is ours."""
    from yatt_lightning.distributed.failures import RankFailure

    errors = chain(err)
    # An agreed failure chained to this rank's own error shows that error; elsewhere it names the origin.
    ours = [e for e in errors if raised_by_us(e) and not (isinstance(e, RankFailure) and e.__cause__ is not None)]
    return ours[0] if ours else errors[-1]


def config_message(err: BaseException) -> str:
    """The message of an error raised while parsing or building the configuration."""
    errors = chain(err)
    text = "\n".join(str(e) for e in errors)
    unknown = _UNKNOWN.search(text)
    if unknown:
        return unknown_key_message(str(errors[0]), unknown.group("key"))
    unrecognized = _UNRECOGNIZED.search(text)
    if unrecognized:
        return unrecognized_message(unrecognized.group("args"))
    if re.search(r"No supported gpu backend found|CUDAAccelerator can not run on your system", text):
        return (
            "`trainer.accelerator`: this machine has no usable GPU (torch sees no CUDA device); run on CPU with "
            "`--trainer.accelerator cpu`, or on a machine with a GPU."
        )
    ours = [e for e in errors if raised_by_us(e)]
    if ours:
        return str(ours[0])
    lines = [line for line in str(errors[0]).splitlines() if line.strip() and not _NOISE.match(line)]
    return "\n".join(_dedent(lines))


def unknown_key_message(text: str, key: str) -> str:
    """``unknown key `model.algorithm.clip_epsilon`; did you mean `clip_eps`?`` and what the class accepts."""
    path = [k for k in _PARSER_KEY.findall(text)]
    classes = _CLASS_PATH.findall(text)
    full = ".".join([*path, key]) if path else key
    accepted = _accepted(classes[-1]) if classes else []
    message = f"unknown key `{full}`"
    if classes:
        message += f" ({classes[-1].rsplit('.', 1)[-1]} takes: {', '.join(accepted) or 'no arguments'})"
    close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.5)
    if close:
        message += f"; did you mean `{close[0]}`?"
    return message + "\n`yatt fit --help` lists every key; `--print_config` shows the resolved configuration."


def unrecognized_message(args: str) -> str:
    """``unknown key `trainer.max_stesp`; did you mean `trainer.max_steps`?`` for an option argparse refused
    (the Trainer's own keys and the top-level ones; a class's keys go through :func:`unknown_key_message`)."""
    option = next((a for a in args.split() if a.startswith("--")), args.split()[0] if args.split() else "")
    key = option.lstrip("-").split("=", 1)[0]
    head, _, leaf = key.rpartition(".")
    if head == "trainer":
        accepted = _accepted("lightning.pytorch.Trainer")
    elif not head:
        accepted = list(_TOP_KEYS)
    else:
        accepted = []
    message = f"unknown key `{key}`"
    close = difflib.get_close_matches(leaf, accepted, n=1, cutoff=0.5)
    if close:
        message += f"; did you mean `{'.'.join(filter(None, (head, close[0])))}`?"
    elif head == "trainer":
        message += f" (Trainer takes: {', '.join(accepted)})"
    return message + "\n`yatt fit --help` lists every key; `--print_config` shows the resolved configuration."


def runtime_message(err: BaseException) -> str:
    """The message of an error raised while the run was going: the innermost cause, with its type."""
    cause = root_cause(err)
    return f"{type(cause).__name__}: {cause}"


def error_screen(err: BaseException, *, configuring: bool, log_path: str | None = None) -> tuple[str, int]:
    """(the text to show, the exit code) for ``err``."""
    if isinstance(err, KeyboardInterrupt):
        return "yatt: interrupted", INTERRUPTED
    if configuring:
        return f"yatt: error: {config_message(err)}", CONFIG_ERROR
    hint = f"yatt: the full traceback is in {log_path}" if log_path else "yatt: rerun with --debug for the full traceback"
    return f"yatt: error: {runtime_message(err)}\n{hint}", RUNTIME_ERROR


def _accepted(class_path: str) -> list[str]:
    try:
        module, name = class_path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        params = inspect.signature(cls.__init__).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
    return [p for p in params if p != "self" and params[p].kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                                       inspect.Parameter.VAR_KEYWORD)]  # fmt: skip


def _dedent(lines: list[str]) -> list[str]:
    """jsonargparse's nesting as one key and its innermost message: ```trainer.max_steps`: Expected ...``."""
    keys = [m.group("key") for line in lines for m in [_PARSER_KEY.search(line)] if m]
    rest = [line.strip() for line in lines if not _PARSER_KEY.search(line) and not _CLASS_PATH.search(line)]
    prefix = f"`{'.'.join(keys)}`: " if keys else ""
    return [prefix + rest[0], *rest[1:]] if rest else [line.strip() for line in lines]
