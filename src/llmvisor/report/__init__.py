"""The HTML report and the end-to-end demo that writes it."""
