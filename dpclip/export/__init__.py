"""``dpclip export``: a trained run as a model directory the ecosystem loads (docs/export.md).

- :mod:`dpclip.export.run`: :func:`export_run`, the entry point (which checkpoint, the output
  folder, atomic writing);
- :mod:`dpclip.export.model`: the weights (transformers ``save_pretrained``, a peft
  adapter and its base, or plain safetensors with ``model_card.json``);
- :mod:`dpclip.export.card`: the privacy statement (``privacy.json``) and ``README.md``;
- :mod:`dpclip.export.load`: :func:`load_exported`, a plain-torch export's module back.

Only released quantities leave the run directory: the weights, the recipe, the privacy
statement. Never the secret files (checkpoint ``state.*``, ``meta.json``,
``audit/canaries.json``) nor exact diagnostics (docs/accounting.md, "Threat model").
"""

from dpclip.export.load import load_exported
from dpclip.export.run import ExportResult, export_run

__all__ = ["ExportResult", "export_run", "load_exported"]
