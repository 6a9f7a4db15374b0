#!/bin/bash
# Two nodes x 8 GPUs, one task per GPU; Lightning's SLURMEnvironment takes ranks from srun.
#SBATCH --job-name=layerwise-gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR}"
source .venv/bin/activate
export NCCL_DEBUG=WARN
srun python examples/train.py fit --config examples/configs/slurm_2x8.yaml
