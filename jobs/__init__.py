"""Entry points for `ray job submit` (nightly regression, canary, batch generation)."""
