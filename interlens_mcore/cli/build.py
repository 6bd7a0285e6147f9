"""Parsed options -> checked plug-ins, process groups, backend and trainer (shared by the launch scripts).

`check` does every check that needs no process group, so bad input fails before anything
starts; `build_trainer` is collective.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from interlens_mcore import distributed
from interlens_mcore.cli import defaults, sizes
from interlens_mcore.cli.args import Args, LaunchConfig, UsageError, flagify
from interlens_mcore.distributed.safe_load import UnsafeCheckpoint, check_dcp
from interlens_mcore.grpo.rewards import environment_reward, reward_name
from interlens_mcore.plugins import load_object
from interlens_mcore.tasks import TaskSource, resolve_task
from trainers import rundir

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # OWNER/NAME, as `from_pretrained` takes a hub id


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def model_folder(args: Args) -> Path:
    """--model: a folder, `smollm2`, or by default the warm-started tiny model (assets build once,
    atomically, so ranks may race)."""
    from interlens_mcore.assets import AssetUnavailable, ensure_default_policy, ensure_smollm2

    name = args.backend.model
    if name not in ("smollm2", None, "tiny"):
        return Path(str(name))
    try:  # a damaged cached asset is rebuilt; one that cannot be is named in the refusal
        return ensure_smollm2() if name == "smollm2" else ensure_default_policy()
    except AssetUnavailable as exc:
        raise UsageError(f"--model {name or 'tiny'}: {exc}") from None


def task_source(args: Args) -> TaskSource:
    """--task, or --dataset, or --multi-turn-scheduler over --dataset; --tools added to any of them."""
    return add_tools(args, base_source(args))


def base_source(args: Args) -> TaskSource:
    """--task, or --dataset, or --multi-turn-scheduler over --dataset."""
    la = args.launch
    try:
        if la.gym_env is not None and la.multi_turn_scheduler is None:
            raise ValueError("--gym-env names the environment of a --multi-turn-scheduler: give one")
        verifiers = la.dataset is None and la.task.partition(":")[0] == "verifiers"
        if la.agent is None and not verifiers:  # both run through the endpoint's rounds
            for flag, value, default in agent_options(la):
                if value != default:
                    raise ValueError(f"{flag} applies to the agent of --agent MODULE:FN: give one")
        if la.environment_factory is not None:
            source = environment_source(args)
        elif la.multi_turn_scheduler is not None:
            source = swift_source(args)
        elif la.dataset is not None:
            from interlens_mcore.tasks import dataset

            source = dataset.source(la.dataset, la.prompt_column, la.eval_dataset, **la.task_arguments)
        else:
            if verifiers:  # the environment's own code runs its rollouts
                why = f"--task {la.task} runs the environment's own rollouts"
                if la.agent is not None:
                    raise ValueError(f"{why}: --agent would replace them (drop one)")
                refuse_outside_flags(args, why)
                check_agent_options(la)
            source = resolve_task(la.task, la.task_arguments)
            if verifiers:
                source = with_agent_options(source, la)
        if la.agent is not None:
            source = agent_source(args, source)
        if la.system_prompt is not None:  # before --tools: their descriptions join the same message
            from interlens_mcore.cli.system_prompt import SystemPromptSource

            source = SystemPromptSource(source, la.system_prompt)
    except ValueError as exc:
        raise UsageError(flagify(str(exc))) from None
    return source


def agent_options(la: LaunchConfig) -> tuple[tuple[str, object, object], ...]:
    """(flag, value, default) of the options that shape --agent's rollouts."""
    from interlens_mcore.agents import defaults

    return (
        ("--agent-branches", la.agent_branches, defaults.BRANCHES),
        ("--agent-reply-match", la.agent_reply_match, defaults.REPLY_MATCH),
        ("--agent-round-wait-s", la.agent_round_wait_s, defaults.ROUND_WAIT_S),
    )


def check_agent_options(la: LaunchConfig) -> None:
    wait = la.agent_round_wait_s
    if not (wait > 0 and math.isfinite(wait)):
        raise ValueError(f"--agent-round-wait-s must be a number of seconds > 0, got {wait:g}")


def with_agent_options(source: TaskSource, la: LaunchConfig) -> TaskSource:
    """A verifiers source (an `AgentTasks`) with --agent-branches / -reply-match / -round-wait-s."""
    from interlens_mcore.agents.task import AgentTasks

    if isinstance(source, AgentTasks):
        source.branches, source.reply_match = la.agent_branches, la.agent_reply_match
        source.round_wait_s = float(la.agent_round_wait_s)
    return source


def agent_source(args: Args, rows: TaskSource) -> TaskSource:
    """--agent MODULE:FN playing the rows of `rows` (--dataset or --task) through the endpoint."""
    from interlens_mcore.agents.task import AgentTasks

    la = args.launch
    check_agent_options(la)
    refuse_outside_flags(args, "--agent runs the agent's own code")
    agent = load_object(str(la.agent), what="--agent")
    if not callable(agent):
        kind = type(agent).__name__
        raise ValueError(f"--agent {la.agent}: {kind} is not callable; expected FN(client, row)")
    return AgentTasks(
        agent,
        rows,
        branches=la.agent_branches,
        reply_match=la.agent_reply_match,
        round_wait_s=la.agent_round_wait_s,
    )


def refuse_outside_flags(args: Args, why: str) -> None:
    """ValueError for a flag that shapes our own conversations, which code run as a black box
    against the endpoint (an agent, a verifiers environment) never sees."""
    la = args.launch
    for flag, given in (
        ("--tools", la.tools is not None),
        ("--multi-turn-scheduler", la.multi_turn_scheduler is not None),
        ("--system-prompt", la.system_prompt is not None),
    ):
        if given:
            raise ValueError(f"{why}: {flag} does not reach it (drop one)")


def environment_source(args: Args) -> TaskSource:
    """`--environment-factory MODULE:NAME --dataset rows.jsonl [--tools ...]`: TRL's environments."""
    from interlens_mcore.tasks import dataset
    from interlens_mcore.tools import trl_env

    la = args.launch
    for flag, given in (
        ("--dataset", la.dataset is None),
        ("--multi-turn-scheduler", la.multi_turn_scheduler is not None),
        ("--agent", la.agent is not None),
        ("--system-prompt", la.system_prompt is not None),
    ):
        if given:
            why = "needs --dataset (its rows reach reset(**row))" if flag == "--dataset" else (
                f"and {flag} both make the conversations (drop one; a system message goes in the "
                "dataset's prompt column)"
            )
            raise ValueError(f"--environment-factory {why}")
    assert la.dataset is not None  # checked above
    rows = dataset.DatasetSource(la.dataset, prompt_column=la.prompt_column, eval_path=la.eval_dataset)
    tools = []
    if la.tools is not None:
        from interlens_mcore.tools import load_tools

        tools = load_tools(la.tools)
    options = la.task_arguments
    unknown = sorted(set(options) - set(trl_env.OPTIONS))
    if unknown:
        raise ValueError(
            f"--environment-factory: no option {unknown[0]!r} (--task-arg takes {', '.join(trl_env.OPTIONS)})"
        )
    return trl_env.source(rows, la.environment_factory, tools=tools, tokenizer=tokenizer(args), **options)


def add_tools(args: Args, source: TaskSource) -> TaskSource:
    """`source` with --tools offered to its policy seats (as it is without --tools; an
    --environment-factory source has them already, beside its environments' methods)."""
    la = args.launch
    if la.tools is not None and la.environment_factory is None:
        from interlens_mcore.tools import load_tools, with_tools

        try:
            source = with_tools(source, load_tools(la.tools), tokenizer=tokenizer(args))
        except ValueError as exc:
            raise UsageError(f"--tools {la.tools}: {flagify(str(exc))}") from None
    return source


def swift_source(args: Args) -> TaskSource:
    """`--external-plugins F.py --multi-turn-scheduler NAME --dataset rows.jsonl`, as ms-swift users type."""
    from interlens_mcore.compat.swift import SwiftTaskSource
    from interlens_mcore.tasks.dataset import load_rows

    la = args.launch
    if la.dataset is None:
        raise ValueError("--multi-turn-scheduler needs --dataset (its rows reach the scheduler as data_dict)")
    rows = [dict(r) for r in load_rows(la.dataset)]
    eval_rows = [dict(r) for r in load_rows(la.eval_dataset)] if la.eval_dataset else []
    assert la.multi_turn_scheduler is not None  # task_source comes here only with one
    return SwiftTaskSource.from_spec(
        la.multi_turn_scheduler,
        dataset=rows,
        eval_dataset=eval_rows,
        plugins=la.external_plugins,
        max_turns=la.max_turns or None,
        reward_key=la.reward_key,
        train_turns=la.loss_scale,
        scheduler_kwargs={"tokenizer": tokenizer(args)},
        gym_env=la.gym_env,
    )


def tokenizer(args: Args):
    """--model's tokenizer; an asset folder cached before the tool-capable templates gets them."""
    from transformers import AutoTokenizer

    from interlens_mcore.assets.chat_templates import with_tool_template

    return with_tool_template(AutoTokenizer.from_pretrained(model_folder(args)))


def reward_fns(
    args: Args, groups: Any = None, source: TaskSource | None = None
) -> tuple[list[Any], list[float] | None]:
    """The task's own reward (unless --no-env-reward), each --reward MODULE:FN (any of the three
    conventions, `interlens_mcore.rewards`), each --reward-funcs NAME, then --reward-model's and
    --judge-model's, with weights. `groups` (the trainer's `ParallelGroups`) gives the judge the
    rollout group's vote; without them it votes alone. An --environment-factory `source` adds its
    classes' `get_reward` and gives TRL-convention functions `environments=`."""
    from interlens_mcore.rewards import adapt, named
    from interlens_mcore.tools.trl_env import EnvironmentSource, with_environments

    la = args.launch
    fns: list[Any] = [] if la.no_env_reward else [environment_reward]
    for spec in la.reward:
        try:
            fns.append(adapt(load_object(spec, what="--reward"), what=f"--reward {spec}"))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    try:
        fns += named(la.reward_funcs, la.external_plugins, max_new_tokens=args.rollout.max_new_tokens)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    fns += model_rewards(args, groups)
    if isinstance(source, EnvironmentSource):
        fns = with_environments(fns, source)
    if not fns:
        if args.origins.get("no_env_reward") == defaults.DATASET_HAS_NO_REWARD:
            raise UsageError(
                "a --dataset task has no reward of its own: add --reward MODULE:FN or --reward-funcs NAME "
                "(e.g. --reward-funcs accuracy against an answer or solution column)"
            )
        raise UsageError("--no-env-reward leaves no reward: add --reward MODULE:FN or --reward-funcs NAME")
    weights = list(la.reward_weights) or None
    if weights is not None and len(weights) != len(fns):
        names = ", ".join(reward_name(f) for f in fns)
        raise UsageError(
            f"--reward-weights has {len(weights)} values for {len(fns)} reward functions ({names})"
        )
    return fns, weights


def model_rewards(args: Args, groups: Any) -> list[Any]:
    """--reward-model's and --judge-model's reward functions (their weights load on first use)."""
    from interlens_mcore.rewards.judge import Judge, Template
    from interlens_mcore.rewards.model import RewardModel

    la, out = args.launch, list[Any]()
    if (la.judge_model is None) != (la.judge_template is None):
        given, missing = ("--judge-model", "--judge-template")[:: 1 if la.judge_model else -1]
        raise UsageError(f"{given} needs {missing} (the judge's folder and its prompt file go together)")
    try:
        if la.reward_model is not None:
            out.append(RewardModel(Path(la.reward_model), la.reward_model_label, la.reward_model_batch_size))
        if la.judge_model is not None and la.judge_template is not None:
            vote = {} if groups is None else {"gather_fn": groups.gather_fn(), "rank": groups.rank}
            template = Template.read(la.judge_template)
            out.append(Judge(Path(la.judge_model), template, la.judge_max_new_tokens, **vote))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return out


def with_task_defaults(args: Args) -> tuple[Args, TaskSource]:
    """The task source without its tools, and `args` with the task's option defaults filled in."""
    base = base_source(args)
    if args.launch.multi_turn_scheduler is not None:
        return args, base  # an ms-swift scheduler brings no options of ours
    what = f"task {args.launch.task}" if args.launch.dataset is None else "a --dataset task"
    if args.backend.model == "smollm2" and args.origins.get("model") in defaults.USER:
        # the sizes SmolLM2 learns with on a CPU (the tiny policy's lr 1e-3 would wreck it); the
        # task's own defaults come after and win
        args = defaults.apply(args, defaults.model_defaults("smollm2"), "--model smollm2")
    args = defaults.apply(args, base.option_defaults(), what)
    if args.launch.dataset is not None and args.launch.agent is None:
        # rows bring no reward of their own (an agent's return value may): the reward functions score
        args = defaults.apply(args, {"no_env_reward": True}, defaults.DATASET_HAS_NO_REWARD)
    if args.launch.tools is not None or args.launch.environment_factory is not None:
        args = defaults.apply(args, defaults.TOOL_DEFAULTS, "--tools")
    return args, base


def check(args: Args) -> tuple[Args, TaskSource]:
    """Every check that needs no process group; returns the options with the task's defaults
    filled in (`cli.defaults`) and the task source."""
    args, base = with_task_defaults(args)
    b, t, r = args.backend, args.trainer, args.rollout
    try:
        distributed.check_layout(tp=b.tp, pp=b.pp, cp=b.cp, world=world_size())
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if t.batch_size % r.num_generations:
        raise UsageError(
            f"--num-generations {r.num_generations} does not fit --batch-size {t.batch_size}: "
            "the batch must hold whole groups (a positive multiple of num_generations)"
        )
    if b.model not in (None, "smollm2", "tiny") and not Path(b.model).exists() and HUB_ID.fullmatch(b.model):
        local = f"models/{b.model.split('/')[1]}"
        raise UsageError(
            f"--model {b.model}: no such folder; models are read from a local folder (nothing is "
            f"downloaded here): get it with `huggingface-cli download {b.model} --local-dir {local}`, "
            f"then pass --model {local}"
        )
    if b.model not in (None, "smollm2", "tiny") and not (Path(b.model) / "config.json").is_file():
        raise UsageError(f"--model {b.model}: not an HF checkpoint folder (no config.json)")
    named = b.model in (None, "smollm2", "tiny")  # the assets: HF folders, built here
    if not named and b.backend == "deepspeed" and (Path(str(b.model)) / "megatron.json").is_file():
        raise UsageError(
            f"--model {b.model}: a sharded megatron checkpoint; --backend deepspeed needs an HF folder "
            "(convert it: launch/convert.py --megatron IN --hf OUT)"
        )
    folder = model_folder(args)
    check_heads(model_config(folder, b.model), b.tp, str(folder))
    if not named and (folder / "megatron.json").is_file():
        try:  # its weights are read through DCP, whose metadata is a pickle: checked first
            check_dcp(folder / "weights")
        except UnsafeCheckpoint as exc:
            raise UsageError(f"--model {b.model}: refused, {exc}") from None
    if t.sft_data:  # every line checked before any process group exists: one line names the bad one
        from trainers.sft import BadDemonstration, read_demonstrations

        try:
            read_demonstrations(t.sft_data)
        except BadDemonstration as exc:
            raise UsageError(str(exc)) from None
    if t.sync_ref_model and not args.loss.beta > 0:
        raise UsageError(
            f"--sync-ref-model moves the KL reference, and --beta {args.loss.beta:g} keeps none: "
            "give --beta > 0"
        )
    if t.sync_ref_model and b.lora_rank:
        raise UsageError(
            f"--sync-ref-model moves the KL reference, and with --lora-rank {b.lora_rank} the reference is "
            "the base model under the adapters, which never moves: drop one"
        )
    if t.kl_in_reward and not args.loss.beta > 0:
        raise UsageError(
            f"--kl-in-reward lowers each reward by beta x its KL, and --beta {args.loss.beta:g} lowers "
            "none: give --beta > 0"
        )
    if t.kl_in_reward and r.multi_objective_aggregation != "sum_then_normalize":
        raise UsageError(
            f"--kl-in-reward lowers the total reward, which --multi-objective-aggregation "
            f"{r.multi_objective_aggregation} does not read: use sum_then_normalize"
        )
    if b.vllm_sleep and b.engine != "vllm":
        raise UsageError("--vllm-sleep puts vLLM to sleep during training: it needs --engine vllm")
    if b.engine == "vllm":
        check_vllm()
        import torch

        if b.vllm_sleep and not torch.cuda.is_available():
            raise UsageError("--vllm-sleep: vLLM's sleep mode frees GPU memory and needs a GPU (none here)")
    if args.launch.export_hf is not None and b.backend != "megatron":
        raise UsageError("--export-hf is available with --backend megatron only")
    source = add_tools(args, base)
    try:
        t.micro_batch_size(t.batch_size * len(source.trained_seats), r.micro_batch_size)
    except ValueError as exc:
        raise UsageError(flagify(str(exc))) from None
    reward_fns(args, source=source)
    if args.launch.eval_only and not source.eval_rows(1, seed=0):
        raise UsageError(
            f"--eval-only: task {source.name} has no held-out rows to evaluate "
            "(a dataset takes them from --eval-dataset or a twentieth of its rows)"
        )
    sizes.check_sizes(args, source)
    if args.launch.eval_only and args.launch.export_hf is not None:
        raise UsageError("--eval-only trains nothing: --export-hf has nothing new to write (drop one)")
    if args.launch.eval_only and not args.launch.resuming(t.output_dir):
        if t.output_dir is not None:  # eval.jsonl goes there; the folder need not be a run
            sizes.check_output_dir(Path(t.output_dir))
    elif t.output_dir is not None:
        sizes.check_output_dir(Path(t.output_dir))
        try:
            rundir.check(
                Path(t.output_dir), run_info(args, source), resume=args.launch.resuming(t.output_dir)
            )
        except rundir.RunDirError as exc:
            raise UsageError(str(exc)) from None
    return args, source


def run_info(args: Args, source: TaskSource) -> dict[str, Any]:
    """What run.json holds: the trainer's description of the run and the launch options."""
    from interlens_mcore.grpo.rewards import WeightedRewards
    from trainers.grpo import describe_run

    fns, weights = reward_fns(args, source=source)
    rewards = WeightedRewards(fns, weights)
    described = describe_run(args.trainer, args.rollout, args.loss, source, rewards, world_size())
    skip = ("resume", "export_hf", "eval_only")  # how this launch uses the run, not what the run is
    launch = {k: v for k, v in dataclasses.asdict(args.launch).items() if k not in skip}
    return {**described, **dataclasses.asdict(args.backend), **launch}


def check_vllm() -> None:
    """--engine vllm needs vLLM importable here (a broken install fails at import, not only a missing one)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or the RuntimeError of a build for another device
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise UsageError(
            f"--engine vllm: vLLM does not import here ({reason}); on a GPU install it with "
            'pip install -e ".[all,vllm]", on CPU run in the environment .ci/vllm_stage.sh builds'
        ) from None


def model_config(folder: Path, flag_value: str | None) -> dict:
    """--model's config.json, checked for what building the model reads first."""
    path, name = folder / "config.json", flag_value or str(folder)
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--model {name}: {path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--model {name}: {path} holds {type(config).__name__}, expected a JSON object")
    if not isinstance(config.get("model_type"), str):
        raise UsageError(f"--model {name}: {path} has no model_type (not a transformers model config)")
    keys = ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size", "num_key_value_heads")
    for key in keys:
        value = config.get(key)
        if value is None and key == "num_key_value_heads":
            continue  # absent: as many as the attention heads
        if type(value) is not int or value < 1:
            raise UsageError(f"--model {name}: {path}: {key} must be a positive integer, got {value!r}")
    return config


def check_heads(hf_config: dict, tp: int, where: str) -> None:
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = hf_config.get(key) or hf_config.get("num_attention_heads")
        if not isinstance(n, int) or n < 1:
            raise UsageError(f"--model {where}: config.json has no positive integer {key} (got {n!r})")
        if n % tp:
            raise UsageError(f"--tp {tp} does not divide {key}={n} of the model in {where}")


def build_trainer(args: Args, source: TaskSource):
    """Collective: process groups, the backend for --backend and the GRPO trainer."""
    from trainers import GRPOTrainer, build_backend

    path = model_folder(args)
    tok = tokenizer(args)
    per_rank = args.trainer.batch_size * len(source.trained_seats)
    backend, groups = build_backend(
        args.backend,
        args.trainer,
        model_path=path,
        tokenizer=tok,
        temperature=args.rollout.temperature,
        reference=args.loss.beta > 0,
        trajectories_per_rank=per_rank,
        micro_batch_size=args.trainer.micro_batch_size(per_rank, args.rollout.micro_batch_size),
    )
    fns, weights = reward_fns(args, groups, source)
    return GRPOTrainer(
        backend=backend,
        tasks=source,
        groups=groups,
        tokenizer=tok,
        config=args.trainer,
        rollout_config=args.rollout,
        loss_config=args.loss,
        rewards=fns,
        reward_weights=weights,
        run_info=run_info(args, source),
    )
