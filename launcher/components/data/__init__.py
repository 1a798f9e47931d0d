"""The data group: sources -> records -> formats -> tokens (cached) -> packed sequences -> a resumable sampler."""
