"""Model implementations in plain torch with Hugging Face names and files."""
