"""Engine-agnostic transfer machinery (no engine imports): lease checks for pull-mode reads."""
