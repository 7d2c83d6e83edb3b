"""The algorithm registry and the pure-torch RL algorithms (CPU-testable, no megatron imports).

- `registry`: one `AlgorithmSpec` per `algorithm.name` (roles, data, defaults, rules, advantages, policy
  loss, evaluation, recipe); imports nothing of the project, so the config schema builds on it.
- `advantages`: GRPO group-normalised outcome advantages, PPO GAE, RLOO, REINFORCE++, masked
  mean/var/whitening; `ESTIMATORS`, the specs' advantage estimators by name.
- `kl`: token-wise KL estimators (kl/k1, abs, mse/k2, low_var_kl/k3) and the in-reward KL penalty.
- `losses`: PPO-clip policy loss with dual clip, entropy and KL losses, clipped value loss, loss
  aggregation modes with exact global normalisation across micro batches, `actor_loss`.
- `cispo`: CISPO's clipped importance-weight loss (algorithm.name: cispo).
- `dapo`, `dpo`: DAPO's overlong penalty and group filter, DPO's losses.
- `logprob`: log-probs and entropy from vocab-parallel (tensor-parallel) logits, chunked fp32.
- `modes`: the loss aggregation modes and KL estimators the config names (`LossAggMode`, `KLEstimator`).
"""
