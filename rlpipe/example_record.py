"""A well-formed group record with every field set, to vary one field at a time: the schema
tests' round trips and malformed records, the queue's and the learner's tests, and the
poisoned records a fault run forges (launch/cluster.py ``Cluster.inject_poison``).
"""

from __future__ import annotations

import numpy as np

from rlpipe.schema import GroupRecord, Sample


def make_record(**overrides) -> GroupRecord:
    samples = [
        Sample(np.array([5, 6, 2], dtype=np.int32), np.array([-0.1, -0.5, -0.01], dtype=np.float32), "stop", 1.0),
        Sample(np.array([7, 2], dtype=np.int32), np.array([-2.0, -0.3], dtype=np.float32), "length", 0.0,
               versions=np.array([3, 4], dtype=np.int32), reward_info={"parsed": "7"}),
    ]
    fields = dict(run_id="run", group_id="ab" * 16, prompt_id="17", worker_id="w0", policy_version=3,
                  policy_version_end=4, precision="fp8", quant_profile="abc123",
                  sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": 11},
                  prompt_tokens=np.array([1, 5, 14, 6, 17], dtype=np.int32), samples=samples,
                  created_at=1.5, gen_seconds=0.25)
    fields.update(overrides)
    return GroupRecord(**fields)
