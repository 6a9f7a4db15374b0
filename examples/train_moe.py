"""Train the example mixture-of-experts GPT with expert parallelism: ``LayerwiseStrategy(expert_parallel_size=2)``.

Run from the repository root (after ``bash scripts/setup_env.sh examples``)::

    # 4 CPU processes as 2 expert-parallel ranks x 2 expert data-parallel ranks
    .venv/bin/python examples/train_moe.py fit --config examples/configs/moe_cpu.yaml

    # resume its sharded checkpoint at another expert-parallel size, e.g. every expert on each of 2 ranks
    .venv/bin/python examples/train_moe.py fit --config examples/configs/moe_cpu.yaml --trainer.devices 2 \
        --trainer.strategy.init_args.expert_parallel_size 1 --trainer.max_steps 300 \
        --ckpt_path runs/moe/moe_gpt/version_0/checkpoints/<name>.ckpt
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_layerwise  # noqa: E402,F401  (registers strategy="layerwise")
from examples.data import CharDataModule  # noqa: E402
from examples.moe import MoEGPTLightningModule  # noqa: E402


class MoECLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def main(args=None) -> MoECLI:
    return MoECLI(MoEGPTLightningModule, CharDataModule, save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
