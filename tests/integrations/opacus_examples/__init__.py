"""Opacus's MNIST and char-LSTM examples in Opacus's own style, and each switched to dpclip
(tests/integrations/test_opacus_examples.py counts the changed lines and runs both)."""
