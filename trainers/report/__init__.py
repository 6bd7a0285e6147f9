"""What a run reports: `reporter` (metrics.jsonl, tensorboard / wandb, the progress line, the
reward plot), `record` (one step's figures, gathered over ranks) and `plot`."""
