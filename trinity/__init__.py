"""trinity-mcore: fine-tune LLMs on megatron-core from one YAML file.

Importing this package must stay cheap: no torch, megatron or mbridge at import time,
so that `trinity --help` and `trinity validate` start instantly.
"""

__version__ = "0.1.0"

from trinity import megatron_import as _megatron_import  # noqa: E402  (no torch: a finder for later)

_megatron_import.install()
