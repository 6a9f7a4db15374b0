"""The engine: data-parallel training with layer-wise ownership, on torch alone.

Flat buffers and buckets (``buffers``), the collectives on them (``collectives``), the
process groups (``process_groups``), the gradient side (``grad_sync``: accumulation,
reduce-scatter, what each rank steps; its per-parameter records in ``grad_records``, a split
parameter's ``.grad`` marker in ``split_gradient``), the parameter side (``param_sync``: all-gathers
overlapped with the forward, and the ``read_guard`` that keeps every read current; with
sharded parameters ``sharded``: when each bucket is gathered and freed), the
wrapper that composes them (``data_parallel``; its set-up in ``wrapper_setup`` and ``sharded_init``,
the checks of the wrapped module in ``module_checks``, the ``replica_check``, and its ``release``),
global-norm clipping (``clip``, its reductions in ``clip_reductions``) and the scoped patches that
make torch's gradient utilities see through the sharding (``grad_utils``, which find the wrapper
behind a tensor in ``live_wrappers``); every patch of torch's and Lightning's objects goes through
``patches``.
Nothing here imports Lightning.
"""
