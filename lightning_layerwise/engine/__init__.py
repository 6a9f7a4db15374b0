"""The engine: data-parallel training with layer-wise ownership, on torch alone.

Flat buffers and buckets (``buffers``), the collectives on them (``collectives``), the
process groups (``process_groups``), the gradient side (``grad_sync``: accumulation,
reduce-scatter, what each rank steps), the parameter side (``param_sync``: all-gathers
overlapped with the forward, and the ``read_guard`` that keeps every read current; with
sharded parameters ``sharded``: when each bucket is gathered and freed), the
wrapper that composes them (``data_parallel``), global-norm clipping (``clip``) and the
scoped patches that make torch's gradient utilities see through the sharding
(``grad_utils``). Nothing here imports Lightning.
"""
