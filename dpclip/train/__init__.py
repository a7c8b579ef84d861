"""The training workflow: recipe -> data, model, engine, ledger, run directory."""
