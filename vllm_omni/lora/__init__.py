"""Shared LoRA request type and helpers for every stage kind."""
