"""detgate.train: a trainer whose logprobs are the batch_invariant sampler's, bit for bit.

    policy = Policy.from_pretrained("smollm2-135m-instruct", dtype="bfloat16")
    logprobs = policy.completion_logprobs(prompt_ids, completion_ids)  # differentiable
    loss.backward(); optimizer.step()                # on the fp32 master weights
    policy.save_pretrained(folder)                   # or serving_state_dict(): for the workers

Why the bits agree: train/ops.py. The mixed-precision rule: train/policy.py.
"""

from detgate.train.batch import Packed
from detgate.train.policy import Policy

__all__ = ["Packed", "Policy"]
