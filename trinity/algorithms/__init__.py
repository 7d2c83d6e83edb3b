"""Pure-torch RL algorithms (CPU-testable, no megatron imports).

- `advantages`: GRPO group-normalised outcome advantages, PPO GAE, masked mean/var/whitening.
- `kl`: token-wise KL estimators (kl/k1, abs, mse/k2, low_var_kl/k3) and the in-reward KL penalty.
- `losses`: PPO-clip policy loss with dual clip, entropy and KL losses, clipped value loss, loss
  aggregation modes with exact global normalisation across micro batches, `actor_loss`.
- `logprob`: log-probs and entropy from vocab-parallel (tensor-parallel) logits, chunked fp32.
Modes are the config's enums (`trinity.config.schema.KLEstimator`, `LossAggMode`).
"""
