"""KIVI evaluation pipeline."""
