"""Each family's stage vocabulary, one module per family (`VOCABULARY` in each)."""
