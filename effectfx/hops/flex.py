"""flex_attention in captured code: eager's CPU kernel, recorded op by op.

Eager ``flex_attention`` on CPU runs ``math_attention``: the scores ``q @ k^T * scale``, the ``score_mod`` and
``mask_mod`` applied under ``vmap``, a softmax and ``@ v``.  During a capture the higher-order op is taken
over before torch dispatches it and that same kernel runs with the tracer on the stack, so the graph holds
its aten ops (inside a region: one body for every layer) and the run computes what eager computes.  A
``score_mod`` is traced as any code is: an effect inside it is recorded where the kernel calls it.

Under autograd eager refuses on CPU ("FlexAttention does not support backward on CPU", raised when the
inputs require grad, before any computation); the capture refuses at the same point, with an
:class:`~effectfx.errors.UnsupportedOperatorError` naming the region and the user's line.
"""

from __future__ import annotations

from typing import Any

import torch.nn.attention.flex_attention as api
from torch._higher_order_ops.flex_attention import FlexAttentionHOP, sdpa_dense

from ..errors import UnsupportedOperatorError
from ..graph.source import user_location
from ..interposers.interpose import interpose
from ..interposers.takeover import take_over
from ..regions.decorator import active_tracer


def capture_flex_attention(tracer: Any, *args: Any, **kwargs: Any) -> Any:
    return sdpa_dense(*args, **kwargs)  # eager's CPU kernel, recorded by the tracer


def _install() -> None:
    """Eager flex_attention's checks, as the capture must see them: its refusal under autograd named for
    the user, and no hand-over to torch.compile."""
    validate = api._validate_device

    def validate_device(query: Any, key: Any, value: Any) -> None:
        try:
            validate(query, key, value)
        except NotImplementedError as exc:
            raise UnsupportedOperatorError(
                f"{active_tracer().where()} calls flex_attention on tensors that require grad at "
                f"{user_location()}.\nEager PyTorch refuses this too ({exc}). Run it under torch.no_grad() "
                "or on detached tensors, or use torch.nn.functional.scaled_dot_product_attention with an "
                "attention mask."
            ) from None

    interpose(api, "_validate_device", validate_device)

    class NoCompileWhileCapturing:
        """``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG``, true also on a capturing thread: eager flex_attention
        then calls the op instead of handing it to ``torch.compile`` (which skips every frame under the
        tracer and then fails for want of a compiled one).  Read only outside Dynamo."""

        def __init__(self, value: Any) -> None:
            self.value = value

        def __bool__(self) -> bool:
            return bool(self.value) or active_tracer() is not None

    flag = api._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    interpose(api, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", NoCompileWhileCapturing(flag), per_thread=False)


take_over(FlexAttentionHOP, capture_flex_attention)
_install()
