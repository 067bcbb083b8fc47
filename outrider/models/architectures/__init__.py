"""One module per architecture, each registering itself with outrider.models.registry (discovered on first use)."""
