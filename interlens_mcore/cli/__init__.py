"""What the launch scripts share: `args` (the command line and YAML, generated from the config
dataclasses), `build` (parsed options -> checked plug-ins, process groups, backend, trainer) and
`quiet` (filters for third-party warnings, imported before megatron-core or DeepSpeed)."""
