"""The role engine (`RoleEngine`) and what it is made of: DDP / optimizer / LR schedule set-up
(`setup`), offload between phases (`offload`), megatron-core's optimizer on torch's fused kernels
(`fused_optimizer`), weight gradients fused into DDP's buffer (`grad_fusion`), weight loading by
source (`weights`)."""

from trinity.trainer.engine.engine import Denominator, LossFn, MicroBatch, RoleEngine, StepResult, forward_only

__all__ = ["Denominator", "LossFn", "MicroBatch", "RoleEngine", "StepResult", "forward_only"]
