"""Train the example character-level GPT with ``Trainer(strategy="layerwise")`` and Muon.

Run from the repository root (after ``bash scripts/setup_env.sh examples``)::

    # the main job: 2 CPU processes, a few minutes
    .venv/bin/python examples/train.py fit --config examples/configs/cpu.yaml

    # one GPU, eight GPUs on one machine, a multi-node SLURM job (see docs/slurm.sh)
    python examples/train.py fit --config examples/configs/gpu1.yaml
    python examples/train.py fit --config examples/configs/gpu8.yaml
    srun python examples/train.py fit --config examples/configs/slurm_2x8.yaml

    # tensor parallelism: 4 CPU processes, 2 data-parallel x 2 tensor-parallel (docs/usage.md)
    .venv/bin/python examples/train.py fit --config examples/configs/tp_cpu.yaml

    # any option from the command line, e.g. AdamW instead of Muon, your own text
    python examples/train.py fit --config examples/configs/cpu.yaml \
        --model.optimizer torch.optim.AdamW --model.optimizer.lr 3e-3 --data.text_path my.txt
    python examples/train.py fit --config examples/configs/cpu.yaml --print_config

The corpus is the Python standard library's source on this machine (no
download); ``--data.text_path`` trains on any text file instead.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_layerwise  # noqa: E402,F401  (registers strategy="layerwise")
from examples.data import CharDataModule  # noqa: E402
from examples.module import GPTLightningModule  # noqa: E402


class GPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The vocabulary comes from the corpus; the model is built with it.
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def main(args=None) -> GPTCLI:
    return GPTCLI(GPTLightningModule, CharDataModule, save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
