"""``python -m lightning_layerwise [MODEL]``: a model's layout at several data-parallel sizes, printed, without a
process group (:func:`~lightning_layerwise.layout.describe_layout` for each).
"""

from __future__ import annotations

from typing import Sequence

from .layout import DEFAULT_BUCKET_SIZE, describe_layout, newton_schulz_cost, numel_cost


def _main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import importlib

    parser = argparse.ArgumentParser(
        prog="python -m lightning_layerwise",
        description="Print the shard-aligned layout (padding, buckets, per-rank cost) of a model.",
        epilog="Also: python -m lightning_layerwise consolidate SRC DST writes a sharded checkpoint directory "
               "as one file (for load_from_checkpoint, strategy='ddp', torch.load).",
    )
    parser.add_argument("model", nargs="?", default="examples.gpt:example_gpt",
                        help="'module:callable' returning an nn.Module when called with no "
                             "arguments (default: the example GPT; run from the repository root)")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE)
    parser.add_argument("--cost", choices=["newton_schulz", "numel"], default="newton_schulz")
    parser.add_argument("--optimizer", choices=["muon", "adamw", "other"], default="muon",
                        help="which parameters element-wise fill may split, as LayerwiseStrategy decides it: the "
                             "AdamW groups of lightning_layerwise.Muon (default), every parameter (AdamW, SGD…), "
                             "or none (an optimizer not known to be element-wise, or elementwise_fill=False)")
    args = parser.parse_args(argv)
    module_name, _, attr = args.model.partition(":")
    model = getattr(importlib.import_module(module_name), attr)()
    cost_fn = newton_schulz_cost if args.cost == "newton_schulz" else numel_cost
    elementwise = None
    if args.optimizer == "muon":
        from .optim.param_groups import route_parameters

        adamw = {r.name for r in route_parameters(model) if not r.use_muon}
        elementwise = lambda name, p: name in adamw  # noqa: E731
    elif args.optimizer == "adamw":
        elementwise = lambda name, p: True  # noqa: E731
    for dp in args.dp:
        print(describe_layout(model, dp, args.bucket_size, cost_fn, elementwise))
        print()


if __name__ == "__main__":
    _main()
