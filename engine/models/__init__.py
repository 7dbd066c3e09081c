"""Model definitions (Hugging Face weight names), their loader, and where models
come from (``sources/``: Hub downloads, GGUF files prepared into a directory).

Nothing is imported here, so the torch-free ``sources`` (what ``pdfleet
fetch-model`` runs in an init container) do not pull in the model classes.
"""
