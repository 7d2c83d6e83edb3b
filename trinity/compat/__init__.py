"""Every patch trinity makes to megatron-core 0.16.1 and torch, one module each, installed explicitly.

Importing trinity installs nothing. `install_all()` installs what must be in place before megatron-core
is imported (the workers call it through `trinity.launch.child.setup()`, the CLI in `trinity.cli.main`,
the test suite in tests/conftest.py); the others are installed where the job decides they apply. Each
`install()` / `enable()` first checks that what it replaces still exists (`trinity.compat.checks`) and
names the pinned megatron-core version where not. docs/architecture.md, "megatron-core patches",
lists them with what each replaces; each module's first line states what it is worth.

- `megatron_import`: the light import of megatron-core (`install_all()`);
- `quiet`: megatron-core's and torch's known harmless warnings filtered (not a patch);
- `cpu_compat`: megatron-core on CPU with gloo (`enable()` by `trinity.distributed.parallel.init_parallel`);
- `lazy_dynamo`: torch.optim without torch._dynamo (CPU jobs' optimizer set-up);
- `fused_optimizer`: megatron-core's optimizer on torch's fused kernels (optimizer set-up);
- `grad_fusion`: apex's weight-gradient GEMM contract on torch (DDP set-up of eager CUDA layers);
- `rope`: megatron-core's fused RoPE entry points (model build without TransformerEngine);
- `te_absent`: the names megatron-core leaves wrong without TransformerEngine (layer spec build);
- `scoped`: megatron-core module attributes replaced for one block (the dist-checkpoint loader).
- `optimizer_state`: the distributed optimizer's checkpoint methods on its instances for one call (save and
  resume through `trinity.trainer.engine.optimizer_state`).
"""

from __future__ import annotations


def install_all() -> None:
    """Install the patches that must precede `import megatron.core` in this process (idempotent; cheap:
    imports neither torch nor megatron)."""
    from trinity.compat import megatron_import

    megatron_import.install()
