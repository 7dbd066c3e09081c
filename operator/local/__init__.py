"""The local runtime: an InferenceService as processes on one machine (`pdfleet up`)."""
