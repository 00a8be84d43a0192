"""Sharding for k3jax: mesh (mesh.py), partition rules (rules.py), expert-parallel MoE (moe_ep.py),
sharded step (step.py), multi-host runtime (distributed.py, launch.py, check.py). See docs/sharding.md."""
