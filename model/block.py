"""One transformer layer: (Engram) → attention site → FFN site, joined by Single-Pass mHC (reference §2.8, §4.2).

a_pre, a_post, a_comb = mixes(hc_attn, X)
X ← hc_expand(attn(attn_norm(collapse(X, pre_prev))), X, a_post, a_comb)     pre_prev: previous FFN site's pre
f_pre, f_post, f_comb = mixes(hc_ffn, X)
X ← hc_expand(ffn(ffn_norm(collapse(X, a_pre))), X, f_post, f_comb)          → hands f_pre to the next layer

Each update is made in the next site's coefficient pass over X (`expand_mixes`): the attention site's in the FFN
mixes', the FFN site's in the next block's attention mixes' (the block hands it on as an `Update`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from model import kernels
from model.attention import Attention
from model.config import ModelArgs
from model.engram import Engram
from model.linear import Fp8Act, norm_share, param_dtype
from model.mhc import Update
from model.moe import MoE
from model.norm import RMSNorm, collapse_norm
from model.parallel import SINGLE, Parallel


class Block(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        layer: int,
        projection_only: bool = False,
        dtype: torch.dtype | None = None,
        parallel: Parallel = SINGLE,
    ):
        """`projection_only`: layer L/2 in an encoder-only model keeps just attn_norm and its KV projections;
        `parallel`: which routed experts this rank holds."""
        super().__init__()
        self.args, self.layer = args, layer
        C, n = args.hidden_size, args.hc_mult
        self.attn_norm = RMSNorm(C, args.rms_norm_eps, dtype)
        self.attn = Attention(args, layer, projection_only, dtype)
        if projection_only:
            return
        self.ffn_norm = RMSNorm(C, args.rms_norm_eps, dtype)
        self.ffn = MoE(args, layer, dspark=layer >= args.num_hidden_layers, dtype=dtype, parallel=parallel)
        fp32 = param_dtype("fp32", dtype or torch.get_default_dtype())
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty((2 + n) * n, n * C, dtype=fp32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros((2 + n) * n, dtype=fp32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=fp32)))
        if args.role(layer).engram:
            self.engram = Engram(args, layer, dtype)

    def mixes(self, site: str, X: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The site's mHC coefficients (pre, post, comb) of its input stream X."""
        a = self.args
        return kernels.hc_coefficients(
            X, *self._mix_params(site), a.hc_mult, a.hc_sinkhorn_iters, a.rms_norm_eps, a.hc_eps,
            backend=kernels.backend_for(X),
        )  # fmt: skip

    def expand_mixes(self, site: str, X: Tensor, update: Update | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The site before's residual `update` made on X (none to make: X as it is) and `mixes(site, X')`, in one pass
        (Single-Pass mHC: the update and the next prediction fused) → (X', pre, post, comb)."""
        if update is None:
            return X, *self.mixes(site, X)
        a = self.args
        return kernels.hc_expand_coefficients(
            update.out, X, update.post, update.comb, *self._mix_params(site), a.hc_mult, a.hc_sinkhorn_iters,
            a.rms_norm_eps, a.hc_eps, backend=kernels.backend_for(X),
        )  # fmt: skip

    def _mix_params(self, site: str) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(getattr(self, f"hc_{site}_{name}") for name in ("fn", "scale", "base"))  # type: ignore[return-value]

    def attention_input(self, X: Tensor, pre: Tensor) -> Tensor:
        return collapse_norm(X, pre, self.attn_norm.weight, self.attn_norm.eps)

    def forward(
        self,
        X: Tensor,
        pre: Tensor,
        attend: Callable[[Tensor, Tensor | Fp8Act], Tensor],
        update: Update | None = None,
    ) -> tuple[Tensor, Tensor, Update]:
        """X [B, T, n, C] with `update`, the block before's FFN update not yet made on it (None: none), and pre
        [B, T, n] (that FFN site's input mix) → (X, this FFN site's pre-mix, this FFN site's update, not yet made:
        the next block makes it in its first pass over X, or `Update.apply`).

        `attend(x, xq)` runs this layer's attention (dense or packed-cache form) on the collapsed, normed input x and
        its FP8 cast xq, which come from one pass (`norm_share`), as the FFN's do.
        """
        X, a_pre, a_post, a_comb = self.expand_mixes("attn", X, update)
        out = attend(*norm_share(X, pre, self.attn_norm, self.attn.wq_a))
        X, f_pre, f_post, f_comb = self.expand_mixes("ffn", X, Update(out, a_post, a_comb))
        x, xq = norm_share(X, a_pre, self.ffn_norm, self.ffn.shared_experts.w1)
        return X, f_pre, Update(self.ffn(x, xq), f_post, f_comb)
