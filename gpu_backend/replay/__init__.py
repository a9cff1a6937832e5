"""The replay loop, its two backends (FlashInfer, the CPU access model) and its entry points."""
