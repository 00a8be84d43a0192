#!/usr/bin/env python
"""Write a synthetic K3-format checkpoint (random weights, Moonshot names, MXFP4 experts) of a chosen size.

    python -m tools.make_synthetic_checkpoint --out /tmp/k3-wide --size-gb 3

A wide variant of the `tiny` preset: hidden/latent/expert widths and the expert count are scaled so
that single stacked tensors are hundreds of MB; layers are added until the total reaches --size-gb.
Used to measure the converter's peak memory (docs/performance.md, "Checkpoint conversion"); not part of the test suite.
"""
import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tools import synthetic_k3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size-gb", type=float, default=3.0)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--expert-inter", type=int, default=2048)
    p.add_argument("--latent", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--shard-gb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if os.path.exists(a.out):
        p.error(f"{a.out} exists")
    layers = 2
    while synthetic_k3.approx_bytes(synthetic_k3.wide_config(layers + 1, a.hidden, a.experts, a.expert_inter, a.latent, a.vocab)) \
            <= a.size_gb * 2**30:
        layers += 1
    raw = synthetic_k3.wide_config(layers, a.hidden, a.experts, a.expert_inter, a.latent, a.vocab)
    t = time.time()
    _, _, total = synthetic_k3.write_checkpoint(a.out, raw, seed=a.seed, shard_bytes=int(a.shard_gb * 2**30),
                                                keep_params=False)
    print(f"{a.out}: {layers} layers, {total / 2**30:.2f} GiB of tensors in {time.time() - t:.0f} s")


if __name__ == "__main__":
    main()
