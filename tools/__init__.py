"""Asset builders and generated references, run as modules from the repository root
(`python -m tools.train_tiny ...`):

  build_tiny_corpus        the tiny model's English training text (data/tiny_corpus/)
  make_tiny_tokenizer      the tiny BPE tokenizers (k3jax/assets/tiny*.tiktoken)
  train_tiny               trains and exports the embedded `tiny` model
  synthetic_k3             random K3-format Hugging Face checkpoints (the conversion tests' input)
  make_synthetic_checkpoint  a multi-GB synthetic checkpoint (conversion memory measurements)
  make_k3_format_fixtures  golden prompts from the checkpoint's own encoding_k3.py
  gen_config_doc           docs/configuration.md from the entry points' argparse and EngineArgs
"""
