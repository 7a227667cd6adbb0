"""Tests of passes/ (one module per pass)."""
