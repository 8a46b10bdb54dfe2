"""Single-process engine (CPU or one GPU) and the embedded demo."""
