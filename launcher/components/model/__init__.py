"""The model group: the built-in GPT and Hugging Face causal LMs."""
