"""Every input `launch/train_grpo.py` refuses, with the one line it prints: the source of
docs/bad-input.md (`python tests/support/bad_inputs.py > docs/bad-input.md` writes it), and what
tests/e2e/test_bad_input_table.py checks, row by row, against the script itself.

In `args`, `files` and `message`, `{tmp}/` is a fresh folder (the table leaves it out) and `…`
in a message stands for text that depends on the machine. A row with `tested_by` needs a run
or a process group; the test named there runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

SWIFT_ROWS = '{"messages": [{"role": "user", "content": "q"}], "solution": "1"}\n'
ORM_PLUGIN = (
    "class Strict:\n    def __init__(self, threshold):\n        self.threshold = threshold\n\n"
    "    def __call__(self, completions, **kwargs):\n        return [0.0 for _ in completions]\n\n\n"
    "orms = {'strict': Strict}\n"
)
CAUSAL_LM = '{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}'
CLASSIFIER = (
    '{"architectures": ["Qwen2ForSequenceClassification"], "model_type": "qwen2", "id2label": {"0": "s"}}'
)
AGENT = "LIMIT = 3\n\n\nasync def play(client, row):\n    return 0.0\n"
FACTORY = "def make():\n    raise RuntimeError('boom')\n\n\ndef not_a_task():\n    return 5\n"


@dataclass(frozen=True)
class Refusal:
    """One refused input and the line after `train_grpo.py: error: `."""

    what: str  # the input, as the table names it
    args: tuple[str, ...]  # the command line (--output-dir {tmp}/out is added unless given)
    message: str
    files: tuple[tuple[str, str], ...] = ()  # (path under {tmp}, text) written first
    env: tuple[tuple[str, str], ...] = ()  # e.g. WORLD_SIZE, as torchrun sets it
    tested_by: str = ""  # tests/FILE.py::TEST for a refusal that needs a run


# a TRL environment class, one without reset, and a dict of one (--environment-factory)
ENVS = (
    "class Lamp:\n    def reset(self, **row):\n        return None\n\n    def get_reward(self):\n"
    "        return 0.0\n\n\nclass Broken:\n    pass\n\n\nBY_NAME = {'lamp': Lamp}\n"
)
ENV_ROWS = '{"prompt": "light it", "environment": "lamp"}\n{"prompt": "bake", "environment": "oven"}\n'

SECTIONS: list[tuple[str, list[Refusal]]] = [
    (
        "Options and YAML",
        [
            Refusal(
                "a mistyped flag", ("--lrr", "0.1"), "unrecognized arguments: --lrr (did you mean --lr?)"
            ),
            Refusal(
                "a mistyped YAML key",
                ("--config", "{tmp}/run.yaml"),
                "--config {tmp}/run.yaml: unknown key 'stpes' (did you mean steps?)",
                files=(("run.yaml", "stpes: 3\n"),),
            ),
            Refusal(
                "a YAML value of the wrong type",
                ("--config", "{tmp}/run.yaml"),
                "--config {tmp}/run.yaml: steps must be int, got 'many'",
                files=(("run.yaml", "steps: many\n"),),
            ),
            Refusal(
                "YAML `steps: null`",
                ("--config", "{tmp}/run.yaml"),
                "--config {tmp}/run.yaml: steps must be int, got None",
                files=(("run.yaml", "steps: null\n"),),
            ),
            Refusal(
                "YAML `reward: 5`",
                ("--config", "{tmp}/run.yaml"),
                "--config {tmp}/run.yaml: reward must be a list of str, got [5]",
                files=(("run.yaml", "reward: 5\n"),),
            ),
            Refusal(
                "a YAML file that is not a mapping",
                ("--config", "{tmp}/run.yaml"),
                "--config {tmp}/run.yaml: expected a mapping of option names, got list",
                files=(("run.yaml", "- steps\n"),),
            ),
            Refusal(
                "a missing YAML file", ("--config", "{tmp}/run.yaml"), "--config {tmp}/run.yaml: no such file"
            ),
            Refusal(
                "a value outside its choices",
                ("--on-timeout", "later"),
                "--on-timeout: invalid choice: 'later' (choose from 'zero', 'drop')",
            ),
            Refusal(
                "a TRL name given with ours",
                ("--lr", "1e-3", "--learning_rate", "1e-4"),
                "--learning-rate and --lr both given: one option, two names (keep one)",
            ),
            Refusal(
                "a mistyped TRL name",
                ("--max-completion-lenght", "64"),
                "unrecognized arguments: --max-completion-lenght (did you mean --max-completion-length?)",
            ),
            Refusal(
                "`--max-prompt-length` (no counterpart)",
                ("--max-prompt-length", "512"),
                "--max-prompt-length: prompts are never truncated here (a turn's cap is --max-new-tokens); "
                "shorten the dataset's prompts instead",
            ),
            Refusal(
                "`--logging-steps` (every step is logged)",
                ("--logging_steps", "5"),
                "--logging-steps: every step is logged here (metrics.jsonl); sample completions every "
                "--log-completions-every steps",
            ),
            Refusal(
                "`num_train_epochs` in YAML (runs count steps)",
                ("--config", "{tmp}/run.yaml"),
                "--config {tmp}/run.yaml: num_train_epochs: runs are counted in steps here: use --steps N "
                "(each step draws --batch-size / --num-generations prompts per rank)",
                files=(("run.yaml", "num_train_epochs: 3\n"),),
            ),
            Refusal(
                "--resume with an unknown value",
                ("--resume", "maybe"),
                "--resume must be one of no, yes, auto, got 'maybe'",
            ),
        ],
    ),
    (
        "Numbers",
        [
            Refusal("a learning rate <= 0", ("--lr=-1",), "--lr must be > 0, got -1.0"),
            Refusal("`--lr inf`", ("--lr", "inf"), "--lr must be a finite number, got inf"),
            Refusal("`--beta inf`", ("--beta", "inf"), "--beta must be a finite number, got inf"),
            Refusal(
                "`--temperature inf`",
                ("--temperature", "inf"),
                "--temperature must be a finite number, got inf",
            ),
            Refusal(
                "`--reward-weights nan`",
                ("--reward-weights", "nan"),
                "--reward-weights must be finite numbers, got [nan]",
            ),
            Refusal(
                "a warmup ratio outside [0, 1)",
                ("--warmup-ratio", "1.5"),
                "--warmup-ratio must be in [0, 1), got 1.5",
            ),
            Refusal(
                "--warmup-steps and --warmup-ratio together",
                ("--warmup-steps", "3", "--warmup-ratio", "0.1"),
                "--warmup-steps and --warmup-ratio both set: they say the same thing (keep one)",
            ),
            Refusal(
                "accumulation steps that do not divide the batch",
                ("--batch-size", "8", "--num-generations", "4", "--gradient-accumulation-steps", "3"),
                "--gradient-accumulation-steps 3 does not divide the 8 trajectories of a rank's step "
                "(--batch-size x trained seats) into equal micro-batches",
            ),
            Refusal(
                "accumulation steps and another micro-batch size",
                (
                    "--batch-size",
                    "8",
                    "--num-generations",
                    "4",
                    "--gradient-accumulation-steps",
                    "2",
                    "--per-device-train-batch-size",
                    "2",
                ),
                "--gradient-accumulation-steps 2 makes micro-batches of 4 trajectories but "
                "--micro-batch-size is 2 (give one of them, or --batch-size 4 for N micro-batches of 2)",
            ),  # fmt: skip
            Refusal("a clip range outside (0, 1)", ("--epsilon=2",), "--epsilon must be in (0, 1), got 2.0"),
            Refusal("no overlap slice", ("--overlap", "0"), "--overlap must be >= 1 (1: off), got 0"),
            Refusal(
                "a step time limit <= 0",
                ("--step-timeout-s", "0"),
                "--step-timeout-s must be a number of seconds > 0 or None, got 0.0",
            ),
            Refusal(
                "groups that do not fill the batch",
                ("--batch-size", "10", "--num-generations", "4"),
                "--num-generations 4 does not fit --batch-size 10: the batch must hold whole groups "
                "(a positive multiple of num_generations)",
            ),
            Refusal(
                "a batch that cannot fit in memory",
                ("--batch-size", "4000000000000000"),
                "--batch-size 4000000000000000: 4,000,000,000,000,000 trajectories per rank per step on 1 "
                "rank(s) need at least 1,907,348,632.8 GiB, more than this machine's … of memory",
            ),
            Refusal(
                "an evaluation that cannot fit in memory",
                ("--eval-size", "4000000000000000"),
                "--eval-size 4000000000000000: 4,000,000,000,000,000 held-out trajectories per rank on 1 "
                "rank(s) need at least 1,907,348,632.8 GiB, more than this machine's … of memory",
            ),
        ],
    ),
    (
        "Parallel layout and model",
        [
            Refusal(
                "a TP size that does not divide the world",
                ("--tp", "2"),
                "--tp 2 does not divide the world size 3",
                env=(("WORLD_SIZE", "3"),),
            ),
            Refusal(
                "a TP size that does not divide the heads",
                ("--tp", "4"),
                "--tp 4 does not divide num_key_value_heads=2 of the model in …",
                env=(("WORLD_SIZE", "4"),),
            ),
            Refusal(
                "a pipeline longer than the world",
                ("--pp", "2"),
                "--tp 1 x --pp 2 does not divide the world size 1",
            ),
            Refusal(
                "pipeline parallelism on the deepspeed backend",
                ("--backend", "deepspeed", "--pp", "2"),
                "--pp 2: the deepspeed backend has no pipeline parallelism (use --pp 1, or --backend "
                "megatron)",
                env=(("WORLD_SIZE", "2"),),
            ),
            Refusal(
                "pipeline parallelism with LoRA dropout and recompute",
                ("--pp", "2", "--lora-rank", "8", "--recompute"),
                "--pp 2 with LoRA dropout 0.05 and recompute: the recomputed layers would not draw "
                "their forward's dropout masks; use --lora-dropout 0 or drop --recompute",
                env=(("WORLD_SIZE", "2"),),
            ),
            Refusal(
                "pipeline parallelism with adapters through vLLM's LoRA path",
                ("--pp", "2", "--engine", "vllm", "--lora-rank", "8", "--vllm-lora", "adapter"),
                "--pp 2 with --vllm-lora 'adapter': vLLM's LoRA path needs the whole adapters on every "
                "rank, which are not gathered across stages yet; use --vllm-lora merged (the megatron "
                "default)",
                env=(("WORLD_SIZE", "2"),),
            ),
            Refusal(
                "a hub id as `--model` (nothing is downloaded)",
                ("--model", "Qwen/Qwen2.5-0.5B-Instruct"),
                "--model Qwen/Qwen2.5-0.5B-Instruct: no such folder; models are read from a local folder "
                "(nothing is downloaded here): get it with `huggingface-cli download "
                "Qwen/Qwen2.5-0.5B-Instruct --local-dir models/Qwen2.5-0.5B-Instruct`, then pass "
                "--model models/Qwen2.5-0.5B-Instruct",
            ),
            Refusal(
                "`--model` without config.json",
                ("--model", "{tmp}/nope"),
                "--model {tmp}/nope: not an HF checkpoint folder (no config.json)",
            ),
            Refusal(
                "`--model` whose config.json is `{}`",
                ("--model", "{tmp}/D"),
                "--model {tmp}/D: {tmp}/D/config.json has no model_type (not a transformers model config)",
                files=(("D/config.json", "{}"),),
            ),
            Refusal(
                "`--model` whose config.json is not JSON",
                ("--model", "{tmp}/D"),
                "--model {tmp}/D: {tmp}/D/config.json is not valid JSON "
                "(Expecting value: line 1 column 1 (char 0))",
                files=(("D/config.json", "not json"),),
            ),
            Refusal(
                "`--model` whose config.json lacks a size",
                ("--model", "{tmp}/D"),
                "--model {tmp}/D: {tmp}/D/config.json: num_attention_heads must be a positive integer, "
                "got None",
                files=(("D/config.json", '{"model_type": "qwen2"}'),),
            ),
            Refusal(
                "a megatron checkpoint for --backend deepspeed",
                ("--model", "{tmp}/M", "--backend", "deepspeed"),
                "--model {tmp}/M: a sharded megatron checkpoint; --backend deepspeed needs an HF folder "
                "(convert it: launch/convert.py --megatron IN --hf OUT)",
                files=(("M/config.json", "{}"), ("M/megatron.json", "{}")),
            ),
            Refusal(
                "a megatron checkpoint as --model whose metadata carries a pickle payload",
                ("--model", "{tmp}/model"),
                "--model {tmp}/model: refused, {tmp}/model/weights/.metadata is a pickle that would call "
                "posix.system when loaded",
                tested_by="tests/e2e/test_checkpoint_safety.py::test_a_megatron_checkpoint_as_model_carrying_a_payload_is_refused",
            ),
            Refusal(
                "--bf16 with --backend deepspeed",
                ("--backend", "deepspeed", "--bf16", "true"),
                "--bf16 is for the megatron backend; --backend deepspeed computes in the model's own dtype "
                "(drop --bf16)",
            ),
            Refusal(
                "--tp with --backend deepspeed",
                ("--backend", "deepspeed", "--tp", "2"),
                "--tp 2: the deepspeed backend has no tensor parallelism (use --tp 1)",
                env=(("WORLD_SIZE", "2"),),
            ),
            Refusal(
                "--export-hf with --backend deepspeed",
                ("--backend", "deepspeed", "--export-hf", "{tmp}/hf"),
                "--export-hf is available with --backend megatron only",
            ),
            Refusal(
                "--vllm-sleep without --engine vllm",
                ("--vllm-sleep",),
                "--vllm-sleep puts vLLM to sleep during training: it needs --engine vllm",
            ),
            Refusal(
                "--engine vllm where vLLM does not import",
                ("--engine", "vllm"),
                "--engine vllm: vLLM does not import here (…); on a GPU install it with pip install -e "
                '".[all,vllm]", on CPU run in the environment .ci/vllm_stage.sh builds',
                tested_by="tests/e2e/test_train_bad_input.py::test_engine_vllm_without_vllm",
            ),
        ],
    ),
    (
        "Task, rewards, dataset, tools",
        [
            Refusal(
                "an unknown task",
                ("--task", "chess"),
                "--task 'chess' is not a known task; expected one of guess, duel, …",
            ),
            Refusal(
                "a task option of the wrong value",
                ("--task", "duel", "--task-args", '{"opponent": "mirror"}'),
                "--task duel: task_args.opponent must be one of self, random, frozen, got 'mirror'",
            ),
            Refusal(
                "an evaluation opponent the duel does not know",
                ("--task", "duel", "--task-args", '{"eval_opponents": ["random", "mirror"]}'),
                "--task duel: task_args.eval_opponents holds ['mirror']; each must be one of random, initial",
            ),
            Refusal(
                "a task option the task does not take",
                ("--task", "guess", "--task-args", '{"opponent": "random"}'),
                "--task guess: bad --task-args {'opponent': 'random'}: …",
            ),
            Refusal(
                "`--eval-only` on a task without held-out rows",
                ("--dataset", "{tmp}/one.jsonl", "--reward-funcs", "format", "--eval-only"),
                "--eval-only: task dataset:one.jsonl has no held-out rows to evaluate (a dataset takes "
                "them from --eval-dataset or a twentieth of its rows)",
                files=(("one.jsonl", '{"prompt": "2 + 2 ="}\n'),),
            ),
            Refusal(
                "`--eval-only` with `--export-hf`",
                ("--eval-only", "--export-hf", "{tmp}/hf"),
                "--eval-only trains nothing: --export-hf has nothing new to write (drop one)",
            ),
            Refusal(
                "a mistyped task argument",
                ("--task", "gym:Taxi-v4", "--task-arg", "max_step=30"),
                "--task-arg max_step: gym:Taxi-v4 takes no max_step (did you mean max_steps?)",
            ),
            Refusal(
                "--task-args that is not an object",
                ("--task-args", "[1, 2]"),
                "--task-args must be a JSON object, got '[1, 2]'",
            ),
            Refusal(
                "a task module that does not import",
                ("--task", "nosuchmodule:make"),
                "--task: cannot import 'nosuchmodule' (No module named 'nosuchmodule'); is it on PYTHONPATH?",
            ),
            Refusal(
                "a task factory that raises",
                ("--task", "{tmp}/tasks.py:make"),
                "--task {tmp}/tasks.py:make: the factory raised RuntimeError: boom",
                files=(("tasks.py", FACTORY),),
            ),
            Refusal(
                "a task factory that returns no task source",
                ("--task", "{tmp}/tasks.py:not_a_task"),
                "--task {tmp}/tasks.py:not_a_task: the factory returned int, expected an "
                "interlens_mcore.tasks.TaskSource",
                files=(("tasks.py", FACTORY),),
            ),
            Refusal(
                "a reward function that does not exist",
                ("--reward", "json:nope"),
                "--reward 'json:nope': json has no 'nope' (it has: …)",
            ),
            Refusal(
                "a reward that is not callable",
                ("--reward", "json:__name__"),
                "--reward json:__name__: str is not callable",
            ),
            Refusal(
                "as many weights as reward functions, not",
                ("--reward-weights", "1", "2"),
                "--reward-weights has 2 values for 1 reward functions (env)",
            ),
            Refusal(
                "no reward at all",
                ("--no-env-reward",),
                "--no-env-reward leaves no reward: add --reward MODULE:FN or --reward-funcs NAME",
            ),
            Refusal(
                "a dataset with no reward function",
                ("--dataset", "{tmp}/rows.jsonl"),
                "a --dataset task has no reward of its own: add --reward MODULE:FN or --reward-funcs NAME "
                "(e.g. --reward-funcs accuracy against an answer or solution column)",
                files=(("rows.jsonl", '{"prompt": "what is 2 + 2?", "answer": "4"}\n'),),
            ),
            Refusal(
                "an empty dataset",
                ("--dataset", "{tmp}/rows.jsonl"),
                "dataset '{tmp}/rows.jsonl' is empty",
                files=(("rows.jsonl", ""),),
            ),
            Refusal(
                "bad JSON in a dataset",
                ("--dataset", "{tmp}/rows.jsonl"),
                "dataset '{tmp}/rows.jsonl' line 2: not JSON (Expecting property name enclosed in double "
                "quotes at column 2)",
                files=(("rows.jsonl", '{"prompt": "2 + 2?"}\n{bad\n'),),
            ),
            Refusal(
                "a dataset that does not exist",
                ("--dataset", "{tmp}/rows.jsonl"),
                "dataset '{tmp}/rows.jsonl': no such file",
            ),
            Refusal(
                "a dataset of an unknown format",
                ("--dataset", "{tmp}/rows.txt"),
                "dataset '{tmp}/rows.txt': expected a .jsonl, .json, .parquet, .csv file or a "
                "save_to_disk folder",
                files=(("rows.txt", "2 + 2?\n"),),
            ),
            Refusal(
                "a tool that is not a function",
                ("--tools", "json:__name__"),
                "--tools json:__name__: a tool must be a function, got str",
            ),
            Refusal(
                "a tool not named MODULE:FN",
                ("--tools", "calculator"),
                "--tools calculator: tool 'calculator': expected MODULE:FN "
                "(e.g. interlens_mcore.tools.examples:calculator)",
            ),
            Refusal(
                "--environment-factory without --dataset",
                ("--environment-factory", "{tmp}/envs.py:Lamp"),
                "--environment-factory needs --dataset (its rows reach reset(**row))",
                files=(("envs.py", ENVS),),
            ),
            Refusal(
                "a TRL environment without reset",
                ("--environment-factory", "{tmp}/envs.py:Broken", "--dataset", "{tmp}/rows.jsonl"),
                "--environment-factory {tmp}/envs.py:Broken: Broken has no reset(**row) method",
                files=(("envs.py", ENVS), ("rows.jsonl", ENV_ROWS)),
            ),
            Refusal(
                "a row naming no environment of the dict",
                ("--environment-factory", "{tmp}/envs.py:BY_NAME", "--dataset", "{tmp}/rows.jsonl"),
                "dataset '{tmp}/rows.jsonl': a row has environment='oven'; a dict environment_factory picks "
                "by that column, expected one of ['lamp']",
                files=(("envs.py", ENVS), ("rows.jsonl", ENV_ROWS)),
            ),
        ],
    ),
    (
        "The output folder",
        [
            Refusal(
                "a folder holding another run",
                ("--output-dir", "{tmp}/out"),
                "--output-dir {tmp}/out: holds another run; pass --resume to continue it (or --resume with a "
                "larger --steps to extend it), or choose an empty folder",
                files=(("out/run.json", '{"steps": 1}'),),
            ),
            Refusal(
                "a folder holding other files",
                ("--output-dir", "{tmp}/out"),
                "--output-dir {tmp}/out: holds files that are not a run of this trainer",
                files=(("out/keep", "mine"),),
            ),
            Refusal(
                "a file",
                ("--output-dir", "{tmp}/out"),
                "--output-dir {tmp}/out: exists and is not a folder",
                files=(("out", "a file"),),
            ),
            Refusal(
                "`--output-dir /proc/x`",
                ("--output-dir", "/proc/x"),
                "--output-dir /proc/x: /proc is on the kernel's proc filesystem (no files)",
            ),
            Refusal(
                "--resume with options that change the run",
                ("--output-dir", "{tmp}/run", "--lr", "0.1", "--resume"),
                "--output-dir {tmp}/run: --resume with different options: lr (lr: 0.001 -> 0.1); start a new "
                "run in another folder to change them",
                tested_by="tests/e2e/test_train_resume.py::test_resume_with_changed_options_is_refused",
            ),
            Refusal(
                "--resume into a folder another run is writing to",
                ("--output-dir", "{tmp}/run", "--resume"),
                "--output-dir {tmp}/run: another process is still writing to it (.lock is held)",
                tested_by="tests/e2e/test_train_resume.py::test_a_refused_resume_touches_nothing_of_the_live_run",
            ),
            Refusal(
                "--resume with checkpoints/ deleted",
                ("--output-dir", "{tmp}/run", "--resume"),
                "--resume: step-000002, the newest checkpoint this run wrote, is gone from "
                "{tmp}/run/checkpoints; resuming would redo steps 0..1. Restore it, or train into a new "
                "--output-dir",
                tested_by="tests/e2e/test_train_resume.py::test_resume_with_its_checkpoints_deleted_is_refused",
            ),
            Refusal(
                "--resume where every checkpoint is corrupt",
                ("--output-dir", "{tmp}/run", "--resume"),
                "no intact checkpoint in {tmp}/run/checkpoints to resume from; set aside as corrupt: "
                "corrupt-step-000002. Delete them to train this run again from step 0 with --resume, or "
                "train into a new --output-dir",
                tested_by="tests/e2e/test_checkpoint_integrity.py::test_resume_refuses_when_every_checkpoint_is_corrupt",
            ),
            Refusal(
                "--resume from a checkpoint carrying a pickle payload",
                ("--output-dir", "{tmp}/run", "--resume"),
                "checkpoint {tmp}/run/checkpoints/step-000002 is refused: trainer-rank00000.pt is a pickle "
                "that would call posix.system when loaded; nothing of it was loaded. Resume only from "
                "checkpoints this version wrote, or train into a new --output-dir (a checkpoint's weights "
                "load as --model)",
                tested_by="tests/e2e/test_checkpoint_safety.py::test_resume_refuses_a_checkpoint_carrying_a_payload",
            ),
            Refusal(
                "--resume from a DeepSpeed checkpoint whose states file is a protocol 0 pickle payload",
                ("--backend", "deepspeed", "--zero-stage", "1", "--output-dir", "{tmp}/run", "--resume"),
                "checkpoint {tmp}/run/checkpoints/step-000002 is refused: "
                "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt is a pickle that would call "
                "posix.system when loaded; nothing of it was loaded. Resume only from checkpoints this "
                "version wrote, or train into a new --output-dir (a checkpoint's weights load as --model)",
                tested_by="tests/e2e/test_checkpoint_safety.py"
                "::test_resume_refuses_a_deepspeed_state_of_protocol_0_carrying_a_payload",
            ),
            Refusal(
                "a --reward-funcs name that is neither built in nor in a plugin's orms",
                ("--reward-funcs", "acuracy"),
                "--reward-funcs acuracy: no such reward; built-in: accuracy, format, react_format, cosine, "
                "repetition, soft_overlong (a plugin file registers more in its orms dict)",
            ),
            Refusal(
                "a reward function of none of the three conventions",
                ("--reward", "{tmp}/rewards.py:one"),
                "--reward {tmp}/rewards.py:one: one takes (x); expected fn(trajectories, rows), TRL's "
                "fn(prompts, completions, completion_ids, **kwargs) or an ms-swift ORM class",
                files=(("rewards.py", "def one(x):\n    return [x]\n"),),
            ),
            Refusal(
                "an ORM class that needs arguments",
                ("--external-plugins", "{tmp}/orm_plugin.py", "--reward-funcs", "strict"),
                "--reward-funcs strict: the ORM class Strict cannot be built with no arguments (TypeError: "
                "Strict.__init__() missing 1 required positional argument: 'threshold')",
                files=(("orm_plugin.py", ORM_PLUGIN),),
            ),
        ],
    ),
    (
        "ms-swift schedulers and environments",
        [
            Refusal(
                "--gym-env without a scheduler",
                ("--gym-env", "math_env"),
                "--gym-env names the environment of a --multi-turn-scheduler: give one",
            ),
            Refusal(
                "a scheduler name nothing registered",
                ("--multi-turn-scheduler", "math_tips", "--dataset", "{tmp}/rows.jsonl"),
                "--multi-turn-scheduler 'math_tips': no scheduler of that name (registered: gym_scheduler); "
                "register one in a --external-plugins file's multi_turns dict or give MODULE:CLASS",
                files=(("rows.jsonl", SWIFT_ROWS),),
            ),
            Refusal(
                "a gym environment name nothing registered",
                ("--multi-turn-scheduler", "gym_scheduler", "--gym-env", "math_env")
                + ("--dataset", "{tmp}/rows.jsonl"),
                "--gym-env 'math_env': no environment of that name (registered: none); register one in a "
                "--external-plugins file's envs dict",
                files=(("rows.jsonl", SWIFT_ROWS),),
            ),
        ],
    ),
    (
        "Dynamic sampling",
        [
            Refusal(
                "--max-extra-rounds without --dynamic-sampling",
                ("--max-extra-rounds", "5"),
                "--max-extra-rounds caps the rounds of --dynamic-sampling: give it too",
            ),
            Refusal(
                "a negative --max-extra-rounds",
                ("--dynamic-sampling", "--max-extra-rounds", "-1"),
                "--max-extra-rounds must be >= 0, got -1",
            ),
        ],
    ),
    (
        "A moving reference (--sync-ref-model)",
        [
            Refusal(
                "--sync-ref-model with no KL reference",
                ("--sync-ref-model", "--beta", "0"),
                "--sync-ref-model moves the KL reference, and --beta 0 keeps none: give --beta > 0",
            ),
            Refusal(
                "its settings without it",
                ("--ref-model-sync-steps", "64"),
                "--ref-model-mixup-alpha and --ref-model-sync-steps shape --sync-ref-model: give it too",
            ),
            Refusal(
                "a mixup share outside (0, 1]",
                ("--sync-ref-model", "--ref-model-mixup-alpha", "1.5"),
                "--ref-model-mixup-alpha must be in (0, 1], got 1.5",
            ),
        ],
    ),
    (
        "The KL in the reward (--kl-in-reward)",
        [
            Refusal(
                "--kl-in-reward with no coefficient",
                ("--kl-in-reward", "--beta", "0"),
                "--kl-in-reward lowers each reward by beta x its KL, and --beta 0 lowers none: "
                "give --beta > 0",
            ),
            Refusal(
                "an aggregation that does not read the total",
                ("--kl-in-reward", "--multi-objective-aggregation", "normalize_then_sum"),
                "--kl-in-reward lowers the total reward, which --multi-objective-aggregation "
                "normalize_then_sum does not read: use sum_then_normalize",
            ),
            Refusal(
                "its settings without it",
                ("--kl-ctrl", "adaptive"),
                "--kl-ctrl, --kl-target and --kl-horizon shape --kl-in-reward: give it too",
            ),
            Refusal(
                "a target that is not a positive number",
                ("--kl-in-reward", "--kl-ctrl", "adaptive", "--kl-target", "0"),
                "--kl-target must be a finite number > 0, got 0.0",
            ),
            Refusal(
                "a horizon under one sample",
                ("--kl-in-reward", "--kl-horizon", "0"),
                "--kl-horizon must be >= 1, got 0",
            ),
        ],
    ),
    (
        "LoRA (--lora-rank)",
        [
            Refusal(
                "a negative rank",
                ("--backend", "deepspeed", "--lora-rank", "-4"),
                "--lora-rank must be >= 0 (0: full fine-tuning), got -4",
            ),
            Refusal(
                "a layer the Megatron model does not adapt",
                ("--lora-rank", "8", "--lora-target-modules", "q_proj,lm_head"),
                "--lora-target-modules 'q_proj,lm_head': 'lm_head' is not a linear layer of the Megatron "
                "model; expected all-linear or among down_proj, gate_proj, k_proj, linear_fc1, linear_fc2, "
                "linear_proj, linear_qkv, o_proj, q_proj, up_proj, v_proj",
            ),
            Refusal(
                "its settings without it",
                ("--backend", "deepspeed", "--lora-alpha", "16"),
                "--lora-alpha shapes LoRA adapters: give --lora-rank > 0",
            ),
            Refusal(
                "a dropout outside [0, 1)",
                ("--backend", "deepspeed", "--lora-rank", "8", "--lora-dropout", "1"),
                "--lora-dropout must be in [0, 1), got 1.0",
            ),
            Refusal(
                "a module name that is no name",
                ("--backend", "deepspeed", "--lora-rank", "8", "--lora-target-modules", "q-proj"),
                "--lora-target-modules 'q-proj': expected module names separated by commas (q_proj,v_proj) "
                "or all-linear",
            ),
            Refusal(
                "merged weights from the deepspeed backend",
                ("--backend", "deepspeed", "--lora-rank", "8", "--engine", "vllm", "--vllm-lora", "merged"),
                "--vllm-lora 'merged': the deepspeed backend hands vLLM its adapters (--vllm-lora adapter); "
                "merged weights come from --backend megatron",
            ),
            Refusal(
                "an adapter sync without vLLM",
                ("--backend", "megatron", "--lora-rank", "8", "--vllm-lora", "adapter"),
                "--vllm-lora 'adapter' says how adapters reach vLLM: give --engine vllm",
            ),
            Refusal(
                "a reference that would move",
                ("--backend", "deepspeed", "--lora-rank", "8", "--beta", "0.1", "--sync-ref-model"),
                "--sync-ref-model moves the KL reference, and with --lora-rank 8 the reference is the base "
                "model under the adapters, which never moves: drop one",
            ),
        ],
    ),
    (
        "Advantage estimators",
        [
            Refusal(
                "an estimator nobody registered",
                ("--advantage-estimator", "gae"),
                "--advantage-estimator must be one of ('grpo', 'rloo', 'reinforce_plus_plus_baseline', "
                "'reinforce_plus_plus') (register_advantage_estimator adds one), got 'gae'",
            ),
            Refusal(
                "a scale the estimator does not take",
                ("--advantage-estimator", "reinforce_plus_plus", "--scale-rewards", "group"),
                "--scale-rewards 'group' does not fit advantage_estimator 'reinforce_plus_plus', "
                "which takes ('batch',)",
            ),
        ],
    ),
    (
        "Agents (--agent)",
        [
            Refusal(
                "an --agent module that does not import",
                ("--agent", "nomodule:play"),
                "--agent: cannot import 'nomodule' (No module named 'nomodule'); is it on PYTHONPATH?",
            ),
            Refusal(
                "an --agent that is not a function",
                ("--agent", "{tmp}/agent.py:LIMIT"),
                "--agent {tmp}/agent.py:LIMIT: int is not callable; expected FN(client, row)",
                files=(("agent.py", AGENT),),
            ),
            Refusal(
                "--tools beside --agent",
                ("--agent", "{tmp}/agent.py:play", "--tools", "interlens_mcore.tools.examples:calculator"),
                "--agent runs the agent's own code: --tools does not reach it (drop one)",
                files=(("agent.py", AGENT),),
            ),
            Refusal(
                "an --agent option without --agent",
                ("--agent-branches", "all"),
                "--agent-branches applies to the agent of --agent MODULE:FN: give one",
            ),
            Refusal(
                "a round wait of no time",
                ("--agent", "{tmp}/agent.py:play", "--agent-round-wait-s", "0"),
                "--agent-round-wait-s must be a number of seconds > 0, got 0",
                files=(("agent.py", AGENT),),
            ),
        ],
    ),
    (
        "Failed samples",
        [
            Refusal(
                "an unknown --on-sample-error",
                ("--on-sample-error", "ignore"),
                "--on-sample-error: invalid choice: 'ignore' (choose from 'skip', 'raise')",
            ),
            Refusal(
                "a --max-failed-fraction that is no share",
                ("--max-failed-fraction", "2"),
                "--max-failed-fraction must be in [0, 1], got 2.0",
            ),
            Refusal(
                "a step whose samples mostly failed (a scheduler raising for every sample)",
                (
                    "--multi-turn-scheduler",
                    "plugin:Always",
                    "--external-plugins",
                    "plugin.py",
                    "--dataset",
                    "q.jsonl",
                ),
                "16 of 16 samples failed at step 0 (scheduler: KeyError: 'solution' in conversation …); "
                "--max-failed-fraction 0.5; --on-sample-error raise stops the run at the first one instead",
                tested_by="tests/e2e/test_train_failures.py::test_every_sample_failing_ends_the_run_at_its_first_step",
            ),
        ],
    ),
    (
        "Reward models and judges",
        [
            Refusal(
                "--reward-model: no such folder",
                ("--reward-model", "{tmp}/rm"),
                "--reward-model {tmp}/rm: not a model folder (no config.json)",
            ),
            Refusal(
                "--reward-model: a causal LM, not a sequence classifier",
                ("--reward-model", "{tmp}/rm"),
                "--reward-model {tmp}/rm: not a sequence classifier (config.json architectures: "
                "['Qwen2ForCausalLM']); expected a ...ForSequenceClassification folder, as "
                "AutoModelForSequenceClassification saves it",
                files=(("rm/config.json", CAUSAL_LM), ("rm/model.safetensors", "(weights)")),
            ),
            Refusal(
                "--reward-model: weights not in safetensors",
                ("--reward-model", "{tmp}/rm"),
                "--reward-model {tmp}/rm: no safetensors weights (*.safetensors); weights are read from "
                "safetensors only, never unpickled: save the model with save_pretrained(folder) "
                "(safe_serialization is the default)",
                files=(("rm/config.json", CLASSIFIER), ("rm/pytorch_model.bin", "(a pickle)")),
            ),
            Refusal(
                "--reward-model-label past the labels",
                ("--reward-model", "{tmp}/rm", "--reward-model-label", "2"),
                "--reward-model-label 2: the classifier in {tmp}/rm has 1 labels (expected an index in "
                "[-1, 0]; -1: the last)",
                files=(("rm/config.json", CLASSIFIER), ("rm/model.safetensors", "(weights)")),
            ),
            Refusal(
                "--judge-model without --judge-template",
                ("--judge-model", "{tmp}/judge"),
                "--judge-model needs --judge-template (the judge's folder and its prompt file go together)",
            ),
            Refusal(
                "--judge-template without {completion}",
                ("--judge-model", "{tmp}/judge", "--judge-template", "{tmp}/judge.txt"),
                "--judge-template {tmp}/judge.txt: no {completion} placeholder; the judge would not see "
                "what it scores",
                files=(("judge.txt", "Is {prompt} answered? score:"),),
            ),
            Refusal(
                "--judge-model: a sequence classifier",
                ("--judge-model", "{tmp}/rm", "--judge-template", "{tmp}/judge.txt"),
                "--judge-model {tmp}/rm: not a causal LM (config.json architectures: "
                "['Qwen2ForSequenceClassification']); the judge generates its verdict, so it needs a "
                "...ForCausalLM folder",
                files=(
                    ("rm/config.json", CLASSIFIER),
                    ("rm/model.safetensors", "(weights)"),
                    ("judge.txt", "{completion} score:"),
                ),
            ),
        ],
    ),
]

HEADER = """# Bad input

`launch/train_grpo.py` refuses each input below with one line on stderr,
`train_grpo.py: error: MESSAGE`, and exit code 2, before it writes anything (the refusals of
`--resume` come once the process group is up and write nothing either; checking the checkpoints
may have renamed a corrupt one `corrupt-step-NNNNNN`, and says so on a line of its own). Under
`torchrun` the agent adds its own report and exits 1 whatever the workers' code; run the same
command through `python launch/run.py` (torchrun's options, torchrun's agent) to keep the one
line and exit code 2, and a restart by `--max-restarts` of a refused run is refused again.

`…` stands for text that depends on the machine. Generated from `tests/support/bad_inputs.py`
(`python tests/support/bad_inputs.py > docs/bad-input.md`); `tests/e2e/test_bad_input_table.py` runs every
row (or the test it names) and checks this file against the table.
"""


def _cell(text: str) -> str:
    return text.replace("{tmp}/", "").replace("|", "\\|")


def _file(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    shown = first + (" …" if text.strip() != first else "")
    return f"`{shown}`" if shown else "(empty)"


def render() -> str:
    out = [HEADER]
    for title, rows in SECTIONS:
        out += [f"\n## {title}\n", "| input | command line | files | message |", "| --- | --- | --- | --- |"]
        for r in rows:
            line = " ".join(a if " " not in a else f"'{a}'" for a in r.args)
            env = " ".join(f"{k}={v}" for k, v in r.env)
            shown = f"{env} {line}".strip()
            files = "; ".join(f"`{name}`: {_file(text)}" for name, text in r.files)
            out.append(f"| {_cell(r.what)} | `{_cell(shown)}` | {_cell(files)} | {_cell(r.message)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
