"""The two names megatron-core 0.16.1 leaves wrong without TransformerEngine: without them every MoE forward and every MLA build fails.

- `transformer.moe.moe_utils.te_general_gemm`: imported only when TE imports, but the MoE router
  (RouterGatingLinearFunction) tests `te_general_gemm is not None` unconditionally, so without TE every MoE
  forward raises NameError, on GPUs too. Defined as None, which selects the torch path.
- `transformer.multi_latent_attention.HAVE_TE`: the module imports TE's layer classes from megatron's
  extension, which without TE binds them to MagicMocks and still sets HAVE_TE; its
  `isinstance(linear_proj, TELinear)` then raises TypeError on building any MLA layer. Without TE it must
  read False.
"""

from __future__ import annotations

from trinity.compat.checks import require


def install(have_te: bool) -> None:
    """Correct both names for a process where TransformerEngine imports (`have_te`) or not (idempotent)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla

    require("te_absent", mla, "HAVE_TE")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not have_te:
        mla.HAVE_TE = False
