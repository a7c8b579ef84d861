"""Data: builtin sets, local files, Hugging Face datasets, the split and the sampler."""
