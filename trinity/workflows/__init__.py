"""Multi-turn and tool-using workflows: a Python coroutine per task drives a `Session` whose turns an engine
generates, and returns an `Episode` (the conversation, its training sequences, the reward). docs/workflows.md.

Import from the modules (`trinity.workflows.runner`, `.session`, ...): this package's import stays light so
that the config schema can read `trinity.workflows.registry` without torch.
"""
