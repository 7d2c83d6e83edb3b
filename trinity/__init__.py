"""trinity-mcore: fine-tune LLMs on megatron-core from one YAML file.

Importing this package must stay cheap and change nothing: no torch, megatron or mbridge at import
time, so that `trinity --help` and `trinity validate` start instantly. The patches of megatron-core and
torch are installed explicitly (`trinity.compat.install_all()`, by the workers and the CLI).
"""

__version__ = "0.1.0"
