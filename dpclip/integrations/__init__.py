"""dpclip where a training loop already exists (docs/python-api.md).

- :mod:`dpclip.integrations.private`: ``make_private``, the Opacus-style entry point for a
  plain PyTorch loop; :mod:`dpclip.integrations.loaders` and :mod:`dpclip.integrations.parts`, the
  loader, criterion and optimizer it returns;
- :mod:`dpclip.integrations.transformers`: ``DPTrainer``, a Hugging Face ``Trainer`` made
  private;
- :mod:`dpclip.integrations.setup`: what both share (plan, engine, the account of the steps).
"""
