"""What the tests share: `dist` (N real gloo processes with a deadline), `launch` (the launch
scripts under torchrun or python, with a deadline), `fakes` (engines and environments for what a
test is not about) and `play` (task rows played through co_step)."""
