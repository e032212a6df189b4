"""Third-party evaluation clients run against a live loragate server (lm-evaluation-harness)."""
