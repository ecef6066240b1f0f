"""TRL integration: a drop-in for TRL's fused LM head computed by memgrad's chunked kernels.

Example::

    from memgrad_hf.grpo import add_fused_lm_head
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
"""

from memgrad_hf.grpo.fused_head import SUPPORTED_OUTPUTS, add_fused_lm_head, patch_trl, unpatch_trl

__all__ = ["SUPPORTED_OUTPUTS", "add_fused_lm_head", "patch_trl", "unpatch_trl"]
