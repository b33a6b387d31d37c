"""The syncer: a state machine that judges, decides and applies merges (docs/design.md)."""
