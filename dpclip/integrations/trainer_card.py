"""What a ``DPTrainer`` releases outside ε besides its noisy steps (the lines its statement lists
as not covered), and the privacy section it adds to the model card the Hugging Face Trainer
writes (``create_model_card``, which ``push_to_hub`` calls): that card tabulates the exact
training and validation losses, so the statement goes with it (docs/python-api.md)."""

from __future__ import annotations

from pathlib import Path

LOGGED_LOSS = ("training loss logged by the Hugging Face Trainer (console, report_to integrations, the model card's "
               "training results): computed without noise from the private batches")
TIMED = ("the Trainer's timings (train_runtime, train_samples_per_second, train_steps_per_second in the logs and "
         "trainer_state.json): the private steps' wall time, which grows with the drawn batches' sizes")
EVALUATED = ("metrics and predictions of the Trainer's evaluate() and predict() (eval_loss, logits, in the logs, "
             "trainer_state.json and the model card's training results): computed without noise from the data they "
             "were given, private if it is")

PRIVACY_HEADING = "## Differential privacy (dpclip)"


def with_statement(card: Path, statement: list[str], restate: bool = False) -> None:
    """Append the privacy statement to the model card ``card`` (README.md) the Trainer just wrote:
    its ε, and what is not covered by ε, the table of training results above included. A card that
    has the section already gets it rewritten in its place; ``restate``: only such a card (what
    was released since the card was written, an evaluate() after it, must not leave it stale)."""
    if not card.is_file():
        return
    text = card.read_text(encoding="utf-8").rstrip("\n")
    after = ""
    if PRIVACY_HEADING in text:
        text, rest = text.split(PRIVACY_HEADING, 1)
        text = text.rstrip("\n")
        after = rest[rest.index("\n## "):].rstrip("\n") + "\n" if "\n## " in rest else ""
    elif restate:
        return
    section = [PRIVACY_HEADING, "", "Trained by dpclip's DPTrainer; `privacy.json` beside the weights holds the "
               "same statement. The training results above (training and validation loss, evaluate()'s metrics) "
               "are computed without noise: not covered by ε.", "", *(f"- {line}" for line in statement), ""]
    card.write_text(text + "\n\n" + "\n".join(section) + after, encoding="utf-8")
