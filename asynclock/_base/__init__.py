"""The leaves: validated options, cancellation-proof cleanup, events, exceptions."""
