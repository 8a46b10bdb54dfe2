"""What the fork's CPU overlay (patches/cpu/) imports in place of CUDA-only pieces of upstream's Ray path.

- flash_attn's padding helpers, which upstream's ring_attn_utils imports at module level: pure-torch equivalents
  on flash_attn's layout (used by the packed-sample path, `--ds.packing_samples`). The tests' import shims
  register the same functions as `flash_attn.bert_padding` / `flash_attn.utils.distributed`.
- The actor -> vLLM weight-sync group: upstream builds vLLM's PyNcclCommunicator on a StatelessProcessGroup;
  `gloo_weight_sync_group` builds a gloo process group on the same kind of store, with PyNccl's `broadcast` call.
"""

from datetime import timedelta

import torch
import torch.distributed as dist
from einops import rearrange

__all__ = [
    "GlooWeightSync",
    "all_gather",
    "gloo_weight_sync_group",
    "index_first_axis",
    "pad_input",
    "rearrange",
    "unpad_input",
]


def index_first_axis(x, indices):
    """Rows `indices` of x flattened over its first axis: (N, ...) -> (len(indices), ...)."""
    return x.reshape(-1, *x.shape[1:])[indices]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(B, S, ...) + mask (B, S) -> (T, ...) kept tokens, flat indices (T,), cu_seqlens (B+1,), max len, lengths."""
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    flat = rearrange(hidden_states, "b s ... -> (b s) ...")
    return flat[indices], indices, cu_seqlens, int(seqlens.max()), seqlens


def pad_input(hidden_states, indices, batch, seqlen):
    """Inverse of unpad_input: (T, ...) -> (batch, seqlen, ...) with zeros at padded positions."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def all_gather(tensor, group):
    """flash_attn.utils.distributed.all_gather: concatenate every rank's tensor along dim 0."""
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


class GlooWeightSync:
    """PyNcclCommunicator's `broadcast(tensor, src, stream)` on a gloo process group (CPU tensors; no stream)."""

    def __init__(self, group):
        self.group = group

    def broadcast(self, tensor, src, stream=None):
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor], opts).wait()


def gloo_weight_sync_group(master_address, master_port, rank, world_size, timeout_s=1800):
    """A gloo group outside torch.distributed's default group (DeepSpeed's), rendezvous as vLLM's
    StatelessProcessGroup does (a TCPStore served by rank 0), so the actor's rank 0 and every vLLM worker join it."""
    from vllm.distributed.utils import StatelessProcessGroup

    stateless = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
    store = dist.PrefixStore("openrlhf_geo_weight_sync", stateless.store)
    return GlooWeightSync(dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s)))
