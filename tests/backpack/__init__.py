"""Tests of dampednewton.backpack."""
