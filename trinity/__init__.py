"""trinity-mcore: fine-tune LLMs on megatron-core from one YAML file.

Importing this package must stay cheap: no torch, megatron or mbridge at import time,
so that `trinity --help` and `trinity validate` start instantly.
"""

__version__ = "0.1.0"
