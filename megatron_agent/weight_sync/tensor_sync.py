"""The colocated weight path: the actor's weights handed to engines on the same machine
as tensor handles (`/update_weights_from_tensor`: shared memory on CPU, CUDA IPC on
GPU), instead of a broadcast over a weight-update group.

`WeightSync` with `transport: tensor` calls `send_tensor_bucket` for each bucket, in
its usual order of calls (pause, flush, begin; stages in turn; end, continue; the version
rides on each bucket):
the stage's source rank (DP 0, TP 0) packs the bucket into one buffer and posts its
handles to every engine, one serialized copy per engine TP rank (the wire format:
rollout/weight_tensors.py, SGLang's). The engines copy the weights out before they
answer, so the buffer is freed then.

It needs every engine on the machine of each stage's source rank (a handle names this
machine's shared memory or GPU memory): `placement.colocate` puts them there.
"""

from __future__ import annotations

import torch


def send_tensor_bucket(client, bucket: list[tuple[str, torch.Tensor]], ranks: dict[str, int], *,
                       weight_version: str | None = None, flattened: bool = True, timeout_s: float = 600.0) -> list:
    """Post one bucket's handles to every engine (`ranks`: URL -> its TP ranks, one
    serialized copy each); return their answers. Call between begin/end_weight_update."""
    from rollout.weight_tensors import FLATTENED, serialize, tensor_payload

    buffer, payload = tensor_payload(bucket, flattened=flattened)
    bodies = {url: {"serialized_named_tensors": [serialize(payload) for _ in range(n)],
                    "load_format": FLATTENED if flattened else None, "flush_cache": False,
                    "weight_version": weight_version}
              for url, n in ranks.items()}
    answers = client.post_all_async("/update_weights_from_tensor", bodies=bodies, timeout_s=timeout_s)
    result = answers.result(timeout=timeout_s)  # the engines have copied out of `buffer`
    del buffer
    return result

