"""Analysis tools: theory predictions and measurements on recorded activations."""
