"""The load floor of a trained model: how uneven a batch's expert load is with the balancing biases held fixed.

A balancing rule sets the biases before it sees a batch, so the batch-to-batch spread of the routing is beyond
it. This routes ``--batches`` consecutive training batches through a checkpoint without any update and reports the
worst layer's max/mean expert load per batch (mean and maximum), the floor any bias controller faces at that batch
shape. One JSON line.

    python benchmarks/routing_floor.py runs/tiny/checkpoints/step-00000300 ~/.cache/zaya/datasets/shakespeare-bpe4096-v1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def main() -> None:
    from zaya.checkpoint.consolidate import load_for_inference
    from zaya.data.bundle import PreparedDataset
    from zaya.data.loader import validation_batches

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a training checkpoint or model directory")
    parser.add_argument("dataset", help="the prepared dataset the model was trained on")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per batch (tiny: 16)")
    parser.add_argument("--batches", type=int, default=40)
    args = parser.parse_args()

    model, _, _ = load_for_inference(args.checkpoint)
    e = model.config.num_experts
    worst = []
    with torch.no_grad():
        for x, _, _ in validation_batches(PreparedDataset(args.dataset), args.seq_len, args.batch_size,
                                       max_batches=args.batches, split="train"):
            counts = model(x).tokens_per_expert[:, :e].double()
            worst.append(float((counts.max(1).values / counts.mean(1)).max()))
    print(json.dumps({"checkpoint": args.checkpoint, "batches": len(worst), "tokens_per_batch":
                      args.seq_len * args.batch_size, "worst_layer_max_over_mean_mean": round(statistics.fmean(worst), 4),
                      "worst_layer_max_over_mean_max": round(max(worst), 4)}))


if __name__ == "__main__":
    main()
