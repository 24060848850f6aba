"""`detgate rl`: on-policy RL whose sampler and trainer compute the same numbers.

Rollouts are sampled through the gateway (recorded, seeded) by batch_invariant workers; the
trainer (`detgate.train`) recomputes the logprobs of the sampled tokens in one differentiable
pass over the training batch; a group-relative policy gradient step updates its fp32 master
weights; the serving weights are pushed to every worker before the next step. With invariant
numerics on both sides the sampler and the trainer agree bit for bit, so KL(sampler || trainer)
is exactly 0 at every step and no importance weighting is needed.
"""
