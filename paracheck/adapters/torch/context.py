"""Whether torch's `context_parallel` runs attention on this rank's device: asked once per device type, by running it.

A spec whose model enters `context_parallel` itself says so (`context_parallel = True`); on a cp layout the kit
first runs torch's context-parallel attention once on the layout's "cp" mesh (causal SDPA on a small sequence
shard, every rank alike). Where it raises, the case is a skip naming what torch said: on CPU, torch 2.13 shards only
the CUDA SDPA kernels (flash, efficient, cudnn), and `aten._scaled_dot_product_flash_attention_for_cpu` "does not
have a sharding strategy registered"; forcing the math kernel mixes the causal mask, a plain tensor, with the
sharded DTensors. The answer is kept per device type: the kernels are the device's, not the layout's.
"""

from __future__ import annotations

import torch

from paracheck.world.recent import Recent

#: device type -> why torch's context_parallel cannot run there, or None where it runs (`world.recent`: asked again
#: in another world).
_KNOWN = Recent(4, "torch context_parallel probe")


def problem(mesh, device) -> str | None:
    """Why torch's context_parallel cannot run causal attention on `device` (over `mesh["cp"]`); None where it runs.
    Collective where it runs (every rank of the world asks at the same case)."""
    return _KNOWN.get(device.type, lambda: _probe(mesh["cp"], device))


def _probe(cp_mesh, device) -> str | None:
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel

    size = cp_mesh.size()
    q, k, v = (torch.ones(1, 1, 2 * size, 8, device=device) for _ in range(3))
    try:
        with context_parallel(cp_mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except (NotImplementedError, RuntimeError) as exc:  # the kernel's sharding, refused at dispatch
        first = str(exc).splitlines()[0] if str(exc) else ""
        return (f"torch's context_parallel cannot run attention on {device.type}: {type(exc).__name__}: {first} "
                f"(torch {torch.__version__.split('+')[0]} shards the CUDA SDPA kernels only)")
    return None
