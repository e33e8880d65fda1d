"""Version numbers: the package's, and the plugin API's (see docs/plugins.md)."""

__version__ = "0.1.0"

# The plugin API version. A plugin declares the range it supports as a PEP 440
# specifier in its module attribute ``CORE_PLUGIN_API`` (e.g. ">=1.0,<2").
# Compatibility promise: minor bumps only add hooks, optional Platform methods with
# defaults, or optional AttentionMetadata fields; a major bump may change or remove
# any of them.
PLUGIN_API_VERSION = "1.5"
"""1.1: ``core_op_overrides`` also receives the engine's ``config``; new hook
``core_model_configs``. 1.2: ``Platform.batch_shaper`` (static-shape steps, see
core.batch_shape) and ``core.attention.build_metadata``. 1.3: the optional
``LinearMethod.apply_silu_and_mul`` (a weight format may apply the MLP's activation in its
kernel's epilogue; default: its ``apply``, then the op). 1.4: the optional
``LinearMethod.apply_rope`` (a format may rotate a fused QKV layer's query and key heads in
its epilogue; default: None, the model rotates). 1.5: the optional
``LinearMethod.folds_norm`` / ``adds_residual`` (a format may apply the RMSNorm before a
projection, or the residual add after one, in its kernel, taking keyword ``norm`` /
``residual``; default: no, the model applies them)."""
