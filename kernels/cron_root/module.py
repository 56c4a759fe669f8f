"""CronRootMultiheadAttention: a drop-in for nn.MultiheadAttention in causal self-attention.

Its parameters are laid out as nn.MultiheadAttention's (in_proj_weight [3E, E], in_proj_bias [3E], out_proj),
so a state_dict of one loads into the other. It takes nn.MultiheadAttention's arguments and refuses, in one
line each, what Cron Root cannot do: attention over another length (kdim/vdim, a key of another length),
extra key/value rows (add_bias_kv, add_zero_attn), padding masks, masks other than the causal one, and
returning attention weights (Cron Root never forms them).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .._common import HEAD_DIMS, HEAD_DIM_STEP
from .hybrid import cron_root_hybrid
from .reference import RELAY_THRESHOLD

NAME = "CronRootMultiheadAttention"


def _is_causal_mask(mask: torch.Tensor, n: int) -> bool:
    """nn.MultiheadAttention's causal attn_mask: [N, N], True (bool) or -inf (float) exactly above the diagonal."""
    if mask.dim() != 2 or tuple(mask.shape) != (n, n):
        return False
    above = torch.ones(n, n, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, above))
    return bool(((mask == float("-inf")) == above).all() and (mask.masked_fill(above, 0) == 0).all())


class CronRootMultiheadAttention(nn.Module):
    """Multi-head causal self-attention through Cron Root's O(N sqrt N) sparse pattern.

    Arguments as nn.MultiheadAttention's: embed_dim, num_heads, dropout, bias, add_bias_kv (False only),
    add_zero_attn (False only), kdim and vdim (None or embed_dim), batch_first, device, dtype. Cron Root's own,
    keyword-only: ``crossover`` (0, the default: the sparse pattern at every length; an int: dense causal SDPA
    below that length, as cron_root_hybrid; None: the crossover stored for this GPU), ``relay_threshold``,
    ``precision`` (float32 dots).

    ``dropout`` zeroes elements of the module's output (after out_proj) with that probability in training, as
    the original Cron Root module does; nn.MultiheadAttention instead drops attention weights, which Cron Root
    never forms. With dropout=0 or in eval mode the two compute the same layer.

    forward(query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
    average_attn_weights=True, is_causal=True) -> (output, None). query, key, value: [L, B, E] ([B, L, E] with
    batch_first, [L, E] unbatched), the same length L. The attention is always causal: ``is_causal=True``
    (the default) needs no mask; an ``attn_mask`` is accepted only as the causal mask (checked when is_causal
    is False). need_weights=True and key_padding_mask are refused.
    """

    __constants__ = ["batch_first"]

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None, dtype=None, *,
                 crossover: int | None = 0, relay_threshold: int = RELAY_THRESHOLD, precision: str = "tf32x3"):
        super().__init__()
        if type(embed_dim) is not int or type(num_heads) is not int or embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"{NAME}: embed_dim and num_heads must be positive ints, got {embed_dim!r} and "
                             f"{num_heads!r}")
        if embed_dim % num_heads:
            raise ValueError(f"{NAME}: embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        head_dim = embed_dim // num_heads
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"{NAME}: head dim {head_dim} (embed_dim {embed_dim} / num_heads {num_heads}) "
                             f"unsupported (supports multiples of {HEAD_DIM_STEP} from {HEAD_DIMS[0]} to "
                             f"{HEAD_DIMS[-1]})")
        for label, dim in (("kdim", kdim), ("vdim", vdim)):
            if dim is not None and dim != embed_dim:
                raise ValueError(f"{NAME}: {label}={dim} is not supported (keys and values must have embed_dim "
                                 f"{embed_dim}: Cron Root is self-attention)")
        if add_bias_kv or add_zero_attn:
            raise ValueError(f"{NAME}: add_bias_kv and add_zero_attn are not supported (they add key/value rows "
                             "outside the causal pattern)")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"{NAME}: dropout must be in [0, 1), got {dropout!r}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = self.kdim = self.vdim = embed_dim
        self._qkv_same_embed_dim = True
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dropout = dropout
        self.batch_first = batch_first
        self.add_zero_attn = False
        self.crossover = crossover
        self.relay_threshold = relay_threshold
        self.precision = precision
        self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
        self.register_parameter("q_proj_weight", None)
        self.register_parameter("k_proj_weight", None)
        self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self):
        # nn.MultiheadAttention's initialisation
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = False, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = True):
        if key_padding_mask is not None:
            raise ValueError(f"{NAME}: key_padding_mask is not supported (Cron Root attends to every earlier "
                             "position of its pattern; pad at the end of the sequence instead)")
        if need_weights:
            raise ValueError(f"{NAME}: need_weights=True is not supported: Cron Root does not compute attention "
                             "weights (pass need_weights=False; the second output is None)")
        unbatched = query.dim() == 2
        if query.dim() not in (2, 3) or key.shape != query.shape or value.shape != query.shape:
            raise ValueError(f"{NAME}: query, key and value must have one shape [L, B, E] ([B, L, E] with "
                             f"batch_first, [L, E] unbatched), got {tuple(query.shape)}, {tuple(key.shape)}, "
                             f"{tuple(value.shape)}")
        if query.shape[-1] != self.embed_dim:
            raise ValueError(f"{NAME}: embedding size {query.shape[-1]} differs from embed_dim {self.embed_dim}")
        n = query.shape[-2] if unbatched else query.shape[1 if self.batch_first else 0]
        if attn_mask is None and not is_causal:
            raise ValueError(f"{NAME}: is_causal=False without a mask is not supported (Cron Root is causal "
                             "self-attention: leave is_causal=True or pass the causal attn_mask)")
        if attn_mask is not None and not is_causal and not _is_causal_mask(attn_mask, n):
            raise ValueError(f"{NAME}: attn_mask is supported only as the causal mask ([L, L], True or -inf "
                             "exactly above the diagonal)")
        same = query is key and key is value
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        b, e, h, d = query.shape[0], self.embed_dim, self.num_heads, self.head_dim
        if same:       # one projection; q, k, v are [B, H, L, D] views of it, read in place by the kernel
            qkv = nn.functional.linear(query, self.in_proj_weight, self.in_proj_bias).unflatten(-1, (3, h, d))
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        else:
            weights = self.in_proj_weight.chunk(3)
            biases = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
            q, k, v = (nn.functional.linear(x, w, bb).unflatten(-1, (h, d)).transpose(1, 2)
                       for x, w, bb in zip((query, key, value), weights, biases))
        out = cron_root_hybrid(q, k, v, crossover=self.crossover, relay_threshold=self.relay_threshold,
                               precision=self.precision)
        out = self.out_proj(out.transpose(1, 2).reshape(b, n, e))
        if self.dropout > 0.0 and self.training:
            out = nn.functional.dropout(out, self.dropout)
        if unbatched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, None
