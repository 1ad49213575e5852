"""Tests of dampednewton.diagnostics."""
