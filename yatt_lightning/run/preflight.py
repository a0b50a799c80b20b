"""Checks that run before any process group or engine starts: a bad run fails in seconds, naming the key.

``yatt fit`` calls :func:`check_run` right after building the module, data module and trainer from the
configuration (in every process, before Lightning launches the others or vLLM starts): the parallel
layout against the model, the model folder (config, weight files, tokenizer), sequence lengths against
the model's positions, the schedule, the data (every row loads, there are enough for a step, every row has
the fields each reward function takes, every prompt tokenizes within ``model.max_prompt_tokens``). What
fails here is a configuration error (exit code 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from yatt_lightning.models.families import arch_of
from yatt_lightning.models.families.arch import HFArch


def check_run(model, datamodule, trainer) -> None:
    """Raise a ``ValueError`` naming the key, file or row for the first problem found."""
    from transformers import AutoConfig

    strategy = trainer.strategy
    path = model.policy_spec.resolve()
    config = AutoConfig.from_pretrained(path)
    arch = arch_of(config)
    check_layout(arch, strategy, trainer)
    check_weights(path)
    tokenizer = load_tokenizer(path)
    if getattr(model, "lora", None) is not None:
        check_lora(trainer, model.lora, arch, path)
    if hasattr(model, "check_placement"):  # what the placement cannot run of the module (the critic, ...)
        model.check_placement(strategy.placement)
    critic = getattr(model, "critic", None)
    if critic is not None:
        critic_path = critic.path.resolve() if critic.path is not None else path
        critic_arch = arch_of(AutoConfig.from_pretrained(critic_path)) if critic.path is not None else arch
        if critic_arch.moe is not None:
            raise ValueError(
                f"`model.critic`: {critic_path} is a mixture of experts; a critic on one is not supported yet (its "
                "load-balancing loss and routing figures would mix with the policy's). Give `model.critic.path` a "
                "dense model's folder, or use an estimator without a critic (GRPO, RLOO, REINFORCE++)."
            )
    if not hasattr(model, "sampling"):  # a stage without a rollout (SFT, DPO): its rows, as it will read them
        check_writable(trainer)
        if hasattr(model, "check_rows") and datamodule is not None and hasattr(datamodule, "load_rows"):
            rows = datamodule.load_rows()
            model.check_rows(path, checked(rows))
            if datamodule.dataset is None:  # checked: `setup` uses these rows instead of reading them again
                datamodule.dataset = datamodule.make_dataset(rows)
            held_out = getattr(datamodule, "val_path", None), getattr(datamodule, "val_task", None)
            if held_out != (None, None):
                model.check_rows(path, checked(datamodule.load_rows(*held_out)))
        return
    for fn in getattr(model, "reward_functions", []):
        if hasattr(fn, "check_student"):  # a teacher (on-policy distillation): the student's vocabulary
            fn.check_student(path)
    longest = model.max_prompt_tokens + model.sampling.max_new_tokens
    if getattr(model, "agent", None) is not None:  # an episode's length is the agent's budget
        check_agent(model, strategy, tokenizer, path)
    elif longest > arch.max_position_embeddings:
        raise ValueError(
            f"`model.max_prompt_tokens` ({model.max_prompt_tokens}) + `model.sampling.max_new_tokens` "
            f"({model.sampling.max_new_tokens}) = {longest} exceeds the model's {arch.max_position_embeddings} "
            f"positions (max_position_embeddings in {path / 'config.json'}); lower one of them."
        )
    check_writable(trainer)
    if trainer.max_steps == 0:
        raise ValueError("`trainer.max_steps` is 0: the run would train nothing; set it to the number of RL steps.")
    if datamodule is not None and hasattr(datamodule, "load_rows"):
        check_data(model, datamodule, trainer, path, tokenizer)


def check_lora(trainer, settings, arch: HFArch, path: Path) -> None:
    """``model.lora``: a rank the targeted projections can hold, and a placement that runs adapters."""
    from yatt_lightning.models.lora import full_shapes

    mlp = [p for p in settings.targets() if p in ("gate_proj", "up_proj", "down_proj")]
    if arch.moe is not None and mlp:
        raise ValueError(
            f"`model.lora.target_modules`: {path} is a mixture of experts ({arch.moe.num_experts} experts), and adapters "
            f"on its experts ({', '.join(mlp)}) are not supported yet; target the attention: [q_proj, k_proj, v_proj, o_proj]."
        )
    shapes = full_shapes(arch)
    proj = min(settings.targets(), key=lambda p: min(shapes[p]))
    if settings.rank > min(shapes[proj]):
        raise ValueError(
            f"`model.lora.rank` ({settings.rank}) exceeds what {proj} of {path} can hold ({shapes[proj][0]} x "
            f"{shapes[proj][1]}: rank at most {min(shapes[proj])}); lower it."
        )
    placement = type(getattr(trainer.strategy, "placement", None)).__name__
    if placement not in ("FullColocation", "NoneType"):
        raise ValueError(
            f"`model.lora` with `trainer.strategy.placement: {placement}` is not supported yet: use FullColocation "
            "(the default), or train the full weights."
        )


def check_agent(model, strategy, tokenizer, path: Path) -> None:
    """``model.agent``: its budgets within the model's positions, its chat template, and a controller and
    placement that run episodes."""
    model.agent.configure(tokenizer, model.apply_chat_template, path, model.max_prompt_tokens)
    controller, placement = getattr(strategy, "controller", None), getattr(strategy, "placement", None)
    if type(controller).__name__ == "SingleController":
        raise ValueError(
            "`model.agent` runs episodes on every rank's own engine: use `trainer.strategy.controller: "
            "ParallelController` (the default), not SingleController."
        )
    if type(placement).__name__ == "PartialColocation":
        raise ValueError(
            "`model.agent` with `trainer.strategy.placement: PartialColocation` is not supported yet: score the "
            "episodes with reward functions or the environment, under FullColocation or Disaggregated."
        )
    if type(getattr(model, "long_tail", None)).__name__ == "PartialRollout":
        raise ValueError(
            "`model.long_tail: PartialRollout` cannot carry an agent's episodes to the next step yet; use WaitForAll "
            "or OverProvision with `model.agent`."
        )
    if getattr(strategy, "tensor_model_parallel_size", 1) > 1 and not model.agent.deterministic:
        raise ValueError(
            "`model.agent` with `trainer.strategy.tensor_model_parallel_size` > 1 needs `model.agent.deterministic: "
            "true`: the ranks of a tensor-parallel engine must give it the same turns at the same engine step."
        )


def check_writable(trainer) -> None:
    """Where the run writes (``default_root_dir``, each checkpoint folder) can be written, before any engine."""
    import os

    targets = [("trainer.default_root_dir", trainer.default_root_dir)]
    targets += [("trainer.callbacks: AsyncCheckpoint.dirpath", cb.dirpath) for cb in trainer.callbacks
                if type(cb).__name__ == "AsyncCheckpoint" and cb.dirpath is not None]  # fmt: skip
    for key, folder in targets:
        probe = Path(folder).absolute()
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not (probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)):
            raise ValueError(
                f"`{key}`: {folder} cannot be written ({probe} is {'not a folder' if not probe.is_dir() else 'read-only'} "
                "for this process); give a folder this run can write."
            )


def check_layout(arch: HFArch, strategy, trainer) -> None:
    """The run's one layout (:class:`~yatt_lightning.distributed.layout.Layout`), checked by the model's
    shapes, the strategy's controller and its placement."""
    if hasattr(strategy, "check_layout"):
        arch.check_parallel(strategy.tensor_model_parallel_size, strategy.pipeline_model_parallel_size,
                            getattr(strategy, "expert_model_parallel_size", 1))  # fmt: skip
        strategy.check_layout(trainer.num_devices * trainer.num_nodes)


def check_weights(path: Path) -> None:
    """Every safetensors file of the model folder has a readable header (a truncated copy fails here)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"`model.policy.path`: {path} holds no *.safetensors weights; point it at a Hugging Face folder.")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as err:
            raise ValueError(
                f"`model.policy.path`: {file} is not a readable safetensors file ({err}); copy it again."
            ) from err


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: Path) -> Any:
    """The model folder's tokenizer, or an error that names the folder and the files it needs."""
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"`model.policy.path`: {path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy the tokenizer "
            "of the model into the folder (tokenizer.save_pretrained(folder))."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise ValueError(
            f"`model.policy.path`: cannot load a tokenizer from {path} ({type(err).__name__}: {err}); the folder needs "
            "the tokenizer files of its model (tokenizer.json and tokenizer_config.json, or the model's own)."
        ) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_data(model, datamodule, trainer, path: Path, tokenizer) -> None:
    """Every row loads, one step's worth exists, and every prompt tokenizes (in the model's chat template,
    as the step will) within the limit."""
    every = rows = datamodule.load_rows()
    strategy = trainer.strategy
    layout = getattr(strategy, "layout", None)  # checked above (check_layout)
    replicas = max(layout.data_parallel() if layout is not None else 1, 1)
    if len(rows) < replicas * datamodule.batch_size:
        source = datamodule.path or type(datamodule.task).__name__
        raise ValueError(
            f"the dataset ({source}) has {len(rows)} rows, fewer than one step needs ({replicas} data-parallel "
            f"ranks x `data.batch_size`={datamodule.batch_size}); add rows or lower `data.batch_size`."
        )
    held_out = getattr(datamodule, "val_path", None), getattr(datamodule, "val_task", None)
    validates = held_out != (None, None) and trainer.limit_val_batches != 0
    placement = getattr(strategy, "placement", None)
    if validates and placement is not None and placement.role.split:
        raise ValueError(
            f"`data.{'val_path' if held_out[0] else 'val_task'}` with `trainer.strategy.placement: "
            f"{type(placement).__name__}`: validation during asynchronous RL is not built yet (the trainers "
            "hold no engine, and which version a rollout rank would sample the held-out prompts with is not "
            "settled); train with FullColocation or PartialColocation, or set `trainer.limit_val_batches: 0`."
        )
    val_rows = checked(datamodule.load_rows(*held_out)) if validates else []
    rows = checked(rows)  # a table's first rows: the others are named when they are read, at their step
    previous = model.tokenizer, model.prompt_format
    model.tokenizer, model.prompt_format = tokenizer, model.prompt_format_for(path, tokenizer)
    try:
        for row in rows + val_rows:
            model.tokenize_prompt(row)
    finally:
        model.tokenizer, model.prompt_format = previous
    check_reward_fields(model, rows)
    check_reward_fields(model, val_rows)
    if datamodule.dataset is None and not getattr(strategy.controller, "loads_on_driver", False):
        datamodule.dataset = datamodule.make_dataset(every)  # checked: `setup` uses these rows instead of reading them again


CHECKED_ROWS = 10_000  # of a table read by index (Parquet, a datasets folder), the rows checked before start


def checked(rows) -> list[dict]:
    """The rows preflight reads whole: all of a list, the first ``CHECKED_ROWS`` of a table read by index."""
    return rows if isinstance(rows, list) else [rows[i] for i in range(min(len(rows), CHECKED_ROWS))]


def check_reward_fields(model, rows: list[dict]) -> None:
    """Every row gives each reward function the fields it takes (:mod:`~yatt_lightning.rewards.fields`): the
    reward functions', a judge's template, an agent environment's own scoring; the first row that would fail
    is named by its file and line (a built-in task's: the task and row index). Each row the agent's
    environment must run passes its ``check_row``."""
    from yatt_lightning.rewards.base import drawn_fields

    checks = [fn.row_problem for fn in getattr(model, "reward_functions", [])]
    agent = getattr(model, "agent", None)
    environment = agent.environment if agent is not None else None
    if environment is not None:
        checks.append(environment.row_problem)
    alike: dict[frozenset[str], list[int]] = {}  # rows by their fields, in the order of their first row
    for i, row in enumerate(rows):
        alike.setdefault(drawn_fields(row), []).append(i)
        if environment is not None:
            environment.check_row(row, row.get("_source", f"row {i}"))
    for fields, indices in alike.items():
        for check in checks:
            problem = check(fields)
            if problem is not None:
                where = rows[indices[0]].get("_source", f"row {indices[0]}")
                n = len(indices) - 1
                alike_too = f" (and {n} more row{'s' * (n > 1)} like it)" if n else ""
                raise ValueError(f"{where}{alike_too}: {problem}")
